# Two commands do the whole set-up: `make train` and `make test` (README.md).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
CPU_DEVICES ?= 8

.PHONY: venv train test bench bench-gpu clean

venv: $(STAMP)

# The stamp is rebuilt whenever pyproject.toml or constraints.txt changes: `make venv` is a no-op when current.
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[test]'
	touch $(STAMP)

train: $(STAMP)
	$(PY) train.py --config configs/llama_tiny.yaml --cpu-devices $(CPU_DEVICES)

# Two workers (compiles are single-threaded, so two cores give nearly twice the speed), each taking the next test
# when free; a module whose own module-scoped fixture would be computed in both stays whole on one worker
# (tests/conftest.py). The slowest 60 tests, each worker's busy time and the slowest modules close the output, before
# pytest's own count; every test's time is in runs/tests/junit.xml.
TEST_WORKERS ?= 2
test: $(STAMP)
	JAX_PLATFORMS=cpu $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --durations=60 \
		--junitxml=runs/tests/junit.xml tests

bench: $(STAMP)
	JAX_PLATFORMS=cpu $(PY) benchmarks/train_throughput.py

# On a machine with an NVIDIA GPU: JAX's CUDA plugin, then FlashNorm's Triton kernels timed against XLA - in
# training (forward + backward) and in decode (one norm + projection, then whole-model tokens/s).
bench-gpu: $(STAMP)
	$(PY) -m pip install --quiet -c constraints.txt -e '.[gpu]'
	$(PY) benchmarks/flashnorm.py gpu
	$(PY) benchmarks/decode.py norm --dtype bfloat16
	$(PY) benchmarks/decode.py e2e --dtype bfloat16 --new-tokens 64

clean:
	rm -rf $(VENV) runs
