# shardfleet — `make test` is what CI runs (.ci/run); `make check` is the fast loop.
SHELL := /bin/bash
.DEFAULT_GOAL := help

VENV      ?= .venv
PY        := $(VENV)/bin/python
BIN       := $(abspath $(VENV))/bin
export PATH := $(BIN):$(PATH)
export ANSIBLE_CONFIG := $(CURDIR)/ansible.cfg
PYTEST    := $(BIN)/pytest
STAMP     := $(VENV)/.installed

# Test tiers `make test` runs, in order. Files in mk/ add theirs.
TEST_TIERS := lint unit integration

.PHONY: help deps host-deps venv lint unit integration test check clean bench
help:
	@echo "make fleet       build the local container fleet (see README)"
	@echo "make test        install everything, run every test tier (CI)"
	@echo "make check       fast loop: lint + unit tests"
	@echo "make integration real MariaDB/ZooKeeper/Redis/memcached host processes"
	@echo "make bench       benchmarks (print ratios)"

host-deps:
	@scripts/bootstrap-host.sh

$(STAMP): requirements-dev.txt pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -U pip
	$(PY) -m pip install -q --disable-pip-version-check -r requirements-dev.txt -e .
	@touch $@

venv: $(STAMP)
deps: host-deps venv

RULES := roles/monitoring/files/rules/shardfleet.rules.yml

lint: venv
	$(BIN)/ruff check src tests bench plugins scripts
	$(BIN)/mypy src/shardfleet
	$(BIN)/yamllint -s .
	$(BIN)/ansible-lint --profile production
	@command -v promtool >/dev/null || { echo "lint: promtool is missing: make host-deps (Debian's prometheus)"; exit 1; }
	promtool check rules $(RULES)  # the monitoring role's alert rules
	promtool test rules $(RULES:.rules.yml=.rules.test.yml)  # a firing and a quiet series per rule (1 s)
	$(PYTEST) -q -p no:cacheprovider tests/unit/test_monitoring.py  # dashboard and runbook links
	$(PY) scripts/role_docs.py  # the README role tables = roles/*/meta/argument_specs.yml
	$(PYTEST) -q -p no:cacheprovider tests/collection  # the built collection, installed, used from outside (7-18 s)
	scripts/sanity.sh  # ansible-test sanity: the checks that run offline

# Two workers (pytest-xdist) for the unit and integration tiers: the unit tier is CPU
# (10,000 generated cases per parser), and an integration test keeps one core busy with
# the other idle while its servers answer (vmstat: 45% idle all through the tier); with a
# worker each, the tiers' wall time falls by about 40%. TEST_WORKERS=1 runs them in one
# process. The integration tier's --dist loadfile keeps a file's tests, and its module
# fixtures (servers), on one worker; the unit tier's three longest tests share a file.
TEST_WORKERS ?= 2
XDIST = $(if $(filter-out 1,$(TEST_WORKERS)),-n $(TEST_WORKERS))

unit: venv
	$(PYTEST) -q -m "not integration and not e2e" tests/unit $(XDIST)

# The integration and fault tiers' servers (MariaDB data directories, ZooKeeper logs) live
# under pytest's base temporary directory: on a tmpfs when there is one with 4 GiB free.
# Their fsyncs (DDL, ZooKeeper's transaction log) then cost nothing, and a SIGKILLed
# server loses nothing it would not lose on a disk (its writes are in the kernel's page
# cache either way); a 16-run fault sample took 122 s there against 172 s on /tmp.
TEST_TMP ?= $(shell d=/dev/shm; test -d $$d -a -w $$d && \
  test "$$(df -Pk $$d | awk 'NR==2 {print $$4}')" -gt 4194304 && echo $$d || echo /tmp)

integration: deps
	$(PYTEST) -q -m integration tests/integration --basetemp=$(TEST_TMP)/shardfleet-integration \
	  $(XDIST) $(if $(XDIST),--dist loadfile)

check: lint
	HYPOTHESIS_PROFILE=dev $(PYTEST) -q -m "not integration and not e2e" tests/unit

bench: deps
	$(PY) bench/route_overhead.py
	$(PY) bench/board_page.py
	$(PY) bench/create_shards.py
	$(PY) bench/split_cutover.py
	$(PY) bench/promote.py

-include mk/*.mk

# `make test` runs the tiers one after another. TEST_LANES runs them in lanes side by
# side (scripts/test-lanes.sh): a lane is a word, its tiers separated by commas, e.g.
#   make test TEST_LANES="lint,unit,integration,faults e2e aws-test,molecule"
# Not the default: so run beside two CPU hogs (load 30 on 2 cores), the e2e fleets'
# fresh site.yml ran past its 1,800 s bound and the aws tier's past 900 s.
comma := ,
lanes = $(foreach l,$(2),"$(addprefix $(1),$(subst $(comma), ,$(l)))")
TEST_LANES ?= 1

test: deps
ifeq ($(TEST_LANES),1)
	@set -e; for t in $(TEST_TIERS); do echo "=== tier: $$t"; s=$$(date +%s); \
	  $(MAKE) --no-print-directory $$t; echo "=== tier $$t passed in $$(( $$(date +%s) - s ))s"; done
else
	@test "$(sort $(TEST_TIERS))" = "$(sort $(subst $(comma), ,$(TEST_LANES)))" || \
	  { echo "TEST_LANES ($(TEST_LANES)) must name every tier of TEST_TIERS ($(TEST_TIERS))"; exit 2; }
	@scripts/test-lanes.sh $(call lanes,,$(TEST_LANES))
endif
	@echo "=== all tiers passed: $(TEST_TIERS)"

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
