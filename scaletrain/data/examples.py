"""The post-training row formats (data.format chat, prompt_completion, preference) -> examples: token sequences,
each with the tokens its format trains, and the record an example is stored as in a prepared dataset.

    chat               {"messages": [{"role": ..., "content": ...}, ...]}: the conversation rendered by the chat
                       template (scaletrain/data/chat.py); trained: the assistant's tokens
    prompt_completion  {"prompt": ..., "completion": ...}: trained: the completion's tokens
    preference         {"prompt": ..., "chosen": ..., "rejected": ...}: two sequences, prompt + chosen and
                       prompt + rejected; trained: each completion's tokens

A prompt and its completions are strings, or lists of messages rendered as TRL renders them: the prompt's ids are
render(prompt, add_generation_prompt=True), the completion's those that render(prompt + completion) adds after them
(a template under which the first is not a prefix of the second is refused). String rows are `[BOS] prompt
completion [EOS]`, prompt and completion tokenized apart (no BOS where the tokenizer has none), the completion and
the EOS trained: the model learns to end its answer.

An example is what packing keeps whole (scaletrain/data/packing.py): one sequence, or a preference pair's two.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable

import numpy as np

from scaletrain.data import chat, files
from scaletrain.data import tokenizer as tokenizer_lib
from scaletrain.errors import DataError

FIELDS = {"chat": ("messages",), "prompt_completion": ("prompt", "completion"),
          "preference": ("prompt", "chosen", "rejected")}
# What each format's examples mark as trained; data.loss_on=all trains every token instead.
TRAINED = {"chat": "assistant", "prompt_completion": "completion", "preference": "completion"}
SEQUENCES = {"chat": 1, "prompt_completion": 1, "preference": 2}  # an example's


@dataclasses.dataclass(frozen=True)
class Sequence:
    tokens: np.ndarray  # int32
    trained: np.ndarray  # bool, per token: the format's tokens to learn (the assistant's, a completion's)
    # Per-token float32 arrays a prepared dataset may carry beside the tokens (e.g. `ref_logprobs`, a reference
    # model's log-probability of each token given those before it; the first token's 0).
    extras: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.tokens)


Example = tuple[Sequence, ...]  # one sequence, or a preference pair's chosen and rejected


class Maker:
    """Rows of `data_format` -> examples, with tokenizer `tokenizer_spec`; lists of messages are rendered with the
    chat template `template_spec` names (data.chat_template; empty: the tokenizer's own), loaded when the first such
    row comes (string rows need none). With `assistant` False, a chat's assistant tokens are not looked for
    (data.loss_on=all)."""

    def __init__(self, data_format: str, tokenizer_spec: str, template_spec: str, assistant: bool = True):
        self.format, self.template_spec, self.assistant = data_format, template_spec, assistant
        self.tok = tokenizer_lib.load(tokenizer_spec)

    @property
    def template(self) -> chat.ChatTemplate:
        return chat.load(self.template_spec, self.tok.spec)

    def __call__(self, where: str, row: dict) -> Example:
        if self.format == "chat":
            tokens, trained = self.template.conversation(chat.messages_of(row.get("messages"), where, "messages"),
                                                         where, self.assistant)
            return (Sequence(tokens, trained),)
        names = FIELDS[self.format]
        values = [row.get(name) for name in names]
        if not any(all(isinstance(v, kind) for v in values) for kind in (str, list)):
            raise DataError(f"{where}: expected {' and '.join(repr(name) for name in names)} to be all strings or all "
                            f"lists of messages")
        self._check_answers(values[1:], where)
        if isinstance(values[0], str):
            return tuple(self._text(values[0], completion) for completion in values[1:])
        prompt, *completions = (chat.messages_of(v, where, name) for v, name in zip(values, names))
        return tuple(self._rendered(prompt, completion, where) for completion in completions)

    def _check_answers(self, completions: list, where: str) -> None:
        """A preference pair compares two answers: neither may be empty (an empty string or list, or messages
        without content)."""
        def empty(answer) -> bool:
            return not answer or (isinstance(answer, list)
                                  and all(isinstance(m, dict) and not m.get("content") for m in answer))

        if self.format == "preference" and any(empty(answer) for answer in completions):
            raise DataError(f"{where}: an empty completion ('chosen' or 'rejected'); a preference pair compares two "
                            f"answers")

    def _text(self, prompt: str, completion: str) -> Sequence:
        tok = self.tok
        head = np.asarray([] if tok.bos_id is None else [tok.bos_id], np.int32)
        asked = np.concatenate([head, tok.encode(prompt)])
        answer = np.concatenate([tok.encode(completion), np.asarray([tok.eos_id], np.int32)])
        tokens = np.concatenate([asked, answer]).astype(np.int32)
        return Sequence(tokens, np.arange(len(tokens)) >= len(asked))

    def _rendered(self, prompt: list[dict], completion: list[dict], where: str) -> Sequence:
        asked = self.template.tokens(prompt, where, add_generation_prompt=True)
        whole = self.template.tokens(prompt + completion, where)
        if len(whole) < len(asked) or not np.array_equal(whole[:len(asked)], asked):
            raise DataError(f"{where}: the chat template ({self.template.what}) renders the prompt with "
                            f"add_generation_prompt to tokens that do not begin the prompt and completion rendered "
                            f"together, so the completion's tokens cannot be told apart; set data.chat_template to "
                            f"a template whose generation prompt begins the assistant's turn")
        return Sequence(whole, np.arange(len(whole)) >= len(asked))


def rows(path: str, data_format: str):
    """(where, row) of every row of the files data.path names, in order."""
    for f in files.input_files(path):
        yield from files.rows(f, FIELDS[data_format])


def made(maker: Maker, located: Iterable[tuple[str, dict]]) -> list[Example]:
    """Rows with their places, (where, row), made into examples: a file's (data.source files: held in memory) or a
    prepare worker's chunk."""
    return [maker(where, row) for where, row in located]


def lengths(made: list[Example], data_format: str) -> np.ndarray:
    """[examples, sequences] int32: what packing needs, without the tokens."""
    sizes = np.zeros((len(made), SEQUENCES[data_format]), np.int32)
    for i, example in enumerate(made):
        sizes[i] = [len(s) for s in example]
    return sizes


# A prepared example's record: its sequences' tokens (the dataset's token dtype, little-endian), then their trained
# bits (uint8), then each extra's float32 values, sequence after sequence. The lengths are kept beside the records
# (a split's lengths file), so the record carries no header.
def to_record(example: Example, dtype: np.dtype, extras: tuple[str, ...] = ()) -> bytes:
    parts = ([s.tokens.astype(dtype.newbyteorder("<")) for s in example]
             + [s.trained.astype(np.uint8) for s in example]
             + [s.extras[name].astype("<f4") for name in extras for s in example])
    return b"".join(p.tobytes() for p in parts)


def from_record(raw: bytes, sizes: np.ndarray, dtype: np.dtype, extras: tuple[str, ...] = ()) -> Example:
    total, ends = int(sizes.sum()), np.cumsum(sizes)[:-1]
    at = total * dtype.itemsize
    tokens = np.split(np.frombuffer(raw, dtype.newbyteorder("<"), total).astype(np.int32), ends)
    trained = np.split(np.frombuffer(raw, np.uint8, total, at).astype(bool), ends)
    values: dict[str, Any] = {}
    for i, name in enumerate(extras):
        values[name] = np.split(np.frombuffer(raw, "<f4", total, at + total * (1 + 4 * i)).astype(np.float32), ends)
    return tuple(Sequence(t, m, {name: v[k] for name, v in values.items()})
                 for k, (t, m) in enumerate(zip(tokens, trained)))
