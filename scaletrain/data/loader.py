"""Training data: documents -> tokens -> packed windows -> a Grain dataset -> per-process global batches.

The order of samples is a pure function of (seed, global sample index): batch `s` holds global samples
[s*B, (s+1)*B) of a Grain `MapDataset` shuffled afresh each epoch, and each process reads only its own rows.
So the data position is one integer, and a run resumed on any number of processes reads exactly the batches
an uninterrupted run would have read. Batches are made ahead of the loop that takes them, on a background thread
or in `data.workers` processes; the position counts those taken. docs/data.md has the whole story.
"""

from __future__ import annotations

import fnmatch
import functools
import glob
import itertools
import json
import os
import sysconfig
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import grain
import jax
import numpy as np
from etils import epath

from scaletrain.data import tokenizer
from scaletrain.errors import ConfigError, DataError, first_line
from scaletrain.store import storage

SUFFIXES = (".txt", ".jsonl", ".parquet")  # the files a folder contributes
METADATA = "metadata.json"  # a prepared dataset's description, written last (scaletrain/data/prepare.py)
FORMAT, FORMAT_VERSION = "scaletrain-prepared", 1
PREFETCH = 4  # batches made ahead: by the background thread, or by each worker process


def stdlib_documents(errors: str) -> list[str]:
    """The Python standard library's own source: present wherever Python is, identical for a given version. A few
    of its test files are deliberately not UTF-8; `errors` (a codecs error handler) says how their bytes are read."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    return [text for p in files if (text := p.read_bytes().decode("utf-8", errors))]


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


def input_files(path: str, what: str = "data.path") -> list[epath.Path]:
    """The files a path names, local or gs://: a glob's matches or a folder's .txt/.jsonl/.parquet files (sorted),
    or the file itself. `what` names the setting in the error when there are none."""
    p = epath.Path(path)
    if glob.has_magic(path):
        files = sorted(_glob(path))
    elif p.is_dir():
        files = sorted(f for f in _files(p) if f.suffix in SUFFIXES)
    else:
        files = [p] if p.is_file() else []
    if not files:
        raise DataError(f"{what} '{path}' matches no files; expected a .txt, .jsonl or .parquet file, a folder or a "
                        f"glob")
    return files


def documents(f: epath.Path, text_field: str) -> Iterator[str]:
    """A file's non-empty documents, streamed: each line's `text_field` of a .jsonl, each row's `text_field` column
    of a .parquet (a batch of rows at a time), else the whole file. Text must be UTF-8."""
    read = {".jsonl": _jsonl_documents, ".parquet": _parquet_documents}.get(f.suffix, _text_document)
    return (text for text in read(f, text_field) if text)


def _utf8(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{where}: not UTF-8 text (byte {e.start})") from None


def _text_document(f: epath.Path, _text_field: str) -> Iterator[str]:
    yield _utf8(f.read_bytes(), str(f))


def _jsonl_documents(f: epath.Path, text_field: str) -> Iterator[str]:
    with f.open("rb") as lines:
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                text = json.loads(_utf8(line, f"{f}:{n}"))[text_field]
            except (json.JSONDecodeError, KeyError, TypeError, IndexError):
                text = None
            if not isinstance(text, str):
                raise DataError(f"{f}:{n}: expected a JSON object with a string field '{text_field}'")
            yield text


def _parquet_documents(f: epath.Path, text_field: str) -> Iterator[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    with f.open("rb") as raw:
        try:
            table = pq.ParquetFile(raw)
            if text_field not in table.schema_arrow.names:
                raise DataError(f"{f}: no column '{text_field}'; its columns are {', '.join(table.schema_arrow.names)}")
            row = 0
            for batch in table.iter_batches(batch_size=1024, columns=[text_field]):
                for text in batch.column(0).to_pylist():
                    row += 1
                    if not isinstance(text, str):
                        raise DataError(f"{f}: row {row}: column '{text_field}' holds {text!r}, not a string")
                    yield text
        except (pa.ArrowException, OSError) as e:
            raise DataError(f"{f}: not a readable Parquet file ({first_line(e)})") from None


def file_documents(path: str, text_field: str) -> list[str]:
    """Every document of the files `path` names (input_files)."""
    return [text for f in input_files(path) for text in documents(f, text_field)]


def pack(window: np.ndarray, eos_id: int) -> dict[str, np.ndarray]:
    """A training sample from seq_len + 2 stream tokens: the one before the window, the window's inputs, and the
    last input's target. A document starts after each EOS: segment ids keep attention inside it, positions restart
    there, and the loss leaves out what follows an EOS (the next document's first token is not predictable from
    the previous document's end). No BOS is needed: Qwen's tokenizer has none."""
    window = window.astype(np.int32)
    tokens, targets = window[1:-1], window[2:]
    starts = window[:-2] == eos_id  # each input's predecessor
    idx = np.arange(len(tokens))
    positions = (idx - np.maximum.accumulate(np.where(starts, idx, 0))).astype(np.int32)
    return dict(tokens=tokens, targets=targets, positions=positions,
                segment_ids=np.cumsum(starts, dtype=np.int32) + 1, loss_mask=(tokens != eos_id).astype(np.float32))


class PackedSource:
    """Random access to fixed-length windows of a token stream (a Grain data source): window i is tokens
    [i*T, i*T + T + 1), inputs and next-token targets. The stream is an array, or a prepared dataset's split read
    from disk (RecordStream): anything that slices like an array."""

    def __init__(self, stream, seq_len: int, eos_id: int, what: str = "the corpus"):
        self.stream, self.seq_len, self.eos_id = stream, seq_len, eos_id
        self.length = (len(stream) - 1) // seq_len
        if self.length < 1:  # also an empty corpus
            raise DataError(f"{what} has {len(stream)} tokens, fewer than one sequence of data.seq_len={seq_len}")

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        start = i * self.seq_len
        window = self.stream[max(start - 1, 0): start + self.seq_len + 1]
        if not start:  # the stream's first token starts a document, as if an EOS came before it
            window = np.concatenate([[self.eos_id], window])
        return pack(window, self.eos_id)


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


def read_metadata(path: str, tok: tokenizer.Tokenizer) -> dict:
    """A prepared dataset's metadata, refused unless its tokens are `tok`'s."""
    if storage.is_remote(path):
        raise DataError(f"prepared dataset '{path}': ArrayRecord files are read from a local disk; copy the dataset "
                        f"there (or mount the bucket)")
    meta_path = epath.Path(path) / METADATA
    if not meta_path.is_file():
        raise DataError(f"'{path}' is not a prepared dataset: it has no {METADATA} (`data prepare` writes it last: "
                        f"an interrupted prepare leaves none)")
    try:
        meta = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        meta = None
    if not isinstance(meta, dict) or (meta.get("format"), meta.get("version")) != (FORMAT, FORMAT_VERSION):
        raise DataError(f"{meta_path}: not the metadata of a prepared dataset of format version {FORMAT_VERSION}")
    made_with = meta["tokenizer"]
    if made_with["digest"] != tok.digest:
        raise DataError(f"'{path}' was prepared with tokenizer '{made_with['spec']}', whose tokens differ from "
                        f"data.tokenizer '{tok.spec}''s (another digest); set data.tokenizer to the dataset's "
                        f"tokenizer or prepare the data again")
    return meta


def split_tokens(meta: dict, split: str) -> int:
    return meta["splits"][split]["tokens"]


class RecordStream:
    """A prepared split's token stream, sliced like an array and read from its ArrayRecord shards (Grain's
    ArrayRecordDataSource, random access) a record of `record_tokens` tokens at a time: host memory does not grow
    with the corpus."""

    def __init__(self, folder: str, meta: dict, split: str):
        shards = meta["splits"][split]["shards"]
        self.tokens, self.record_tokens = split_tokens(meta, split), meta["record_tokens"]
        self.dtype = np.dtype(meta["token_dtype"])
        self.paths = [os.path.join(folder, s["file"]) for s in shards]
        for path, shard in zip(self.paths, shards):
            _check_shard(path, shard["records"])
        self.ends = list(itertools.accumulate(s["records"] for s in shards))  # to name a record's shard
        # "[0:n]": the counts are known (and checked), so Grain need not open every shard to count them again.
        self.records = grain.sources.ArrayRecordDataSource(
            [f"{p}[0:{s['records']}]" for p, s in zip(self.paths, shards)]) if shards else None
        last = -(-self.tokens // self.record_tokens) - 1
        if self.tokens and (self.ends[-1:] != [last + 1]
                            or len(self._record(last)) != self.tokens - last * self.record_tokens):
            raise DataError(f"{folder}: the {split} split's shards do not hold the {self.tokens} tokens its "
                            f"{METADATA} counts; prepare the dataset again")

    def __len__(self) -> int:
        return self.tokens

    def __getitem__(self, s: slice) -> np.ndarray:
        first, last = s.start // self.record_tokens, (s.stop - 1) // self.record_tokens
        chunk = np.concatenate([self._record(k) for k in range(first, last + 1)])
        return chunk[s.start - first * self.record_tokens: s.stop - first * self.record_tokens]

    def _record(self, k: int) -> np.ndarray:
        try:
            return np.frombuffer(self.records[k], self.dtype)
        except RuntimeError as e:  # Riegeli's checksums: bytes changed on disk
            shard = self.paths[next(i for i, end in enumerate(self.ends) if k < end)]
            raise DataError(f"{shard}: corrupt ({first_line(e)}); prepare the dataset again") from None


def _check_shard(path: str, records: int) -> None:
    """A missing, truncated or rewritten shard, found when the dataset is opened (before anything compiles)."""
    from array_record.python.array_record_module import ArrayRecordReader

    if not os.path.isfile(path):
        raise DataError(f"{path}: missing; the prepared dataset is incomplete")
    reader = ArrayRecordReader(path, "readahead_buffer_size:0")
    if not reader.ok():  # closing it would raise its failure again
        raise DataError(f"{path}: corrupt or truncated; prepare the dataset again")
    found = reader.num_records()
    reader.close()
    if found != records:
        raise DataError(f"{path}: {found} records, not the {records} of {METADATA}; prepare the dataset again")


def prepared_source(path: str, split: str, meta: dict, cfg) -> PackedSource:
    return PackedSource(RecordStream(path, meta, split), cfg.data.seq_len, meta["tokenizer"]["eos_id"],
                        f"the {split} split of '{path}'")


def make_source(cfg) -> PackedSource | SyntheticSource:
    data = cfg.data
    if data.source == "synthetic":
        return SyntheticSource(cfg.model.vocab_size, data.seq_len, cfg.seed)
    tok = tokenizer.load(data.tokenizer)
    # Checked here, where the data is opened, not when the config is read: planning and compiling need no
    # tokenizer (a config may be written ahead of `convert from-hf`). Synthetic tokens are drawn from the model's.
    if cfg.model.vocab_size < tok.vocab_size:
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than {tok.name}'s {tok.vocab_size} "
                          f"ids")
    if data.source == "prepared":
        return prepared_source(data.path, "train", read_metadata(data.path, tok), cfg)
    if data.source == "stdlib":
        # The byte tokenizer sees the non-UTF-8 files' exact bytes; the others, text with U+FFFD for them.
        docs = stdlib_documents("surrogateescape" if data.tokenizer == "bytes" else "replace")
    else:
        docs = file_documents(data.path, data.jsonl_field)
    stream = np.concatenate([tok.document(text) for text in docs]).astype(tok.dtype) if docs else np.zeros(0, tok.dtype)
    return PackedSource(stream, data.seq_len, tok.eos_id)


def make_dataset(cfg) -> grain.MapDataset:
    """Shuffled afresh every epoch (Grain reseeds per epoch), infinitely repeated, randomly accessible."""
    return grain.MapDataset.source(make_source(cfg)).shuffle(seed=cfg.seed).repeat()


def make_eval_dataset(cfg) -> grain.MapDataset | None:
    """The evaluation windows, in order: not shuffled, not repeated (len() of them). Those of data.eval_path (its
    eval split; its train split when the eval split is empty), else, with data.source prepared, data.path's eval
    split. None when there are none (an empty eval split is an error when train.eval_every_steps asks for
    evaluation)."""
    data = cfg.data
    if not data.eval_path and data.source != "prepared":
        return None
    path = data.eval_path or data.path
    meta = read_metadata(path, tokenizer.load(data.tokenizer))
    split = "eval" if split_tokens(meta, "eval") or not data.eval_path else "train"
    if not split_tokens(meta, split):
        if not cfg.train.eval_every_steps:
            return None
        raise DataError(f"train.eval_every_steps={cfg.train.eval_every_steps} needs evaluation data, but the eval "
                        f"split of '{path}' is empty; prepare it with --eval-fraction or set data.eval_path")
    return grain.MapDataset.source(prepared_source(path, split, meta, cfg))


def process_rows(batch_sharding, global_batch: int) -> np.ndarray:
    """The rows of the global batch that this process's devices hold, ascending: only these are loaded.
    Replicas across processes load the same rows; any device order works."""
    # A second dim every mesh axis divides: the sequence's (context parallelism) may be split too.
    index_map = batch_sharding.addressable_devices_indices_map((global_batch, batch_sharding.mesh.size))
    return np.unique(np.concatenate([np.arange(*index[0].indices(global_batch)) for index in index_map.values()]))


def _batch(dataset: grain.MapDataset, global_batch: int, rows: np.ndarray, first: int, k: int) -> dict:
    """Rows `rows` of the k-th global batch from sample `first`."""
    samples = [dataset[first + k * global_batch + int(r)] for r in rows]
    return {key: np.stack([s[key] for s in samples]) for key in samples[0]}


def _exit_with_parent(_index: int, _count: int) -> None:
    """In each Grain worker process: exit once the training process is gone. A killed (SIGKILL) run stops nothing
    else, and its workers would wait on their full queues forever."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1)
        os._exit(0)

    threading.Thread(target=watch, daemon=True).start()


def _made_ahead(dataset: grain.MapDataset, global_batch: int, rows: np.ndarray, first: int,
                workers: int) -> grain.DatasetIterator:
    """The batches from sample `first` on, made ahead of the loop that takes them: in `workers` processes (Grain
    interleaves them in order), or with none on a background thread."""
    count = (len(dataset) - first) // global_batch
    batches = grain.MapDataset.range(count).map(functools.partial(_batch, dataset, global_batch, rows, first))
    ahead = batches.to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=PREFETCH))
    if workers:
        from absl import flags

        if not flags.FLAGS.is_parsed():  # Grain's worker processes read an absl flag, which fails before a parse
            flags.FLAGS.mark_as_parsed()
        ahead = ahead.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers, per_worker_buffer_size=PREFETCH),
                                  worker_init_fn=_exit_with_parent)
    return iter(ahead)


@dataclass
class BatchIterator:
    """Yields this process's rows of each global batch. Its whole state is the global index of the next
    batch's first sample, so a resumed run may change the number of processes or even the batch size."""

    dataset: grain.MapDataset
    global_batch: int
    rows: np.ndarray | None = None  # rows of each global batch to load; None: all of them
    next_sample: int = 0
    workers: int = 0  # processes making batches ahead; 0: a background thread
    _ahead: grain.DatasetIterator | None = field(default=None, init=False, repr=False)

    def __post_init__(self):
        if self.rows is None:
            self.rows = np.arange(self.global_batch)
        self._start()  # the workers start while the caller does other things (the trainer: compile, restore)

    def get_state(self) -> dict:
        return {"next_sample": self.next_sample}

    def set_state(self, state: dict) -> None:
        if int(state["next_sample"]) != self.next_sample:
            self.close()  # what was made ahead follows the old position
            self.next_sample = int(state["next_sample"])
            self._start()

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        if self._ahead is None:
            self._start()
        batch = next(self._ahead)
        self.next_sample += self.global_batch
        return batch

    def _start(self) -> None:
        self._ahead = _made_ahead(self.dataset, self.global_batch, self.rows, self.next_sample, self.workers)
        self._ahead.start_prefetch()

    def close(self) -> None:
        """Stops making batches ahead (and the worker processes)."""
        if self._ahead is not None:
            self._ahead.close()
            self._ahead = None


def make_iterator(cfg, batch_sharding, dataset: grain.MapDataset | None = None,
                  workers: int | None = None) -> BatchIterator:
    """This process's batches of `dataset` (the training data by default) from sample 0, made ahead in `workers`
    processes (default data.workers)."""
    return BatchIterator(dataset if dataset is not None else make_dataset(cfg), cfg.train.global_batch,
                         process_rows(batch_sharding, cfg.train.global_batch),
                         workers=cfg.data.workers if workers is None else workers)


def to_global(local: dict[str, np.ndarray], sharding, global_batch: int) -> dict[str, jax.Array]:
    """Assemble each process's rows into global arrays sharded over the batch axes (and, with context
    parallelism, along the sequence: a process whose devices hold part of each sequence passes that part)."""
    seq_len = next(iter(local.values())).shape[1]  # every array is [rows, seq_len]
    spans = [index[1].indices(seq_len)
             for index in sharding.addressable_devices_indices_map((global_batch, seq_len)).values()]
    held = slice(min(a for a, _, _ in spans), max(b for _, b, _ in spans))
    return {k: jax.make_array_from_process_local_data(sharding, v[:, held], (global_batch, *v.shape[1:]))
            for k, v in local.items()}
