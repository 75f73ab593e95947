# The seeded fault campaign (tests/faults, issue 12; docs/faults.md): planned and emergency
# promotions, splits and open-ranges on host processes (MariaDB, a 3-node ZooKeeper
# ensemble on 127.0.0.1) under the kit's writer, one fault per run at a seeded instant,
# the documented recovery, then the checker. Runs after `integration` in `make test`.
#   make faults                     200 runs (shared among the operations)
#   make faults SEED=1234           replay one run of each operation from its seed
#   make faults SEED=1234 K=split   ... of the split only (a pytest -k filter)
#   make faults SEED=1000 RUNS=2000 a long campaign from seed 1000
# A failing run prints its seed and schedule and leaves them, the writer's history and the
# servers' logs in $(FAULTS_DIR)/<operation>-seed<seed>.
.PHONY: faults
TEST_TIERS += faults

FAULTS_DIR ?= /tmp/shardfleet-faults

faults: deps
	@mkdir -p $(FAULTS_DIR)
	SHARDFLEET_FAULT_DIR=$(FAULTS_DIR) \
	$(if $(SEED),SHARDFLEET_FAULT_SEED=$(SEED)) $(if $(RUNS),SHARDFLEET_FAULT_RUNS=$(RUNS)) \
	$(PYTEST) -q -m faults tests/faults --basetemp=$(FAULTS_DIR)/pytest $(if $(K),-k '$(K)')
