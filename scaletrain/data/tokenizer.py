"""Tokenizers: bytes, Hugging Face tokenizer.json files, SentencePiece models. No JAX here: config validation uses it.

`load(spec)` takes `bytes`, a tokenizer.json, a folder holding one (or a tokenizer.model), or a SentencePiece
`.model`, local or gs://. Every tokenizer has an EOS; BOS is optional (Qwen's has none). A training stream is
documents, each `document(text)` = [BOS] + ids + [EOS], so the EOS alone marks where documents end. A Hugging Face
tokenizer also carries what its chat template needs (scaletrain/data/chat.py): the template, the special tokens it
names, and an encoding of rendered conversations in which the special tokens the template writes are parsed.
"""

from __future__ import annotations

import functools
import hashlib
import json
from typing import Callable

import numpy as np
from etils import epath

from scaletrain.errors import UserError, first_line
from scaletrain.store import storage

# The byte tokenizer's ids: 0-255 are bytes, then BOS, EOS and PAD.
BOS, EOS, PAD = 256, 257, 258
VOCAB_SIZE = 259

# Looked up in this order in a tokenizer.json's vocabulary when no tokenizer_config.json beside it names them.
KNOWN_BOS = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>")
KNOWN_EOS = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>")
# The special tokens transformers hands a chat template as variables (its SPECIAL_TOKENS_ATTRIBUTES), from
# tokenizer_config.json.
TEMPLATE_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # where transformers 5 saves a tokenizer's chat template

SPECS = "bytes, a tokenizer.json, a folder holding one (or a tokenizer.model), or a SentencePiece .model"


class Tokenizer:
    """Text <-> token ids. `encode` adds no special tokens; `document` is one document of a training stream."""

    spec: str  # as given to load()
    name: str  # for messages
    vocab_size: int  # ids are in [0, vocab_size)
    bos_id: int | None
    eos_id: int
    digest: str  # sha256 of the defining file and the BOS/EOS ids: what a prepared dataset's tokens depend on
    files: tuple[epath.Path, ...]  # the files that define it, to copy it elsewhere

    def encode(self, text: str) -> np.ndarray:
        raise NotImplementedError

    def decode(self, ids) -> str:
        """Text of `ids`, special tokens left out."""
        raise NotImplementedError

    def document(self, text: str) -> np.ndarray:
        head = [] if self.bos_id is None else [self.bos_id]
        return np.concatenate([np.asarray(head, np.int32), self.encode(text), np.asarray([self.eos_id], np.int32)])

    @property
    def dtype(self) -> np.dtype:
        """The smallest unsigned integer type that holds every id: how token streams are stored."""
        return np.dtype(np.uint16 if self.vocab_size <= 1 << 16 else np.uint32)


class ByteTokenizer(Tokenizer):
    def __init__(self):
        self.spec, self.name, self.vocab_size = "bytes", "the byte tokenizer", VOCAB_SIZE
        self.bos_id, self.eos_id = BOS, EOS
        self.digest = hashlib.sha256(b"scaletrain bytes: ids 0-255 bytes, BOS 256, EOS 257, PAD 258").hexdigest()
        self.files = ()

    def encode(self, text: str) -> np.ndarray:
        # surrogateescape: text decoded with it (a few of the standard library's files are not UTF-8) gives back
        # exactly the bytes it was read from.
        return np.frombuffer(text.encode("utf-8", "surrogateescape"), np.uint8).astype(np.int32)

    def decode(self, ids) -> str:
        return bytes(int(t) for t in ids if t < 256).decode("utf-8", errors="replace")


class HFTokenizer(Tokenizer):
    """A Hugging Face tokenizer.json; BOS and EOS from the tokenizer_config.json beside it, else well-known names.
    Its chat template: chat_template.jinja beside it, else tokenizer_config.json's `chat_template` (a string, or a
    list of named templates: the one named `default`), as transformers loads it; None when there is none."""

    special_tokens: dict[str, str]  # tokenizer_config.json's TEMPLATE_TOKENS, by name: a chat template's variables
    chat_template: str | None

    def __init__(self, spec: str, path: epath.Path):
        raw = _read(spec, path)
        self._raw = raw.decode("utf-8", errors="replace")
        self._tok = self._parsed(spec, path)
        # A document's text never becomes special tokens: an EOS in a stream must mean a document's end.
        self._tok.encode_special_tokens = True
        config = _config(spec, path.parent / "tokenizer_config.json")
        bos = _special_id(spec, config, "bos_token", KNOWN_BOS, self._tok.token_to_id)
        eos = _special_id(spec, config, "eos_token", KNOWN_EOS, self._tok.token_to_id)
        template_file = path.parent / CHAT_TEMPLATE_FILE
        self.special_tokens = {key: token for key in TEMPLATE_TOKENS if (token := _token_text(config.get(key)))}
        self.chat_template = _chat_template(spec, template_file, config)
        files = (path, *(f for f in (path.parent / "tokenizer_config.json", template_file) if f.is_file()))
        _set_up(self, spec, raw, max(self._tok.get_vocab(with_added_tokens=True).values()) + 1, bos, eos, files)

    def _parsed(self, spec: str, path: epath.Path):
        import tokenizers

        try:
            return tokenizers.Tokenizer.from_str(self._raw)
        except Exception as e:  # noqa: BLE001 - the library raises plain Exceptions for bad files
            raise UserError(f"tokenizer '{spec}': {path} is not a tokenizer.json ({first_line(e)})") from None

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, np.int32)

    def encode_rendered(self, text: str) -> tuple[np.ndarray, list[tuple[int, int]]]:
        """The ids of a rendered chat template - the special tokens it writes parsed as such, as transformers
        tokenizes it - and each token's character span in `text` (to find the tokens of a span of the text)."""
        encoding = self._rendered.encode(text, add_special_tokens=False)
        return np.asarray(encoding.ids, np.int32), encoding.offsets

    @functools.cached_property
    def _rendered(self):
        """A second instance that parses special tokens (the first one never does): made when first needed."""
        return self._parsed(self.spec, self.files[0])

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)


class SentencePieceTokenizer(Tokenizer):
    def __init__(self, spec: str, path: epath.Path):
        import sentencepiece

        raw = _read(spec, path)
        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_proto=raw)
        except Exception as e:  # noqa: BLE001 - RuntimeError or OSError, depending on the damage
            raise UserError(f"tokenizer '{spec}': {path} is not a SentencePiece model ({first_line(e)})") from None
        bos, eos = self._sp.bos_id(), self._sp.eos_id()
        _set_up(self, spec, raw, self._sp.get_piece_size(), bos if bos >= 0 else None, eos if eos >= 0 else None,
                (path,))

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._sp.encode(text), np.int32)

    def decode(self, ids) -> str:
        return self._sp.decode([int(i) for i in ids])  # BOS and EOS are control pieces: they decode to nothing


def _set_up(tok: Tokenizer, spec: str, raw: bytes, vocab_size: int, bos: int | None, eos: int | None,
            files: tuple[epath.Path, ...]) -> None:
    if eos is None:
        raise UserError(f"tokenizer '{spec}' has no EOS token; documents in a training stream end with one")
    # A BOS equal to the EOS (GPT-2's <|endoftext|>) would mark each document's start as another's end: one
    # separator between documents is enough.
    tok.bos_id = None if bos == eos else bos
    tok.spec, tok.name, tok.vocab_size, tok.eos_id, tok.files = spec, f"tokenizer '{spec}'", vocab_size, eos, files
    tok.digest = hashlib.sha256(raw + json.dumps({"bos": tok.bos_id, "eos": eos}).encode()).hexdigest()


def _read(spec: str, path: epath.Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise UserError(f"tokenizer '{spec}': cannot read {path} ({e.strerror or first_line(e)})") from None


def _config(spec: str, path: epath.Path) -> dict:
    """tokenizer_config.json, or {} when there is none."""
    if not path.is_file():
        return {}
    try:
        config = json.loads(_read(spec, path))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise UserError(f"tokenizer '{spec}': {path} is not JSON") from None
    return config if isinstance(config, dict) else {}


def _token_text(token):
    """A special token as tokenizer_config.json names it: a string, {"content": ...} (an AddedToken) or null."""
    return token.get("content") if isinstance(token, dict) else token


def _chat_template(spec: str, file: epath.Path, config: dict) -> str | None:
    if file.is_file():
        try:
            return _read(spec, file).decode("utf-8")
        except UnicodeDecodeError as e:
            raise UserError(f"tokenizer '{spec}': {file} is not UTF-8 text (byte {e.start})") from None
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    return template if isinstance(template, str) else None


def _special_id(spec: str, config: dict, key: str, known: tuple[str, ...],
                token_to_id: Callable[[str], int | None]) -> int | None:
    """The id of tokenizer_config.json's `key` (a string, {"content": ...} or null: none); without the key, of the
    first well-known token in the vocabulary."""
    if key not in config:
        return next((i for token in known if (i := token_to_id(token)) is not None), None)
    token = _token_text(config[key])
    if token is None:
        return None
    if not isinstance(token, str) or token_to_id(token) is None:
        raise UserError(f"tokenizer '{spec}': tokenizer_config.json's {key} {token!r} is not in the vocabulary")
    return token_to_id(token)


def exists(spec: str) -> bool:
    return spec == "bytes" or epath.Path(spec).exists()


def copy_to(spec: str, folder: epath.Path) -> None:
    """The files that define tokenizer `spec` (not `bytes`) into `folder`, under the names `load` looks for in a
    folder: the folder then names the same tokenizer, wherever the original goes."""
    tok = load(spec)
    first = "tokenizer.model" if isinstance(tok, SentencePieceTokenizer) else "tokenizer.json"
    folder.mkdir(parents=True, exist_ok=True)
    for i, source in enumerate(tok.files):
        (folder / (first if i == 0 else source.name)).write_bytes(source.read_bytes())


@functools.lru_cache(maxsize=None)
def load(spec: str) -> Tokenizer:
    """The tokenizer `spec` names (cached: config validation, data and generation all load it)."""
    if spec == "bytes":
        return ByteTokenizer()
    storage.probe(spec)  # an unreachable bucket said at once, not after a minute of retries
    path = epath.Path(spec)
    if path.is_dir():
        for name, kind in (("tokenizer.json", HFTokenizer), ("tokenizer.model", SentencePieceTokenizer)):
            if (path / name).is_file():
                return kind(spec, path / name)
        raise UserError(f"tokenizer '{spec}': the folder holds neither tokenizer.json nor tokenizer.model")
    if not path.is_file():
        raise UserError(f"tokenizer '{spec}' not found; expected {SPECS}")
    return SentencePieceTokenizer(spec, path) if path.suffix == ".model" else HFTokenizer(spec, path)
