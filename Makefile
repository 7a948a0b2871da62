# Two commands do the whole set-up: `make train` and `make test` (CONTRACT.md).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
CPU_DEVICES ?= 8

.PHONY: venv train test bench clean

venv: $(STAMP)

# The stamp is rebuilt whenever pyproject.toml or constraints.txt changes: `make venv` is a no-op when current.
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[test]'
	touch $(STAMP)

train: $(STAMP)
	$(PY) train.py --config configs/llama_tiny.yaml --cpu-devices $(CPU_DEVICES)

test: $(STAMP)
	JAX_PLATFORMS=cpu $(PY) -m pytest -q tests

bench: $(STAMP)
	JAX_PLATFORMS=cpu $(PY) benchmarks/train_throughput.py

clean:
	rm -rf $(VENV) runs
