"""Training data: documents -> byte tokens -> packed sequences -> a Grain dataset -> per-process global batches.

The order of samples is a pure function of (seed, global sample index): batch `s` holds global samples
[s*B, (s+1)*B) of a Grain `MapDataset` shuffled afresh each epoch, and each process reads only its own rows.
So the data position is one integer, and a run resumed on any number of processes reads exactly the batches
an uninterrupted run would have read.
"""

from __future__ import annotations

import glob
import json
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import grain
import jax
import numpy as np

from scaletrain.errors import DataError
from scaletrain.tokenizer import BOS, PAD, encode

def stdlib_documents() -> list[bytes]:
    """The Python standard library's own source: present wherever Python is, identical for a given version."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    return [p.read_bytes() for p in files]


def file_documents(path: str, jsonl_field: str) -> list[bytes]:
    """Documents from a .txt/.jsonl file, a directory of them, or a glob: a text file is one document,
    each JSONL line's `jsonl_field` is one."""
    p = Path(path)
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.suffix in (".txt", ".jsonl"))
    elif p.is_file():
        files = [p]
    else:
        files = sorted(Path(f) for f in glob.glob(path))
    if not files:
        raise DataError(f"data.path '{path}' matches no files; expected a .txt or .jsonl file, a directory or a glob")
    docs = []
    for f in files:
        if f.suffix != ".jsonl":
            docs.append(f.read_bytes())
            continue
        for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                docs.append(json.loads(line)[jsonl_field].encode("utf-8"))
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
                raise DataError(f"{f}:{n}: expected a JSON object with a string field '{jsonl_field}' "
                                f"(data.jsonl_field)") from None
    return docs


class PackedSource:
    """Random access to fixed-length windows of the concatenated token stream (a Grain data source).

    Window i is tokens [i*T, i*T + T + 1): inputs and next-token targets. Documents keep their separators;
    segment ids keep attention inside a document and positions restart at each document's BOS.
    """

    def __init__(self, stream: np.ndarray, seq_len: int):
        self.stream, self.seq_len = stream, seq_len
        self.length = (len(stream) - 1) // seq_len
        if self.length < 1:
            raise DataError(f"the corpus has {len(stream)} tokens, fewer than one sequence of data.seq_len={seq_len}")

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        window = self.stream[i * self.seq_len: (i + 1) * self.seq_len + 1]
        tokens, targets = window[:-1], window[1:]
        starts = tokens == BOS
        segment_ids = np.cumsum(starts).astype(np.int32) + 1
        idx = np.arange(self.seq_len)
        positions = (idx - np.maximum.accumulate(np.where(starts, idx, 0))).astype(np.int32)
        # Predicting the next document's BOS from the previous one's EOS is not a thing to learn.
        loss_mask = ((targets != BOS) & (targets != PAD)).astype(np.float32)
        return dict(tokens=tokens, targets=targets, positions=positions, segment_ids=segment_ids,
                    loss_mask=loss_mask)


class SyntheticSource:
    """Uniform random tokens, a pure function of (seed, index): for benchmarks, needs no corpus."""

    def __init__(self, vocab_size: int, seq_len: int, seed: int):
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed

    def __len__(self) -> int:
        return 1 << 30

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        window = np.random.default_rng([self.seed, i]).integers(0, self.vocab_size, self.seq_len + 1, np.int32)
        return dict(tokens=window[:-1], targets=window[1:], positions=np.arange(self.seq_len, dtype=np.int32),
                    segment_ids=np.ones(self.seq_len, np.int32), loss_mask=np.ones(self.seq_len, np.float32))


def make_source(cfg):
    data = cfg.data
    if data.source == "synthetic":
        return SyntheticSource(cfg.model.vocab_size, data.seq_len, cfg.seed)
    docs = stdlib_documents() if data.source == "stdlib" else file_documents(data.path, data.jsonl_field)
    return PackedSource(np.concatenate([encode(d) for d in docs]), data.seq_len)


def make_dataset(cfg) -> grain.MapDataset:
    """Shuffled afresh every epoch (Grain reseeds per epoch), infinitely repeated, randomly accessible."""
    return grain.MapDataset.source(make_source(cfg)).shuffle(seed=cfg.seed).repeat()


@dataclass
class BatchIterator:
    """Yields this process's rows of each global batch; its whole state is the next batch's index."""

    dataset: grain.MapDataset
    global_batch: int
    process_index: int = 0
    process_count: int = 1
    step: int = 0

    def __post_init__(self):
        if self.global_batch % self.process_count:
            raise DataError(f"train.global_batch={self.global_batch} must be divisible by the "
                            f"{self.process_count} processes that load it")
        self.local_batch = self.global_batch // self.process_count

    def get_state(self) -> dict:
        return {"step": self.step}

    def set_state(self, state: dict) -> None:
        self.step = int(state["step"])

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        first = self.step * self.global_batch + self.process_index * self.local_batch
        rows = [self.dataset[i] for i in range(first, first + self.local_batch)]
        self.step += 1
        return {k: np.stack([r[k] for r in rows]) for k in rows[0]}


def make_iterator(cfg, dataset: grain.MapDataset | None = None) -> BatchIterator:
    return BatchIterator(dataset if dataset is not None else make_dataset(cfg), cfg.train.global_batch,
                         jax.process_index(), jax.process_count())


def to_global(local: dict[str, np.ndarray], sharding) -> dict[str, jax.Array]:
    """Assemble each process's rows into global arrays sharded over the batch axes."""
    return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in local.items()}
