# Everything a fresh clone needs is one command away: `make run` or `make test` install first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
export HOOKLINE_AMQP_URL ?= amqp://guest:guest@localhost:5672/

.PHONY: install browser run test test-services test-soak test-cluster test-fuzz lint unit bench clean

install: $(STAMP)

# uv installs the same pinned set as pip in 12 s rather than 45 (it reads no pip.conf: where only pip
# reaches the index, pip installs instead). Compiled at install, as pip does: where processes may not
# write .pyc files (PYTHONDONTWRITEBYTECODE, as on this machine) every start would compile every import.
INSTALL_ARGS := -c constraints.txt -e '.[dev]' --config-settings editable_mode=strict

# Reinstall when the dependencies change, or when a module is added or removed (the editable install
# links each file, so a directory's mtime is what tells).
$(STAMP): pyproject.toml constraints.txt $(shell find shared services receiver cli -type d -not -name __pycache__)
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "installing into $(VENV) (log: $(VENV)/install.log)"
	@$(BIN)/python -m pip install -c constraints.txt uv > $(VENV)/install.log 2>&1 || { cat $(VENV)/install.log; exit 1; }
	@$(BIN)/uv pip install --python $(BIN)/python --compile-bytecode $(INSTALL_ARGS) >> $(VENV)/install.log 2>&1 \
		|| $(BIN)/python -m pip install $(INSTALL_ARGS) >> $(VENV)/install.log 2>&1 \
		|| { cat $(VENV)/install.log; exit 1; }
	@# The editable install's own tree (links to the sources) is compiled too: uv compiles site-packages
	@# only, and every process that imports hookline (the suite starts a hundred) compiled it anew.
	@$(BIN)/python -m compileall -q build >> $(VENV)/install.log 2>&1
	@touch $(STAMP)

# RabbitMQ (and for the tests PostgreSQL) started first when the address is this machine's and nothing
# answers there; when it is not installed, one line says the command that installs it.
LOCAL_SERVICES := $(BIN)/python -m hookline.cli.localservices

run: $(STAMP)
	@$(LOCAL_SERVICES) HOOKLINE_AMQP_URL
	@scripts/run-local.sh

test-services: $(STAMP)
	@$(LOCAL_SERVICES) HOOKLINE_TEST_AMQP_URL HOOKLINE_TEST_POSTGRES_URL

lint: $(STAMP)
	$(BIN)/ruff check shared services receiver cli tests bench
	$(BIN)/ruff format --check shared services receiver cli tests bench
	$(BIN)/mypy -p hookline.shared -p hookline.ingest -p hookline.dispatcher -p hookline.health_monitor -p hookline.receiver -p hookline.outbox_relay -p hookline.cli

unit: $(STAMP)
	$(BIN)/pytest tests/unit -q

browser:
	@scripts/install-browser.sh

# Test modules run three at a time, and the few that change the broker for everyone (an alarm, a
# restart: marked serial) beside them on a RabbitMQ node of their own, or after them, alone, where no
# such node can be started (scripts/run-tests.sh).
export TEST_WORKERS ?= 3
test: test-services lint browser
	@scripts/run-tests.sh

# Every service killed, the broker restarted, connections cut and stalled, all under load (a few minutes):
# published = delivered + dead-lettered, nothing lost.
test-soak: $(STAMP)
	@$(LOCAL_SERVICES) HOOKLINE_TEST_AMQP_URL
	$(BIN)/pytest tests/soak -q -s

# Three RabbitMQ nodes on this machine (scripts/start-rabbitmq-cluster.sh), one of them killed under load.
test-cluster: $(STAMP)
	$(BIN)/pytest tests/cluster -q -s

# The ingest's API fuzzed deeper than make test does: 100 examples per operation, a new seed each run
# (its report, and a failure's message, name the seed; HOOKLINE_FUZZ_SEED=N runs that one again).
test-fuzz: $(STAMP)
	@$(LOCAL_SERVICES) HOOKLINE_TEST_AMQP_URL
	HOOKLINE_FUZZ_EXAMPLES=100 HOOKLINE_FUZZ_SEED=$${HOOKLINE_FUZZ_SEED:-random} \
		$(BIN)/pytest tests/integration/test_fuzz.py -q

bench: $(STAMP)
	$(BIN)/python -m bench.run

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .pytest_cache .ruff_cache
