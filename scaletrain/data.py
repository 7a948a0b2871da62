"""Training data: documents -> byte tokens -> packed sequences -> a Grain dataset -> per-process global batches.

The order of samples is a pure function of (seed, global sample index): batch `s` holds global samples
[s*B, (s+1)*B) of a Grain `MapDataset` shuffled afresh each epoch, and each process reads only its own rows.
So the data position is one integer, and a run resumed on any number of processes reads exactly the batches
an uninterrupted run would have read.
"""

from __future__ import annotations

import fnmatch
import glob
import json
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import grain
import jax
import numpy as np
from etils import epath

from scaletrain.errors import DataError
from scaletrain.tokenizer import BOS, encode

def stdlib_documents() -> list[bytes]:
    """The Python standard library's own source: present wherever Python is, identical for a given version."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    return [p.read_bytes() for p in files]


def _glob(pattern: str) -> list[epath.Path]:
    """Files matching a glob, local or gs://: the pattern's parts from the first wildcard on are matched
    below the folder its earlier parts name; a `**` part stands for any number of folders (none included)."""
    parts = pattern.split("/")
    first = next(i for i, part in enumerate(parts) if glob.has_magic(part))
    folder = epath.Path("/".join(parts[:first]) or ("/" if pattern.startswith("/") else "."))
    rest = tuple(parts[first:])
    if not any("**" in part for part in rest):
        return [f for f in folder.glob("/".join(rest)) if f.is_file()]
    # epath refuses `**` in bucket globs (and pathlib's differs from glob's): the folder's files are listed and
    # matched here.
    files = _files(folder) if folder.is_dir() else []
    return [f for f in files if _matches(f.relative_to(folder).parts, rest)]


def _matches(parts: tuple[str, ...], pattern: tuple[str, ...]) -> bool:
    if not pattern:
        return not parts
    if pattern[0] == "**":
        return any(_matches(parts[i:], pattern[1:]) for i in range(len(parts) + 1))
    return bool(parts) and fnmatch.fnmatchcase(parts[0], pattern[0]) and _matches(parts[1:], pattern[1:])


def _files(folder: epath.Path) -> Iterator[epath.Path]:
    """The files below a folder. Listed folder by folder: epath's rglob refuses buckets, and its walk drops the
    gs:// of the paths it yields."""
    for entry in folder.iterdir():
        if entry.is_dir():
            yield from _files(entry)
        else:
            yield entry


def file_documents(path: str, jsonl_field: str) -> list[bytes]:
    """Documents from a .txt/.jsonl file, a directory of them, or a glob, on local disk or in a bucket
    (gs://): a text file is one document, each JSONL line's `jsonl_field` is one."""
    p = epath.Path(path)
    if glob.has_magic(path):
        files = sorted(_glob(path))
    elif p.is_dir():
        files = sorted(f for f in _files(p) if f.suffix in (".txt", ".jsonl"))
    else:
        files = [p] if p.is_file() else []
    if not files:
        raise DataError(f"data.path '{path}' matches no files; expected a .txt or .jsonl file, a directory or a glob")
    docs = []
    for f in files:
        if f.suffix != ".jsonl":
            docs.append(f.read_bytes())
            continue
        try:
            text = f.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{f}: not UTF-8 text (byte {e.start}); JSONL files must be UTF-8") from None
        for n, line in enumerate(text.splitlines(), 1):
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
        if self.length < 1:  # also an empty corpus
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
        loss_mask = (targets != BOS).astype(np.float32)
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
    encoded = [encode(d) for d in docs if d]
    return PackedSource(np.concatenate(encoded) if encoded else np.zeros(0, np.int32), data.seq_len)


def make_dataset(cfg) -> grain.MapDataset:
    """Shuffled afresh every epoch (Grain reseeds per epoch), infinitely repeated, randomly accessible."""
    return grain.MapDataset.source(make_source(cfg)).shuffle(seed=cfg.seed).repeat()


def process_rows(batch_sharding, global_batch: int) -> np.ndarray:
    """The rows of the global batch that this process's devices hold, ascending: only these are loaded.
    Replicas across processes load the same rows; any device order works."""
    index_map = batch_sharding.addressable_devices_indices_map((global_batch, 1))
    return np.unique(np.concatenate([np.arange(*index[0].indices(global_batch)) for index in index_map.values()]))


@dataclass
class BatchIterator:
    """Yields this process's rows of each global batch. Its whole state is the global index of the next
    batch's first sample, so a resumed run may change the number of processes or even the batch size."""

    dataset: grain.MapDataset
    global_batch: int
    rows: np.ndarray | None = None  # rows of each global batch to load; None: all of them
    next_sample: int = 0

    def __post_init__(self):
        if self.rows is None:
            self.rows = np.arange(self.global_batch)

    def get_state(self) -> dict:
        return {"next_sample": self.next_sample}

    def set_state(self, state: dict) -> None:
        self.next_sample = int(state["next_sample"])

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        samples = [self.dataset[self.next_sample + int(r)] for r in self.rows]
        self.next_sample += self.global_batch
        return {k: np.stack([s[k] for s in samples]) for k in samples[0]}


def make_iterator(cfg, batch_sharding, dataset: grain.MapDataset | None = None) -> BatchIterator:
    return BatchIterator(dataset if dataset is not None else make_dataset(cfg), cfg.train.global_batch,
                         process_rows(batch_sharding, cfg.train.global_batch))


def to_global(local: dict[str, np.ndarray], sharding, global_batch: int) -> dict[str, jax.Array]:
    """Assemble each process's rows into global arrays sharded over the batch axes."""
    return {k: jax.make_array_from_process_local_data(sharding, v, (global_batch, *v.shape[1:]))
            for k, v in local.items()}
