# The seeded fault campaign (tests/faults, issue 12): a split and a planned promotion on
# host processes (MariaDB, ZooKeeper on 127.0.0.1) under the kit's writer, one fault per
# run (SIGKILL, a lost ZooKeeper reply, a second operation) at a seeded instant, the
# documented recovery, then the checker. Runs after `integration` in `make test`.
#   make faults                     RUNS runs per operation (default: the tier's, sized for CI)
#   make faults SEED=1234           replay one run (both operations) from its seed
#   make faults SEED=1000 RUNS=200  a long campaign from seed 1000
# A failing run prints its seed and schedule and leaves them, the writer's history and the
# servers' logs in $(FAULTS_DIR)/<test>-seed<seed>.
.PHONY: faults
TEST_TIERS += faults

FAULTS_DIR ?= /tmp/shardfleet-faults

faults: deps
	@mkdir -p $(FAULTS_DIR)
	SHARDFLEET_FAULT_DIR=$(FAULTS_DIR) \
	$(if $(SEED),SHARDFLEET_FAULT_SEED=$(SEED)) $(if $(RUNS),SHARDFLEET_FAULT_RUNS=$(RUNS)) \
	$(PYTEST) -q -m faults tests/faults --basetemp=$(FAULTS_DIR)/pytest
