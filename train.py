"""Train a model: `python train.py --config configs/llama_tiny.yaml [--set KEY=VALUE]... [--cpu-devices N]`.

The same as `python -m scaletrain train ...`.
"""

import sys

from scaletrain.__main__ import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
