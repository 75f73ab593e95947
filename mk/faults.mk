# The seeded fault campaign (tests/faults, issue 12; docs/faults.md): six families on host
# processes (MariaDB, a 3-node ZooKeeper ensemble on 127.0.0.1, moto's S3) under the kit's
# writer: planned and emergency promotions, splits, open-ranges, and a backup and a restore
# beside a rebuild of the standby (backup_rebuild) or a split onto the pair (backup_split);
# one fault per run at a seeded instant, the documented recovery, then the checker. Runs
# after `integration` in `make test`.
#   make faults                     200 runs (shared among the families)
#   make faults SEED=1234           replay one run of each family from its seed
#   make faults FAULTS_WORKERS=1    one pytest process (the runs one after another)
#   make faults SEED=1234 K=split   ... of test_split.py only: split, backup_split (pytest -k)
#   make faults SEED=1000 RUNS=2000 a long campaign from seed 1000
# A failing run prints its seed and schedule and leaves them, the writer's history and the
# servers' logs in $(FAULTS_DIR)/<family>-seed<seed>.
.PHONY: faults
TEST_TIERS += faults

FAULTS_DIR ?= /tmp/shardfleet-faults
# Two pytest workers, each with its own ZooKeeper ensemble and MariaDB servers: most of a
# run is waiting (a lock's session to expire, a partition to heal, a server to start),
# so two fit on 2 cores (measured: 43 runs in 255 s with two workers, 370 s with one).
FAULTS_WORKERS ?= 2
# The base seed: SEED, or a random one (printed; every worker must draw the same runs).
FAULT_SEED := $(or $(SEED),$(shell python3 -c 'import random; print(random.SystemRandom().randrange(1, 10**6))'))
FAULT_RUNS := $(or $(RUNS),$(if $(SEED),1,200))

faults: deps
	@mkdir -p $(FAULTS_DIR)
	@echo "fault campaign: base seed $(FAULT_SEED), $(FAULT_RUNS) run(s) (make faults SEED=$(FAULT_SEED) RUNS=$(FAULT_RUNS) replays it)"
	SHARDFLEET_FAULT_DIR=$(FAULTS_DIR) SHARDFLEET_FAULT_SEED=$(FAULT_SEED) \
	SHARDFLEET_FAULT_RUNS=$(FAULT_RUNS) \
	$(PYTEST) -q -m faults tests/faults --basetemp=$(TEST_TMP)/shardfleet-faults -p no:cacheprovider \
	  $(if $(filter-out 1,$(FAULTS_WORKERS)),-n $(FAULTS_WORKERS)) $(if $(K),-k '$(K)')
