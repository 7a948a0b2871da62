"""Input files, local or gs://: which files a path names, and what they hold - documents (data.format text) or rows
(the post-training formats' JSON objects).

A path is a file, a folder (its .txt, .jsonl and .parquet files, recursively) or a glob (`**` for any number of
folders). A .jsonl file holds one JSON object a non-blank line, a .parquet file one a row (read a batch of rows at a
time with pyarrow, never whole); any other file is one document. Bad input is a DataError naming the file and line
(or row): the command line prints it as one `error:` line.
"""

from __future__ import annotations

import fnmatch
import glob
import json
import sysconfig
from pathlib import Path
from typing import Any, Iterator

from etils import epath

from scaletrain.errors import DataError, first_line
from scaletrain.store import storage

SUFFIXES = (".txt", ".jsonl", ".parquet")  # the files a folder contributes
PARQUET_BATCH = 1024  # rows read at a time


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
    storage.probe(path)  # an unreachable bucket said at once, not after a minute of the listing's retries
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


def rows(f: epath.Path, fields: tuple[str, ...]) -> Iterator[tuple[str, dict]]:
    """A .jsonl or .parquet file's rows as (where - file:line, or file: row N -, the row's object), streamed; a
    Parquet file must have every column of `fields` (only those are read)."""
    if f.suffix == ".jsonl":
        for where, value in _json_lines(f):
            if not isinstance(value, dict):
                raise DataError(f"{where}: expected a JSON object with {_named(fields)}")
            yield where, value
    elif f.suffix == ".parquet":
        yield from _parquet_rows(f, fields)
    else:
        raise DataError(f"{f}: rows with {_named(fields)} are read from .jsonl or .parquet files, not a "
                        f"'{f.suffix or 'suffixless'}' file")


def _named(fields: tuple[str, ...]) -> str:
    return f"field{'s' * (len(fields) > 1)} {', '.join(repr(name) for name in fields)}"


def _utf8(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{where}: not UTF-8 text (byte {e.start})") from None


def _text_document(f: epath.Path, _text_field: str) -> Iterator[str]:
    yield _utf8(f.read_bytes(), str(f))


def _json_lines(f: epath.Path) -> Iterator[tuple[str, Any]]:
    """Each non-blank line of a JSONL file: (file:line, its JSON value, None where the line is not JSON)."""
    with f.open("rb") as lines:
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            where = f"{f}:{n}"
            try:
                value = json.loads(_utf8(line, where))
            except json.JSONDecodeError:
                value = None
            yield where, value


def _jsonl_documents(f: epath.Path, text_field: str) -> Iterator[str]:
    for where, value in _json_lines(f):
        text = value.get(text_field) if isinstance(value, dict) else None
        if not isinstance(text, str):
            raise DataError(f"{where}: expected a JSON object with a string field '{text_field}'")
        yield text


def _parquet_rows(f: epath.Path, columns: tuple[str, ...]) -> Iterator[tuple[str, dict]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    with f.open("rb") as raw:
        try:
            table = pq.ParquetFile(raw)
            names = table.schema_arrow.names
            if missing := [c for c in columns if c not in names]:
                raise DataError(f"{f}: no column {', '.join(repr(c) for c in missing)}; its columns are "
                                f"{', '.join(names)}")
            row = 0
            for batch in table.iter_batches(batch_size=PARQUET_BATCH, columns=list(columns)):
                for value in batch.to_pylist():
                    row += 1
                    yield f"{f}: row {row}", value
        except (pa.ArrowException, OSError) as e:
            raise DataError(f"{f}: not a readable Parquet file ({first_line(e)})") from None


def _parquet_documents(f: epath.Path, text_field: str) -> Iterator[str]:
    for where, row in _parquet_rows(f, (text_field,)):
        if not isinstance(text := row[text_field], str):
            raise DataError(f"{where}: column '{text_field}' holds {text!r}, not a string")
        yield text


def file_documents(path: str, text_field: str) -> list[str]:
    """Every document of the files `path` names (input_files)."""
    return [text for f in input_files(path) for text in documents(f, text_field)]
