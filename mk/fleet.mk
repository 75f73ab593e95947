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
MOLECULE_SCENARIOS ?= memcached redis mysql zookeeper
ANSIBLE_PLAYBOOK  := $(BIN)/ansible-playbook -i $(FLEET_INVENTORY)

.PHONY: image fleet fleet-up fleet-down fleet-add fleet-status fleet-smoke molecule e2e

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

# One scenario at a time (2 cores); the first failure stops the tier.
molecule: deps image
	@set -e; for s in $(MOLECULE_SCENARIOS); do \
	  echo "=== molecule test -s $$s"; start=$$(date +%s); \
	  $(BIN)/molecule test -s $$s; \
	  echo "=== molecule $$s passed in $$(( $$(date +%s) - start ))s"; \
	done

e2e: deps image
	$(PYTEST) -q -m e2e tests/e2e

TEST_TIERS += molecule e2e
