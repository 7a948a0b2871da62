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

# Two workers, a test module each at a time: compiles are single-threaded, so two cores give nearly twice the
# speed, and module-scoped fixtures (one compile per module) stay in one process.
TEST_WORKERS ?= 2
test: $(STAMP)
	JAX_PLATFORMS=cpu $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=15 tests

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
