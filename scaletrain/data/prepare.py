"""`python -m scaletrain data prepare`: a corpus tokenized once into ArrayRecord shards (`data.source: prepared`).

Text (--format text): each split (train, eval) is the concatenated token stream of its documents -
`Tokenizer.document(text)` each - cut into records of RECORD_TOKENS tokens (the last one shorter), RECORDS_PER_SHARD
records to a shard:

    OUT/metadata.json                  format, tokenizer, dtype, record size, per split its counts and shards
    OUT/train-00000.array_record ...   the train split's records
    OUT/eval-00000.array_record ...    the eval split's (--eval-fraction)
    OUT/tokenizer/                     the tokenizer's files

Training reads window i, tokens [i*T, i*T + T + 1) of the stream, from the one or two records holding it, so any
data.seq_len works with one prepared dataset and host memory does not grow with the corpus.

The post-training formats (--format chat, prompt_completion, preference: scaletrain/data/examples.py): one record
per example - its sequences' tokens and the bits of those its format trains (examples.to_record) - and beside the
shards each split's lengths file, [examples, sequences] int32, from which training packs rows for any data.seq_len
without reading a record. Rendering conversations costs more than tokenizing text, so rows are made in the workers
too.

The dataset is written under a temporary name and renamed when complete: an interrupted prepare leaves nothing that
looks like a dataset. docs/data.md describes the format.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import json
import multiprocessing
import os
import shutil
from typing import Any, Callable, Iterable, Iterator

import numpy as np
from etils import epath

from scaletrain.data import chat, examples, files, tokenizer
from scaletrain.data import loader as data
from scaletrain.errors import UserError
from scaletrain.store import storage

RECORD_TOKENS = 4096
RECORDS_PER_SHARD = 16384  # 64M tokens, 128 MiB as uint16 before compression
# The documents sent to a worker at a time: enough text to make the hand-over cheap, little enough to keep memory
# (2 chunks per worker in flight) small.
CHUNK_CHARS = 1 << 20
CHUNK_ROWS = 256  # the rows of a post-training format sent to a worker at a time
# group_size:1 - every record compressed on its own, so reading one decompresses only it (Grain asks for this).
WRITER_OPTIONS = "group_size:1"


# Why --out is a local path: the command line refuses a gs:// one before it asks the bucket anything.
LOCAL_OUT = "a prepared dataset is written to (and read from) a local disk"


def main(tokenizer_spec: str, inputs: list[str], out: str, text_field: str, eval_fraction: float,
         workers: int | None, data_format: str = "text", chat_template: str = "") -> int:
    if storage.is_remote(out):
        raise UserError(f"--out {out}: {LOCAL_OUT}; expected a local path (copy it to a bucket afterwards)")
    tok = tokenizer.load(tokenizer_spec)
    meta = prepare(tok, inputs, out, text_field, eval_fraction, workers or os.cpu_count() or 1,
                   data_format=data_format, chat_template=chat_template)
    unit = "documents" if data_format == "text" else "examples"
    counts = "; ".join(f"{name}: {split[unit]} {unit}, {split['tokens']} tokens"
                       for name, split in meta["splits"].items())
    print(f"prepared {out} ({data_format}) from {meta['files']} files with tokenizer {tok.spec}; {counts}", flush=True)
    return 0


def prepare(tok: tokenizer.Tokenizer, inputs: list[str], out: str, text_field: str, eval_fraction: float,
            workers: int, record_tokens: int = RECORD_TOKENS, records_per_shard: int = RECORDS_PER_SHARD,
            data_format: str = "text", chat_template: str = "") -> dict:
    """Writes the dataset of the files `inputs` name (paths, folders or globs) to `out`, a new or empty local
    folder, and returns its metadata. `chat_template`: the template file conversations are rendered with (empty:
    the tokenizer's)."""
    matched = [f for path in inputs for f in files.input_files(path, "--input")]  # every input checked first
    final = os.path.abspath(out)
    partial = f"{final}.incomplete-{os.getpid()}"
    os.makedirs(partial)
    try:
        if data_format == "text":
            meta = _write(tok, matched, partial, text_field, eval_fraction, workers, record_tokens, records_per_shard)
        else:
            meta = _write_examples(tok, matched, partial, data_format, chat_template, eval_fraction, workers,
                                   records_per_shard)
        meta.update(inputs=list(inputs), files=len(matched))
        with open(os.path.join(partial, data.METADATA), "w") as f:
            json.dump(meta, f, indent=1)
        if os.path.isdir(final):
            os.rmdir(final)  # the CLI let it through only empty
        os.rename(partial, final)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return meta


def _write(tok: tokenizer.Tokenizer, matched: list[epath.Path], folder: str, text_field: str, eval_fraction: float,
           workers: int, record_tokens: int, records_per_shard: int) -> dict:
    from tqdm import tqdm

    splits = {name: _SplitWriter(folder, name, tok.dtype, record_tokens, records_per_shard)
              for name in ("train", "eval")}
    index, texts = 0, _Texts(d for f in matched for d in files.documents(f, text_field))
    with tqdm(desc="data prepare", unit=" docs", disable=None) as bar:
        for ids in _in_workers(functools.partial(_tokenize, tok.spec), _chunks(texts, len, CHUNK_CHARS), workers):
            for doc in ids:
                splits["eval" if _held_out(index, eval_fraction) else "train"].add(doc)
                index += 1
            bar.update(len(ids))
    if not texts.with_text:
        found = f"{index} document{'s' * (index != 1)} of whitespace alone" if index else "no documents"
        raise UserError(f"--input: {_named(matched)} no text ({found}); expected files with text to tokenize")
    _check_train(splits["train"].documents, index, eval_fraction, "document")
    return {
        "format": data.FORMAT, "version": data.FORMAT_VERSION, **_tokenizer_copied(tok, folder),
        "token_dtype": tok.dtype.name, "record_tokens": record_tokens,
        "splits": {name: split.close() for name, split in splits.items()},
        "text_field": text_field, "eval_fraction": eval_fraction,
    }


def _write_examples(tok: tokenizer.Tokenizer, matched: list[epath.Path], folder: str, data_format: str,
                    template_spec: str, eval_fraction: float, workers: int, records_per_shard: int) -> dict:
    from tqdm import tqdm

    template = chat.template_text(template_spec, tok)  # a missing file is refused before any work
    splits = {name: ExampleWriter(folder, name, tok.dtype, examples.SEQUENCES[data_format], records_per_shard)
              for name in ("train", "eval")}
    located = (item for f in matched for item in files.rows(f, examples.FIELDS[data_format]))
    work = functools.partial(_make_examples, data_format, tok.spec, template_spec)
    index = 0
    with tqdm(desc="data prepare", unit=" rows", disable=None) as bar:
        for made in _in_workers(work, _chunks(located, lambda _: 1, CHUNK_ROWS), workers):
            for example in made:
                splits["eval" if _held_out(index, eval_fraction) else "train"].add(example)
                index += 1
            bar.update(len(made))
    if not index:
        raise UserError(f"--input: {_named(matched)} no rows; expected JSONL or Parquet rows with "
                        f"{', '.join(examples.FIELDS[data_format])}")
    _check_train(len(splits["train"].sizes), index, eval_fraction, "example")
    return {
        "format": data.FORMAT, "version": data.FORMAT_VERSION, "data_format": data_format,
        "chat_template": template and {"spec": template[1], "sha256": chat.digest(template[0])},
        **_tokenizer_copied(tok, folder), "token_dtype": tok.dtype.name,
        "trained": examples.TRAINED[data_format], "extras": [],
        "splits": {name: split.close() for name, split in splits.items()}, "eval_fraction": eval_fraction,
    }


def _named(matched: list[epath.Path]) -> str:
    """The input files, for a message whose verb follows ("a.txt holds", "a.txt, b.txt hold")."""
    named = ", ".join(str(f) for f in matched[:3]) + (f" and {len(matched) - 3} more" if len(matched) > 3 else "")
    return f"{named} hold{'s' * (len(matched) == 1)}"


def _check_train(kept: int, seen: int, eval_fraction: float, unit: str) -> None:
    if not kept:
        raise UserError(f"--eval-fraction {eval_fraction} held out every {unit} ({seen}): the train split would "
                        f"be empty; expected a smaller fraction or more {unit}s")


def _tokenizer_copied(tok: tokenizer.Tokenizer, folder: str) -> dict:
    """The tokenizer's files copied into the dataset; its metadata entry."""
    os.makedirs(os.path.join(folder, "tokenizer"))
    for f in tok.files:
        epath.Path(f).copy(epath.Path(folder) / "tokenizer" / epath.Path(f).name)
    return {"tokenizer": {"spec": tok.spec, "digest": tok.digest, "vocab_size": tok.vocab_size, "bos_id": tok.bos_id,
                          "eos_id": tok.eos_id}}


class _Texts:
    """The documents, passed through, counting those with more than whitespace: a corpus without any would be a
    dataset of separators alone."""

    def __init__(self, texts: Iterable[str]):
        self._texts, self.with_text = texts, 0

    def __iter__(self) -> Iterator[str]:
        for text in self._texts:
            self.with_text += not text.isspace()
            yield text


def _held_out(index: int, fraction: float) -> bool:
    """Whether document `index` goes to the eval split: a hash of the index, so the split does not depend on how
    the work was divided, and documents of one file are spread over both splits."""
    digest = hashlib.blake2b(index.to_bytes(8, "little"), digest_size=8).digest()
    return int.from_bytes(digest, "little") < fraction * 2**64


def _chunks(items: Iterable, size: Callable[[Any], int], limit: int) -> Iterator[list]:
    """Consecutive items, in lists of about `limit` (by `size`): the work handed to a worker at a time."""
    chunk, total = [], 0
    for item in items:
        chunk.append(item)
        total += size(item)
        if total >= limit:
            yield chunk
            chunk, total = [], 0
    if chunk:
        yield chunk


def _tokenize(spec: str, texts: list[str]) -> list[np.ndarray]:
    tok = tokenizer.load(spec)  # cached: loaded once per process
    return [tok.document(text).astype(tok.dtype) for text in texts]


@functools.lru_cache(maxsize=4)
def _maker(data_format: str, tokenizer_spec: str, template_spec: str) -> examples.Maker:
    return examples.Maker(data_format, tokenizer_spec, template_spec)


def _make_examples(data_format: str, tokenizer_spec: str, template_spec: str,
                   located: list[tuple[str, dict]]) -> list[examples.Example]:
    """A chunk of rows made into examples, each with the bits of the tokens its format trains (stored: training
    chooses whether to use them)."""
    return examples.made(_maker(data_format, tokenizer_spec, template_spec), located)


def _in_workers(work: Callable[[list], list], chunks: Iterator[list], workers: int) -> Iterator[list]:
    """`work` done on each chunk, in order whatever the number of workers. At most two chunks per worker are in
    flight, so memory does not grow with the corpus (Pool.imap would read all of it ahead)."""
    if workers == 1:
        yield from (work(chunk) for chunk in chunks)
        return
    # forkserver, not fork: the calling process may run threads (JAX's, the tokenizer library's), and a child forked
    # from it could wait forever on a lock one of them held. Each worker loads the tokenizer once.
    with multiprocessing.get_context("forkserver").Pool(workers) as pool:
        pending = collections.deque()
        for chunk in chunks:
            pending.append(pool.apply_async(work, (chunk,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


class _Shards:
    """Records written in order into numbered ArrayRecord shards of `per_shard` records."""

    def __init__(self, folder: str, name: str, per_shard: int):
        self.folder, self.name, self.per_shard = folder, name, per_shard
        self.shards: list[dict] = []
        self.writer = None

    def write(self, record: bytes) -> None:
        from array_record.python.array_record_module import ArrayRecordWriter

        if not self.shards or self.shards[-1]["records"] == self.per_shard:
            self._close_shard()
            self.shards.append({"file": f"{self.name}-{len(self.shards):05d}.array_record", "records": 0})
            self.writer = ArrayRecordWriter(os.path.join(self.folder, self.shards[-1]["file"]), WRITER_OPTIONS)
        self.writer.write(record)
        self.shards[-1]["records"] += 1

    def _close_shard(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    def close(self) -> list[dict]:
        self._close_shard()
        return self.shards


class _SplitWriter:
    """One split's token stream, written as fixed-size records into numbered shards."""

    def __init__(self, folder: str, name: str, dtype: np.dtype, record_tokens: int, records_per_shard: int):
        self.dtype, self.record_tokens = dtype, record_tokens
        self.shards = _Shards(folder, name, records_per_shard)
        self.pending: list[np.ndarray] = []  # tokens not yet in a record, fewer than record_tokens
        self.pending_tokens = self.documents = self.tokens = 0

    def add(self, doc: np.ndarray) -> None:
        self.pending.append(doc)
        self.pending_tokens += len(doc)
        self.documents += 1
        self.tokens += len(doc)
        if self.pending_tokens >= self.record_tokens:
            stream = np.concatenate(self.pending)
            full = len(stream) // self.record_tokens * self.record_tokens
            for start in range(0, full, self.record_tokens):
                self.shards.write(stream[start: start + self.record_tokens].tobytes())
            self.pending, self.pending_tokens = [stream[full:]], len(stream) - full

    def close(self) -> dict:
        """The last, shorter record written; the split's counts and shards."""
        if self.pending_tokens:
            self.shards.write(np.concatenate(self.pending).tobytes())
        return {"documents": self.documents, "tokens": self.tokens, "shards": self.shards.close()}


class ExampleWriter:
    """One split's examples, a record each (with their per-token `extras`), and their sequences' lengths (the
    split's lengths file)."""

    def __init__(self, folder: str, name: str, dtype: np.dtype, sequences: int, records_per_shard: int,
                 extras: tuple[str, ...] = ()):
        self.folder, self.name, self.dtype, self.sequences, self.extras = folder, name, dtype, sequences, extras
        self.shards = _Shards(folder, name, records_per_shard)
        self.sizes: list[list[int]] = []

    def add(self, example: examples.Example) -> None:
        self.shards.write(examples.to_record(example, self.dtype, self.extras))
        self.sizes.append([len(s) for s in example])

    def close(self) -> dict:
        lengths = f"{self.name}-lengths.npy"
        sizes = np.asarray(self.sizes, np.int32).reshape(len(self.sizes), self.sequences)
        np.save(os.path.join(self.folder, lengths), sizes)
        return {"examples": len(sizes), "tokens": int(sizes.sum()), "shards": self.shards.close(), "lengths": lengths}
