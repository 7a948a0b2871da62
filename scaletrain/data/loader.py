"""Training data: documents -> tokens -> packed windows (or, for the post-training formats, rows -> examples ->
rows of whole examples: examples.py, packing.py) -> a Grain dataset -> per-process global batches.

The order of samples is a pure function of (seed, global sample index): batch `s` holds global samples
[s*B, (s+1)*B) of a Grain `MapDataset` shuffled afresh each epoch, and each process reads only its own rows.
So the data position is one integer, and a run resumed on any number of processes reads exactly the batches
an uninterrupted run would have read. Batches are made ahead of the loop that takes them, on a background thread
or in `data.workers` processes; the position counts those taken. docs/data.md has the whole story.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator

import grain
import jax
import numpy as np
from etils import epath

from scaletrain import config
from scaletrain.data import chat, examples, packing, tokenizer
from scaletrain.data.files import file_documents, stdlib_documents
from scaletrain.errors import ConfigError, DataError, first_line
from scaletrain.store import storage

METADATA = "metadata.json"  # a prepared dataset's description, written last (scaletrain/data/prepare.py)
FORMAT, FORMAT_VERSION = "scaletrain-prepared", 1
PREFETCH = 4  # batches made ahead: by the background thread, or by each worker process


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

    dropped = 0  # a stream leaves nothing out: documents are cut at window edges

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

    dropped = 0

    def __init__(self, vocab_size: int, seq_len: int, seed: int):
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed

    def __len__(self) -> int:
        return 1 << 30

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        window = np.random.default_rng([self.seed, i]).integers(0, self.vocab_size, self.seq_len + 1, np.int32)
        return dict(tokens=window[:-1], targets=window[1:], positions=np.arange(self.seq_len, dtype=np.int32),
                    segment_ids=np.ones(self.seq_len, np.int32), loss_mask=np.ones(self.seq_len, np.float32))


def read_metadata(path: str, tok: tokenizer.Tokenizer, data_format: str = "text") -> dict:
    """A prepared dataset's metadata, refused unless its tokens are `tok`'s and its rows of `data_format`."""
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
    if dataset_format(meta) != data_format:
        held = dataset_format(meta)
        raise DataError(f"'{path}' holds {held} data (`data prepare --format {held}`), not data.format={data_format}; "
                        f"set data.format={held} or prepare the data with --format {data_format}")
    return meta


def dataset_format(meta: dict) -> str:
    """A prepared dataset's data.format (text datasets, as first written, do not say)."""
    return meta.get("data_format", "text")


def split_tokens(meta: dict, split: str) -> int:
    return meta["splits"][split]["tokens"]


class Shards:
    """A prepared split's ArrayRecord shards, each checked when opened, read a record at a time by random access
    (Grain's ArrayRecordDataSource): host memory does not grow with the corpus."""

    def __init__(self, folder: str, shards: list[dict]):
        self.paths = [os.path.join(folder, s["file"]) for s in shards]
        for path, shard in zip(self.paths, shards):
            _check_shard(path, shard["records"])
        self.ends = list(itertools.accumulate(s["records"] for s in shards))  # to name a record's shard
        # "[0:n]": the counts are known (and checked), so Grain need not open every shard to count them again.
        self.records = grain.sources.ArrayRecordDataSource(
            [f"{p}[0:{s['records']}]" for p, s in zip(self.paths, shards)]) if shards else None

    def __len__(self) -> int:
        return self.ends[-1] if self.ends else 0

    def __getitem__(self, k: int) -> bytes:
        try:
            return self.records[k]
        except RuntimeError as e:  # Riegeli's checksums: bytes changed on disk
            shard = self.paths[next(i for i, end in enumerate(self.ends) if k < end)]
            raise DataError(f"{shard}: corrupt ({first_line(e)}); prepare the dataset again") from None


class RecordStream:
    """A prepared text split's token stream, sliced like an array and read from its shards a record of
    `record_tokens` tokens at a time."""

    def __init__(self, folder: str, meta: dict, split: str):
        self.tokens, self.record_tokens = split_tokens(meta, split), meta["record_tokens"]
        self.dtype = np.dtype(meta["token_dtype"])
        self.shards = Shards(folder, meta["splits"][split]["shards"])
        last = -(-self.tokens // self.record_tokens) - 1
        if self.tokens and (len(self.shards) != last + 1
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
        return np.frombuffer(self.shards[k], self.dtype)


class ExampleRecords:
    """A prepared split of examples (chat, prompt_completion, preference): example i read from record i of its
    shards, and every example's sequence lengths, from the split's lengths file, held in memory (packing needs
    them all; 4 bytes a sequence)."""

    def __init__(self, folder: str, meta: dict, split: str):
        info = meta["splits"][split]
        self.dtype, self.extras = np.dtype(meta["token_dtype"]), tuple(meta["extras"])
        self.shards = Shards(folder, info["shards"])
        path = os.path.join(folder, info["lengths"])
        try:
            self.sizes = np.load(path).astype(np.int32)
        except (OSError, ValueError) as e:
            raise DataError(f"{path}: unreadable ({first_line(e)}); prepare the dataset again") from None
        if len(self.sizes) != info["examples"] or len(self.shards) != info["examples"]:
            raise DataError(f"{folder}: the {split} split's shards and lengths do not hold the {info['examples']} "
                            f"examples its {METADATA} counts; prepare the dataset again")

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, i: int) -> examples.Example:
        return examples.from_record(self.shards[i], self.sizes[i], self.dtype, self.extras)


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


def prepared_source(path: str, split: str, meta: dict, cfg) -> PackedSource | packing.PackedRows:
    what = f"the {split} split of '{path}'"
    if dataset_format(meta) == "text":
        return PackedSource(RecordStream(path, meta, split), cfg.data.seq_len, meta["tokenizer"]["eos_id"], what)
    template = meta["chat_template"]
    if cfg.data.chat_template and template:
        given = chat.template_text(cfg.data.chat_template, tokenizer.load(cfg.data.tokenizer))
        if chat.digest(given[0]) != template["sha256"]:
            raise DataError(f"'{path}' was rendered with another chat template ({template['spec']}) than "
                            f"data.chat_template '{cfg.data.chat_template}'; leave data.chat_template empty (the "
                            f"dataset's tokens are rendered already) or prepare the data again with it")
    records = ExampleRecords(path, meta, split)
    return _rows(cfg, records, records.sizes, meta["tokenizer"]["eos_id"], what, records.extras)


def extras(cfg) -> tuple[str, ...]:
    """The per-token arrays a run's rows carry beside the tokens: DPO's reference log-probs, where they come from
    the data (dpo.reference=precomputed)."""
    return ("ref_logprobs",) if cfg.train.objective == "dpo" and cfg.dpo.reference == "precomputed" else ()


def _rows(cfg, made, sizes: np.ndarray, pad_id: int, what: str, stored: tuple[str, ...] = ()) -> packing.PackedRows:
    if missing := [name for name in extras(cfg) if name not in stored]:
        raise DataError(f"dpo.reference=precomputed reads the reference's log-probs from the data, but {what} carries "
                        f"no {', '.join(missing)}; compute them into a prepared dataset, or set dpo.reference=auto")
    return packing.PackedRows(made, sizes, cfg.data.seq_len, config.loss_on(cfg.data) == "all", pad_id,
                              pairs=cfg.data.format == "preference", what=what, extras=extras(cfg))


def make_source(cfg) -> PackedSource | SyntheticSource | packing.PackedRows | packing.SyntheticPairs:
    """The training rows of cfg.data, in order: windows of a text stream, or examples packed into rows. Its
    `dropped`: the examples too long for data.seq_len, left out."""
    data = cfg.data
    if data.source == "synthetic" and data.format == "preference":
        return packing.SyntheticPairs(cfg.model.vocab_size, data.seq_len, cfg.seed, extras(cfg))
    if data.source == "synthetic":
        return SyntheticSource(cfg.model.vocab_size, data.seq_len, cfg.seed)
    tok = tokenizer.load(data.tokenizer)
    # Checked here, where the data is opened, not when the config is read: planning and compiling need no
    # tokenizer (a config may be written ahead of `convert from-hf`). Synthetic tokens are drawn from the model's.
    if cfg.model.vocab_size < tok.vocab_size:
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than {tok.name}'s {tok.vocab_size} "
                          f"ids")
    if data.source == "prepared":
        return prepared_source(data.path, "train", read_metadata(data.path, tok, data.format), cfg)
    if data.format != "text":
        maker = examples.Maker(data.format, data.tokenizer, data.chat_template,
                               assistant=config.loss_on(data) == "assistant")
        made = examples.made(maker, examples.rows(data.path, data.format))
        return _rows(cfg, made, examples.lengths(made, data.format), tok.eos_id, f"data.path '{data.path}'")
    if data.source == "stdlib":
        # The byte tokenizer sees the non-UTF-8 files' exact bytes; the others, text with U+FFFD for them.
        docs = stdlib_documents("surrogateescape" if data.tokenizer == "bytes" else "replace")
    else:
        docs = file_documents(data.path, data.jsonl_field)
    stream = np.concatenate([tok.document(text) for text in docs]).astype(tok.dtype) if docs else np.zeros(0, tok.dtype)
    return PackedSource(stream, data.seq_len, tok.eos_id)


def _shuffled(source, seed: int) -> grain.MapDataset:
    """Shuffled afresh every epoch (Grain reseeds per epoch), infinitely repeated, randomly accessible."""
    return grain.MapDataset.source(source).shuffle(seed=seed).repeat()


def make_dataset(cfg) -> grain.MapDataset:
    return _shuffled(make_source(cfg), cfg.seed)


def make_eval_dataset(cfg) -> grain.MapDataset | None:
    """The evaluation rows, in order: not shuffled, not repeated (len() of them). Those of data.eval_path (its
    eval split; its train split when the eval split is empty), else, with data.source prepared, data.path's eval
    split. None when there are none (an empty eval split is an error when train.eval_every_steps asks for
    evaluation). Examples are packed and masked as for training."""
    data = cfg.data
    if not data.eval_path and data.source != "prepared":
        return None
    path = data.eval_path or data.path
    meta = read_metadata(path, tokenizer.load(data.tokenizer), data.format)
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
    dropped: int = 0  # examples longer than data.seq_len the training rows leave out (make_source's `dropped`)
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
    dropped = 0
    if dataset is None:
        source = make_source(cfg)
        dataset, dropped = _shuffled(source, cfg.seed), source.dropped
    return BatchIterator(dataset, cfg.train.global_batch, process_rows(batch_sharding, cfg.train.global_batch),
                         workers=cfg.data.workers if workers is None else workers, dropped=dropped)


def to_global(local: dict[str, np.ndarray], sharding, global_batch: int) -> dict[str, jax.Array]:
    """Assemble each process's rows into global arrays sharded over the batch axes (and, with context
    parallelism, along the sequence: a process whose devices hold part of each sequence passes that part)."""
    seq_len = next(iter(local.values())).shape[1]  # every array is [rows, seq_len]
    spans = [index[1].indices(seq_len)
             for index in sharding.addressable_devices_indices_map((global_batch, seq_len)).values()]
    held = slice(min(a for a, _, _ in spans), max(b for _, b, _ in spans))
    return {k: jax.make_array_from_process_local_data(sharding, v[:, held], (global_batch, *v.shape[1:]))
            for k, v in local.items()}
