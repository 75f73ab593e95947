# shardfleet — the local container fleet, molecule and e2e tiers (included by the Makefile).
#   make image        base image for the fleet's containers (skipped when it exists)
#   make fleet        deps + image + containers + site.yml + smoke test + fleet table
#   make fleet-down   remove the fleet's containers and network
#   make fleet-add PAIR=pair003[,pair004]   add MySQL pairs (inventory, containers, mysql role)
#   make molecule     every role's molecule scenario (`molecule test`, with idempotence)
#   make e2e          site.yml on fresh containers + security tests (pytest -m e2e)

SHARDFLEET_IMAGE ?= localhost/shardfleet-base:bookworm
export SHARDFLEET_IMAGE
FLEET_INVENTORY   ?= inventories/local
ANSIBLE_PLAYBOOK  := $(BIN)/ansible-playbook -i $(FLEET_INVENTORY)

.PHONY: image fleet fleet-up fleet-down fleet-add fleet-status fleet-smoke molecule e2e \
  e2e-site e2e-ops

image: host-deps
	@scripts/build-image.sh

fleet-up: venv image
	$(ANSIBLE_PLAYBOOK) playbooks/fleet-up.yml

fleet: deps image fleet-up
	$(ANSIBLE_PLAYBOOK) playbooks/site.yml
	$(ANSIBLE_PLAYBOOK) playbooks/fleet-status.yml
	$(PY) scripts/fleet-smoke.py

fleet-status: venv
	$(ANSIBLE_PLAYBOOK) playbooks/fleet-status.yml

fleet-smoke: venv
	$(PY) scripts/fleet-smoke.py

fleet-add: venv image
	@test -n "$(PAIR)" || { echo "usage: make fleet-add PAIR=pair003[,pair004...]"; exit 2; }
	$(ANSIBLE_PLAYBOOK) playbooks/fleet-add.yml -e pair=$(PAIR)

fleet-down: venv
	$(ANSIBLE_PLAYBOOK) playbooks/fleet-down.yml
	rm -f .fleet/local.json

# The scenarios in two lanes side by side (scripts/test-lanes.sh): mysql, the longest
# (6 min), beside the other three one after another. Each scenario has its own containers
# and network (10.242.1x.0/24); most of a scenario is waiting on apt, systemd and the
# servers, so two share 2 cores. A lane stops at its first failure.
# A lane is a word; a comma separates its scenarios.
#   make molecule MOLECULE_LANES=memcached,redis,mysql,zookeeper   one after another
#   make molecule-redis                                            one scenario
MOLECULE_LANES ?= mysql memcached,redis,zookeeper
molecule: deps image
	@scripts/test-lanes.sh $(call lanes,molecule-,$(MOLECULE_LANES))

molecule-%: deps image
	$(BIN)/molecule test -s $*

# Two fleets side by side (scripts/test-lanes.sh), each with its own containers, network
# and CA (tests/e2e/conftest.py: SHARDFLEET_E2E_ID and SHARDFLEET_E2E_OCTET): e2e-site
# builds the fleet the site, drift, security, cache, monitoring and promotion tests read
# and change; e2e-ops builds another for the split, backup and physical split tests, one
# after another. E2E_OPS_TESTS= runs every test on one fleet.
E2E_OPS_TESTS ?= tests/e2e/test_zz_split.py tests/e2e/test_zzzz_backup.py \
  tests/e2e/test_zzzzz_split_physical.py
e2e: deps image
	@scripts/test-lanes.sh e2e-site $(if $(E2E_OPS_TESTS),e2e-ops)

e2e-site: deps image
	$(PYTEST) -q -m e2e tests/e2e $(addprefix --ignore=,$(E2E_OPS_TESTS))

e2e-ops: deps image
	SHARDFLEET_E2E_ID=e2eops SHARDFLEET_E2E_OCTET=2 $(PYTEST) -q -m e2e $(E2E_OPS_TESTS)

TEST_TIERS += molecule e2e
