# `make demo` and `make test` are the only two commands a newcomer needs.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
# One stamp per install: `make demo` installs the core only (the demo is offline and needs
# no driver or SDK); `make test` installs [dev]. Each keeps its own stamp, so either still
# knows what it installed after the other ran in the same .venv.
STAMP := $(VENV)/.installed-dev
DEMO_STAMP := $(VENV)/.installed-demo

.PHONY: demo test lint typecheck clean bench

# Test processes: three on two cores. Most of the suite waits (on processes, leases and
# servers): measured on this machine, the whole suite used about one core with three, and
# took 804 s against 942 s with two. Each test still runs alone in its process, with
# servers, ports and key prefixes of its own. A file's tests stay in one process, in order:
# some build on the ones before (the README's blocks).
TEST_WORKERS ?= 3

$(PY):
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "python3.11 not found; set PYTHON=/path/to/python3.11" >&2; exit 2; }
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev]"
	@touch $(STAMP)

# pydantic and the kit itself: no pip upgrade, no extras.
$(DEMO_STAMP): $(PY) pyproject.toml
	$(PY) -m pip install -q --disable-pip-version-check -e ".[demo]"
	@touch $(DEMO_STAMP)

# The console's browser tests drive Debian's Chromium; installed here when it is missing and
# we may (root with apt), else those tests say why they skip.
.PHONY: chromium
chromium:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	  { apt-get install -y -q chromium >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && \
	    apt-get install -y -q chromium >/dev/null; }; }; } || echo "chromium not installed: the console's browser tests will skip" >&2

# The PostgreSQL pooler tests start Debian's PgBouncer (in /usr/sbin); installed here when it
# is missing and we may (root with apt), else those tests say why they skip (under CI=true
# they fail instead).
.PHONY: pgbouncer
pgbouncer:
	@{ command -v pgbouncer || test -x /usr/sbin/pgbouncer; } >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	  { apt-get install -y -q pgbouncer >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && \
	    apt-get install -y -q pgbouncer >/dev/null; }; }; } || echo "pgbouncer not installed: the PostgreSQL pooler tests will skip" >&2

demo: $(DEMO_STAMP)
	$(VENV)/bin/tesserix demo

lint: $(STAMP)
	$(VENV)/bin/ruff check --no-cache src tests benchmarks examples
	$(VENV)/bin/ruff format --no-cache --check src tests benchmarks examples

typecheck: $(STAMP)
	$(VENV)/bin/mypy --strict src

test: lint typecheck chromium pgbouncer
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15

# The full reliability profile (tests/reliability, docs/reliability.md); ends with one line
# of figures per backend.
.PHONY: torture
torture: $(STAMP)
	@rm -f .torture-figures.json
	ADK_TORTURE=1 ADK_TORTURE_FIGURES=.torture-figures.json $(PY) -m pytest -q -p no:cacheprovider tests/reliability; \
	status=$$?; \
	if [ -f .torture-figures.json ]; then $(PY) tests/reliability/figures.py .torture-figures.json; rm -f .torture-figures.json; fi; \
	exit $$status

# Every backend and peer on one conversation (docs/performance.md); BENCH=--quick for a
# couple of minutes. Figures and plots land in benchmarks/results/.
BENCH ?=
bench: $(STAMP)
	$(PY) -m pip install -q -e ".[bench]"
	$(PY) benchmarks/turns.py $(BENCH)
	$(PY) benchmarks/workers.py --quick

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
