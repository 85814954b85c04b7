# kokoro-parity: `make parity` installs and runs the main job; `make test` runs the test suite.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
ARGS   ?=

.PHONY: install parity matrix test heavy-tests bench bench-bisect profile clean-cache nightly dashboard upstream lint

# --no-compile: pip byte-compiles every module of torch, executorch, tvm, ... at install (most of
# the install's time); Python compiles the few hundred a run imports on first use instead.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q --no-compile -e ".[all]"
	touch $(STAMP)

# onnxruntime-web for the ort-web-* backends (web/package-lock.json pins it; npm's registry only);
# without npm those backends' items stay SKIPPED and the rest installs as before.
WEB_STAMP := web/node_modules/.installed
$(WEB_STAMP): web/package-lock.json
	@if command -v npm >/dev/null 2>&1; then \
		npm ci --prefix web --ignore-scripts --no-audit --no-fund --loglevel=error && touch $(WEB_STAMP); \
	else echo "npm not found: ort-web-wasm and ort-web-webgpu will be SKIPPED (install Node.js, then make install)"; fi

install: $(STAMP) $(WEB_STAMP)

# The main job: Kokoro's decoder on ExecuTorch+XNNPACK and the eager control, every shipped case,
# both modes, on the default model (rebuilt once from the packaged int8 ONNX). Run again with
# nothing changed, an item whose artifact and inputs already ran is judged on its saved outputs
# (the record says `cache.run: hit`); `make parity RUNS=` runs every item again.
# Two xdist workers: a lowering keeps one core busy for a minute or two, and the other worker
# lowers, exports or judges another case meanwhile (WORKERS=0: one process).
RUNS ?= --reuse-runs
WORKERS ?= 2
parity: install
	$(BIN)/pytest --backend=xnnpack --backend=eager -k decoder -n $(WORKERS) $(RUNS) $(ARGS)

# Every step x every installed backend x both modes (LSTM lowerings take minutes each).
matrix: install
	$(BIN)/pytest $(ARGS)

# Every case x step x installed backend x both modes into one history entry (reports/history/), JUnit
# XML (reports/junit/nightly.xml), regressions against the previous run, and the dashboard.
# Restrict it like `kokoro-parity run`: make nightly ARGS="--backend eager --step decoder".
nightly: install
	$(BIN)/kokoro-parity nightly --dashboard reports/dashboard $(ARGS)

# docs/upstream/: one standalone repro bundle per runtime defect the matrix found, regenerated and
# each run alone (no kokoro, no harness importable); fails when a defect no longer reproduces.
upstream: install
	$(BIN)/kokoro-parity upstream $(ARGS)

# The static site of the history: open reports/dashboard/index.html (no network needed).
dashboard: install
	$(BIN)/kokoro-parity dashboard $(ARGS)

# Benchmarks print figures (the last `make test`'s suite time against its 20-minute target; `make
# parity` cold on an empty cache and warm, each against its target; cold vs
# warm, harness vs bare script, per item; a port chain against its artifacts run alone); tests never
# time anything.
bench: install
	$(BIN)/python benchmarks/ci_time.py
	$(BIN)/python benchmarks/first_verdict.py --cold-and-warm
	$(BIN)/python benchmarks/bench.py $(ARGS)
	$(BIN)/python benchmarks/target_overhead.py
	$(BIN)/python benchmarks/chain_overhead.py
	$(MAKE) bench-bisect

# Bisection through each compiling backend: one seeded decoder fault each (en_short, dynamic), with
# its compiles and wall time; the 10-fault trial of docs/bisection.md is BISECT_FAULTS=10 BISECT_BACKENDS=xnnpack.
BISECT_BACKENDS ?= xnnpack portable onnxruntime tvm
BISECT_FAULTS ?= 1
bench-bisect: install
	for b in $(BISECT_BACKENDS); do \
		$(BIN)/python benchmarks/bisect_trial.py --backend $$b --faults $(BISECT_FAULTS) --kinds nan \
			--report-dir reports/bisect-trial/$$b || exit 1; done

# The code-shape targets of docs/design.md (lines, long functions, imports inside functions, ...),
# each figure against its target; it prints and never fails (ARGS=--strict: exit 1 when one is not met).
lint:
	$(PYTHON) benchmarks/code_shape.py $(ARGS)

# Where a lowering's time and memory go, phase by phase (ARGS="--step f0n", "--lstm 32", ...).
profile: install
	$(BIN)/python benchmarks/profile_lowering.py $(ARGS)

# Two xdist workers (the machines here have 2 cores; most slow tests wait on child processes), and
# the slowest tests named at the end so that CI time stays visible. Work stealing: the modules with
# the most slow tests are collected first (tests/unit/conftest.py) and a worker that runs out takes
# the other's last queued tests, so neither core sits idle at the end. Each test's seconds and the
# suite's wall time go to reports/junit/unit-tests.xml, which `make bench` reads (benchmarks/ci_time.py).
test: install
	$(BIN)/pytest tests/unit -n 2 --dist worksteal --durations=25 --junitxml=reports/junit/unit-tests.xml $(ARGS)

# Tests that run the real default model end to end for many minutes each (not in `make test`/CI):
# the packaged int8 whole-model ONNX judged and localized on en_short and ja, and the plugin on the
# default model's decoder on XNNPACK (CI runs its random-weight twin), and every module of the MLX rewrite
# on a clean run (CI runs its two fault tests; docs/design.md lists the pairs).
heavy-tests: install
	KOKORO_PARITY_HEAVY_TESTS=1 $(BIN)/pytest tests/unit -m slow -k "packaged_int8 or on_the_default_model or on_a_clean_run" $(ARGS)

clean-cache: install
	$(BIN)/kokoro-parity cache clear
