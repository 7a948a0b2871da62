"""`python -m scaletrain data prepare`: a corpus tokenized once into ArrayRecord shards (`data.source: prepared`).

Each split (train, eval) is the concatenated token stream of its documents - `Tokenizer.document(text)` each -
cut into records of RECORD_TOKENS tokens (the last one shorter), RECORDS_PER_SHARD records to a shard:

    OUT/metadata.json                  format, tokenizer, dtype, record size, per split its counts and shards
    OUT/train-00000.array_record ...   the train split's records
    OUT/eval-00000.array_record ...    the eval split's (--eval-fraction)
    OUT/tokenizer/                     the tokenizer's files

Training reads window i, tokens [i*T, i*T + T + 1) of the stream, from the one or two records holding it, so any
data.seq_len works with one prepared dataset and host memory does not grow with the corpus. The dataset is
written under a temporary name and renamed when complete: an interrupted prepare leaves nothing that looks like
a dataset. docs/data.md describes the format.
"""

from __future__ import annotations

import collections
import hashlib
import json
import multiprocessing
import os
import shutil
from typing import Iterable, Iterator

import numpy as np
from etils import epath

from scaletrain.data import loader as data
from scaletrain.data import tokenizer
from scaletrain.errors import UserError
from scaletrain.store import storage

RECORD_TOKENS = 4096
RECORDS_PER_SHARD = 16384  # 64M tokens, 128 MiB as uint16 before compression
# The documents sent to a worker at a time: enough text to make the hand-over cheap, little enough to keep memory
# (2 chunks per worker in flight) small.
CHUNK_CHARS = 1 << 20
# group_size:1 - every record compressed on its own, so reading one decompresses only it (Grain asks for this).
WRITER_OPTIONS = "group_size:1"


# Why --out is a local path: the command line refuses a gs:// one before it asks the bucket anything.
LOCAL_OUT = "a prepared dataset is written to (and read from) a local disk"


def main(tokenizer_spec: str, inputs: list[str], out: str, text_field: str, eval_fraction: float,
         workers: int | None) -> int:
    if storage.is_remote(out):
        raise UserError(f"--out {out}: {LOCAL_OUT}; expected a local path (copy it to a bucket afterwards)")
    tok = tokenizer.load(tokenizer_spec)
    meta = prepare(tok, inputs, out, text_field, eval_fraction, workers or os.cpu_count() or 1)
    counts = "; ".join(f"{name}: {split['documents']} documents, {split['tokens']} tokens"
                       for name, split in meta["splits"].items())
    print(f"prepared {out} from {meta['files']} files with tokenizer {tok.spec}; {counts}", flush=True)
    return 0


def prepare(tok: tokenizer.Tokenizer, inputs: list[str], out: str, text_field: str, eval_fraction: float,
            workers: int, record_tokens: int = RECORD_TOKENS, records_per_shard: int = RECORDS_PER_SHARD) -> dict:
    """Writes the dataset of the files `inputs` name (paths, folders or globs) to `out`, a new or empty local
    folder, and returns its metadata."""
    files = [f for path in inputs for f in data.input_files(path, "--input")]  # every input checked first
    final = os.path.abspath(out)
    partial = f"{final}.incomplete-{os.getpid()}"
    os.makedirs(partial)
    try:
        meta = _write(tok, files, partial, text_field, eval_fraction, workers, record_tokens, records_per_shard)
        meta.update(inputs=list(inputs), files=len(files))
        with open(os.path.join(partial, data.METADATA), "w") as f:
            json.dump(meta, f, indent=1)
        if os.path.isdir(final):
            os.rmdir(final)  # the CLI let it through only empty
        os.rename(partial, final)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return meta


def _write(tok: tokenizer.Tokenizer, files: list[epath.Path], folder: str, text_field: str, eval_fraction: float,
           workers: int, record_tokens: int, records_per_shard: int) -> dict:
    from tqdm import tqdm

    splits = {name: _SplitWriter(folder, name, tok.dtype, record_tokens, records_per_shard)
              for name in ("train", "eval")}
    index, texts = 0, _Texts(d for f in files for d in data.documents(f, text_field))
    with tqdm(desc="data prepare", unit=" docs", disable=None) as bar:
        for ids in _tokenized(_chunks(texts), tok.spec, workers):
            for doc in ids:
                splits["eval" if _held_out(index, eval_fraction) else "train"].add(doc)
                index += 1
            bar.update(len(ids))
    if not texts.with_text:
        named = ", ".join(str(f) for f in files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
        found = f"{index} document{'s' * (index != 1)} of whitespace alone" if index else "no documents"
        raise UserError(f"--input: {named} hold{'s' * (len(files) == 1)} no text ({found}); expected files with "
                        f"text to tokenize")
    if not splits["train"].documents:
        raise UserError(f"--eval-fraction {eval_fraction} held out every document ({index}): the train split would "
                        f"be empty; expected a smaller fraction or more documents")
    os.makedirs(os.path.join(folder, "tokenizer"))
    for f in tok.files:
        epath.Path(f).copy(epath.Path(folder) / "tokenizer" / epath.Path(f).name)
    return {
        "format": data.FORMAT, "version": data.FORMAT_VERSION,
        "tokenizer": {"spec": tok.spec, "digest": tok.digest, "vocab_size": tok.vocab_size, "bos_id": tok.bos_id,
                      "eos_id": tok.eos_id},
        "token_dtype": tok.dtype.name, "record_tokens": record_tokens,
        "splits": {name: split.close() for name, split in splits.items()},
        "text_field": text_field, "eval_fraction": eval_fraction,
    }


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


def _chunks(texts: Iterable[str]) -> Iterator[list[str]]:
    chunk, size = [], 0
    for text in texts:
        chunk.append(text)
        size += len(text)
        if size >= CHUNK_CHARS:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def _tokenize(spec: str, texts: list[str]) -> list[np.ndarray]:
    tok = tokenizer.load(spec)  # cached: loaded once per process
    return [tok.document(text).astype(tok.dtype) for text in texts]


def _tokenized(chunks: Iterator[list[str]], spec: str, workers: int) -> Iterator[list[np.ndarray]]:
    """Each chunk's documents tokenized, in order whatever the number of workers. At most two chunks per worker
    are in flight, so memory does not grow with the corpus (Pool.imap would read all of it ahead)."""
    if workers == 1:
        yield from (_tokenize(spec, chunk) for chunk in chunks)
        return
    # forkserver, not fork: the calling process may run threads (JAX's, the tokenizer library's), and a child forked
    # from it could wait forever on a lock one of them held. Each worker loads the tokenizer once.
    with multiprocessing.get_context("forkserver").Pool(workers) as pool:
        pending = collections.deque()
        for chunk in chunks:
            pending.append(pool.apply_async(_tokenize, (spec, chunk)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


class _SplitWriter:
    """One split's token stream, written as fixed-size records into numbered shards."""

    def __init__(self, folder: str, name: str, dtype: np.dtype, record_tokens: int, records_per_shard: int):
        self.folder, self.name, self.dtype = folder, name, dtype
        self.record_tokens, self.records_per_shard = record_tokens, records_per_shard
        self.pending: list[np.ndarray] = []  # tokens not yet in a record, fewer than record_tokens
        self.pending_tokens = self.documents = self.tokens = 0
        self.shards: list[dict] = []
        self.writer = None

    def add(self, doc: np.ndarray) -> None:
        self.pending.append(doc)
        self.pending_tokens += len(doc)
        self.documents += 1
        self.tokens += len(doc)
        if self.pending_tokens >= self.record_tokens:
            stream = np.concatenate(self.pending)
            full = len(stream) // self.record_tokens * self.record_tokens
            for start in range(0, full, self.record_tokens):
                self._write(stream[start: start + self.record_tokens])
            self.pending, self.pending_tokens = [stream[full:]], len(stream) - full

    def _write(self, record: np.ndarray) -> None:
        from array_record.python.array_record_module import ArrayRecordWriter

        if not self.shards or self.shards[-1]["records"] == self.records_per_shard:
            self._close_shard()
            self.shards.append({"file": f"{self.name}-{len(self.shards):05d}.array_record", "records": 0})
            self.writer = ArrayRecordWriter(os.path.join(self.folder, self.shards[-1]["file"]), WRITER_OPTIONS)
        self.writer.write(record.tobytes())
        self.shards[-1]["records"] += 1

    def _close_shard(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    def close(self) -> dict:
        """The last, shorter record written; the split's counts and shards."""
        if self.pending_tokens:
            self._write(np.concatenate(self.pending))
        self._close_shard()
        return {"documents": self.documents, "tokens": self.tokens, "shards": self.shards}
