# Two commands do the whole set-up: `make train` and `make test` (README.md).
# jax 0.12 needs Python >= 3.12: the first of these that runs and is new enough makes the venv (pyenv's shims for a
# version not selected fail, so are passed over). `make PYTHON=/path/to/python3.12` chooses another.
PYENV_ROOT ?= $(HOME)/.pyenv
PYTHON_CANDIDATES := python3 python3.12 python3.13 python3.14 $(wildcard $(PYENV_ROOT)/versions/3.1[2-9]*/bin/python3)
PYTHON_OK := -c 'import sys; sys.exit(sys.version_info < (3, 12))'
ifndef PYTHON
PYTHON := $(shell for p in $(PYTHON_CANDIDATES); do $$p $(PYTHON_OK) 2>/dev/null && { command -v $$p; break; }; done)
endif
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
CPU_DEVICES ?= 8

.PHONY: venv train test bench bench-gpu clean

venv: $(STAMP)

# The stamp is rebuilt whenever pyproject.toml or constraints.txt changes: `make venv` is a no-op when current. A venv
# of an older Python (made before the move to jax 0.12) is made anew. No pip cache: the test extras' torch is PyPI's CUDA
# build (~4.5 GB installed), and a cached copy of every wheel beside the venv nearly doubles the disk the set-up needs.
$(STAMP): pyproject.toml constraints.txt
	@$(PY) $(PYTHON_OK) 2>/dev/null || { \
		test -n "$(PYTHON)" || { echo "make: no Python >= 3.12 found (jax 0.12 needs it): install python3.12 and its venv module, or pyenv install 3.12, or pass PYTHON=/path/to/python3.12"; exit 1; }; \
		echo "rm -rf $(VENV) && $(PYTHON) -m venv $(VENV)"; rm -rf $(VENV) && $(PYTHON) -m venv $(VENV); }
	$(PY) -m pip install --quiet --no-cache-dir --upgrade pip
	$(PY) -m pip install --quiet --no-cache-dir -c constraints.txt -e '.[test]'
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
