"""Chat templates: a conversation rendered to exactly the text and tokens transformers' `apply_chat_template`
gives, and which of its tokens the assistant wrote - what chat SFT trains (docs/post-training.md).

A Hugging Face tokenizer carries its chat format as a Jinja template. A model tuned on conversations must see them
as it will be prompted at inference, where transformers renders them, so the template runs here in an environment
built like transformers': sandboxed (templates from the Hub are untrusted code), `trim_blocks` and `lstrip_blocks`,
`break`/`continue`, a `tojson` that leaves non-ASCII and HTML characters alone, `raise_exception`, `strftime_now`,
the tokenizer's special tokens (`bos_token`, `eos_token`, ...) as variables, and the `{% generation %}` tag that
marks what the assistant generates. Messages are passed as transformers passes them: keys whose value is null
dropped, a message's reasoning under each of the names templates read. The rendered text is tokenized with the
special tokens the template writes parsed as such (HFTokenizer.encode_rendered).

Which tokens are the assistant's: with `{% generation %}` markers, every token overlapping a marked span of the text
(transformers' `return_assistant_tokens_mask`: a token straddling a span's edge counts in). Without markers, the
prefix method: for assistant message i, render(messages[:i], add_generation_prompt) minus render(messages[:i]) is
its header (not trained), render(messages[:i+1]) minus that its own text (content and end-of-turn: trained), the
spans mapped to tokens the same way. That needs renderings that extend each other; a template that rewrites
earlier turns (Qwen3's thinking, dropped from past turns) is refused with the two ways out.
"""

from __future__ import annotations

import contextvars
import datetime
import functools
import hashlib
import json
import re
from typing import Any, ClassVar

import numpy as np
from etils import epath

from scaletrain.data import tokenizer as tokenizer_lib
from scaletrain.errors import DataError, UserError, first_line
from scaletrain.store import storage

GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
# The names a message's reasoning goes by; templates read the first (and gpt-oss's, `thinking`).
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

# The characters rendered so far and the spans `{% generation %}` marked, while a render tracks them.
_tracking: contextvars.ContextVar[_Tracker | None] = contextvars.ContextVar("chat_tracking", default=None)


class _Tracker:
    def __init__(self):
        self.length, self.spans = 0, []


class _Refused(Exception):
    """The template's own `raise_exception(message)`."""


def _generation_extension():
    # Jinja is imported when the first template is compiled: only conversations need it.
    import jinja2.ext
    import jinja2.nodes

    class Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}`: renders its body, and records where in the output it went."""

        tags: ClassVar[set[str]] = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

        def _mark(self, caller) -> str:
            text = caller()
            # Everything before it has been yielded (and counted) by the time Jinja calls this: the output is a
            # generator consumed piece by piece.
            if (tracker := _tracking.get()) is not None:
                tracker.spans.append((tracker.length, tracker.length + len(text)))
            return text

    return Generation


def _raise(message: str):
    raise _Refused(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson escapes HTML characters, which no model was trained to read.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.datetime.now().strftime(format)


@functools.lru_cache(maxsize=16)
def _compiled(text: str, what: str):
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_generation_extension(), "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise, strftime_now=_strftime_now)
    try:
        return env.from_string(text)
    except jinja2.TemplateSyntaxError as e:
        raise UserError(f"{what}: not a Jinja template (line {e.lineno}: {e.message})") from None


def digest(text: str) -> str:
    """A template's sha256: what a prepared dataset records of the template its tokens were rendered with."""
    return hashlib.sha256(text.encode()).hexdigest()


class ChatTemplate:
    """A tokenizer's chat template (or data.chat_template's), ready to render and tokenize conversations."""

    def __init__(self, text: str, tok: tokenizer_lib.HFTokenizer, what: str):
        self.text, self.tok, self.what = text, tok, what
        self.marked = bool(GENERATION_TAG.search(text))  # {% generation %}: the assistant's text is marked
        self._template = _compiled(text, what)

    def render(self, messages: list[dict], where: str, add_generation_prompt: bool = False,
               ) -> tuple[str, list[tuple[int, int]]]:
        """The text of `messages`, and the character spans {% generation %} marked in it."""
        tracker = _Tracker()
        reset = _tracking.set(tracker)
        pieces = []
        try:
            for piece in self._template.generate(messages=_as_passed(messages), tools=None, documents=None,
                                                 add_generation_prompt=add_generation_prompt,
                                                 **self.tok.special_tokens):
                pieces.append(piece)
                tracker.length += len(piece)
        except _Refused as e:
            raise DataError(f"{where}: the chat template ({self.what}) refused it: {e}") from None
        except Exception as e:  # noqa: BLE001 - a template can fail any way Python can; the row is what to name
            raise DataError(f"{where}: the chat template ({self.what}) failed on it: {type(e).__name__}: "
                            f"{first_line(e)}") from None
        finally:
            _tracking.reset(reset)
        return "".join(pieces), tracker.spans

    def tokens(self, messages: list[dict], where: str, add_generation_prompt: bool = False) -> np.ndarray:
        """apply_chat_template(messages, tokenize=True, add_generation_prompt=...)'s ids."""
        return self.tok.encode_rendered(self.render(messages, where, add_generation_prompt)[0])[0]

    def conversation(self, messages: list[dict], where: str, assistant: bool) -> tuple[np.ndarray, np.ndarray]:
        """(The conversation's ids, which of them are the assistant's); with `assistant` False, none are looked
        for (all False): a conversation trained on every token needs no assistant turn and no prefix-stable
        template."""
        text, marked = self.render(messages, where)
        ids, offsets = self.tok.encode_rendered(text)
        if not assistant:
            return ids, np.zeros(len(ids), bool)
        if not any(m.get("role") == "assistant" for m in messages):
            raise DataError(f"{where}: the conversation has no assistant message, so nothing of it trains on the "
                            f"assistant's tokens (data.loss_on=assistant); drop it, or set data.loss_on=all")
        trained = _overlapping(offsets, marked if self.marked else self._prefix_spans(messages, text, where))
        if not trained.any():
            raise DataError(f"{where}: the chat template ({self.what}) marks no assistant tokens in this "
                            f"conversation: its {{% generation %}} markers enclose nothing here")
        return ids, trained

    def _prefix_spans(self, messages: list[dict], text: str, where: str) -> list[tuple[int, int]]:
        """Each assistant message's own text in `text` (the whole conversation's): the prefix method."""
        render = functools.cache(lambda n, prompt: self.render(messages[:n], where, prompt)[0])
        spans = []
        for i, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            before, header, turn = render(i, False), render(i, True), render(i + 1, False)
            if not (header.startswith(before) and turn.startswith(header) and text.startswith(turn)):
                raise DataError(
                    f"{where}: the chat template ({self.what}) does not render this conversation's beginnings as "
                    f"beginnings of it (message {i + 1}, the assistant's, changes what comes before it), so the "
                    f"assistant's tokens cannot be told apart; add {{% generation %}} markers around the "
                    f"assistant's text in the template, or set data.chat_template to a template whose renderings "
                    f"of a conversation's beginnings are prefixes of each other")
            spans.append((len(header), len(turn)))
        return spans


def _as_passed(messages: list[dict]) -> list[dict]:
    """Messages as transformers hands them to a template: null values dropped (many templates render a present
    None as text), a message's reasoning under every name templates read it by."""
    passed = []
    for message in messages:
        message = {key: value for key, value in message.items() if value is not None}
        reasoning = next((message[key] for key in REASONING_FIELDS if key in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        passed.append(message)
    return passed


def _overlapping(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> np.ndarray:
    """Which tokens overlap a span: transformers' walk, tokens and spans both in order, so that a token straddling
    a span's edge counts in."""
    trained, k = np.zeros(len(offsets), bool), 0
    for t, (start, end) in enumerate(offsets):
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        trained[t] = end > spans[k][0]
    return trained


def template_text(spec: str, tok: tokenizer_lib.Tokenizer) -> tuple[str, str] | None:
    """(The template's text, how messages name it): data.chat_template's file when `spec` is set, else the
    tokenizer's own; None when the tokenizer has none."""
    if spec:
        storage.probe(spec)  # an unreachable bucket said at once, not after a minute of retries
        path = epath.Path(spec)
        if not path.is_file():
            raise UserError(f"data.chat_template '{spec}' not found; expected a Jinja file (.jinja) holding a chat "
                            f"template")
        try:
            return path.read_bytes().decode("utf-8"), spec
        except UnicodeDecodeError as e:
            raise UserError(f"data.chat_template '{spec}' is not UTF-8 text (byte {e.start})") from None
    text = tok.chat_template if isinstance(tok, tokenizer_lib.HFTokenizer) else None
    return None if text is None else (text, f"{tok.name}'s")


@functools.lru_cache(maxsize=8)
def load(spec: str, tokenizer_spec: str) -> ChatTemplate:
    """The chat template conversations are rendered with: data.chat_template's file (`spec`), else the tokenizer's.
    Cached: each prepare worker loads it once."""
    tok = tokenizer_lib.load(tokenizer_spec)
    if not isinstance(tok, tokenizer_lib.HFTokenizer):
        raise UserError(f"conversations are rendered by a chat template and tokenized as transformers does: "
                        f"data.tokenizer must be a Hugging Face tokenizer.json, not {tok.name}")
    found = template_text(spec, tok)
    if found is None:
        raise UserError(f"{tok.name} has no chat template (no {tokenizer_lib.CHAT_TEMPLATE_FILE} beside it, no "
                        f"'chat_template' in its tokenizer_config.json); set data.chat_template to a .jinja file")
    return ChatTemplate(found[0], tok, found[1])


def messages_of(value: Any, where: str, field: str) -> list[dict]:
    """A row's list of messages, each an object with a string 'role'."""
    if not (isinstance(value, list) and value
            and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in value)):
        raise DataError(f"{where}: '{field}' must be a non-empty list of messages, each an object with a string "
                        f"'role' (and its 'content')")
    return value
