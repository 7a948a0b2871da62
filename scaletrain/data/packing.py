"""Examples (scaletrain/data/examples.py) packed whole into training rows of data.seq_len tokens.

A row holds the same arrays as a window of a text stream (loader.pack): tokens, targets, positions, segment_ids,
loss_mask, each [seq_len]. The sequences of a row are segments 1, 2, ... (attention stays inside each), positions
restart at 0 in each, and targets[t] is the next token of the same sequence: a sequence's last token predicts
nothing, and neither does padding (segment 0, positions 0, the pad id - the tokenizer's EOS - as token and target,
loss_mask 0). loss_mask[t] is 1 where targets[t] is a token to learn, so a token's trained bit lands on the position
that predicts it; a sequence's first token is never a target.

- chat, prompt_completion: several examples a row, never split across rows. Which examples share a row is decided
  once, from the lengths alone, by best-fit decreasing (TRL's default `bfd`): longest first, each into the row whose
  free room it fills most tightly. Rows are then a plain list, so a row is a pure function of its index and the
  Grain dataset over them shuffles and resumes like the text windows.
- preference: one pair a row - segment 1 prompt + chosen, segment 2 prompt + rejected - so that a batch of B rows is
  B pairs for DPO.

An example longer than data.seq_len (a pair whose two sequences do not fit together) is left out and counted
(`dropped`); when none fits, that is an error.
"""

from __future__ import annotations

import bisect

import numpy as np

from scaletrain.data.examples import Sequence
from scaletrain.errors import DataError


def best_fit_decreasing(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Bins of indices into `lengths` (each at most `capacity`), each bin's in ascending order: every length, the
    longest first (ties by index), goes into the bin whose room it leaves smallest, a new bin when none has room."""
    bins: list[list[int]] = []
    rooms: list[int] = []  # the distinct free rooms of bins that have some, ascending
    with_room: dict[int, list[int]] = {}  # free room -> the bins with it
    for i in np.argsort(-lengths, kind="stable"):
        n = int(lengths[i])
        k = bisect.bisect_left(rooms, n)
        if k == len(rooms):
            b, room = len(bins), capacity
            bins.append([])
        else:
            room = rooms[k]
            b = with_room[room].pop()
            if not with_room[room]:
                del with_room[room], rooms[k]
        bins[b].append(int(i))
        if room := room - n:
            if room not in with_room:
                bisect.insort(rooms, room)
                with_room[room] = []
            with_room[room].append(b)
    return [sorted(members) for members in bins]


def layout(sequences: list[Sequence], seq_len: int, pad_id: int, train_all: bool,
           extras: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
    """One row of `sequences` (together at most seq_len tokens), then padding. `train_all`: every target within a
    sequence is learnt (data.loss_on=all), else those its sequence marks trained. `extras`: the sequences' per-token
    arrays the row carries (a prepared dataset's ref_logprobs), placed like the targets."""
    row = dict(tokens=np.full(seq_len, pad_id, np.int32), targets=np.full(seq_len, pad_id, np.int32),
               positions=np.zeros(seq_len, np.int32), segment_ids=np.zeros(seq_len, np.int32),
               loss_mask=np.zeros(seq_len, np.float32))
    row.update({name: np.zeros(seq_len, np.float32) for name in extras})
    at = 0
    for segment, s in enumerate(sequences, 1):
        end = at + len(s)
        row["tokens"][at:end] = s.tokens
        row["targets"][at:end - 1] = s.tokens[1:]
        row["positions"][at:end] = np.arange(len(s))
        row["segment_ids"][at:end] = segment
        row["loss_mask"][at:end - 1] = 1.0 if train_all else s.trained[1:]
        for name in extras:
            row[name][at:end - 1] = s.extras[name][1:]
        at = end
    return row


class PackedRows:
    """A Grain data source of rows made of examples: `examples[i]` is example i (a list in memory, or a prepared
    split's records read on demand), `sizes` its sequences' lengths [examples, sequences]. With `pairs`, each row is
    one example's two sequences (preference); else as many whole examples as best-fit decreasing puts in it. Rows
    carry the examples' `extras` beside the tokens."""

    def __init__(self, examples, sizes: np.ndarray, seq_len: int, train_all: bool, pad_id: int, pairs: bool,
                 what: str, extras: tuple[str, ...] = ()):
        self.examples, self.seq_len, self.train_all, self.pad_id = examples, seq_len, train_all, pad_id
        self.extras = extras
        totals = sizes.sum(axis=1)
        fits = np.flatnonzero(totals <= seq_len)
        self.dropped = len(totals) - len(fits)  # examples (pairs) longer than seq_len, left out
        kind = "pairs" if pairs else "examples"
        if not len(totals):
            raise DataError(f"{what} holds no {kind}")
        if not len(fits):
            raise DataError(f"{what}: all {len(totals)} {kind} are longer than data.seq_len={seq_len}"
                            f"{' (a pair: its two sequences together)' if pairs else ''}; nothing would train: raise "
                            f"data.seq_len or shorten them")
        groups = [[int(i)] for i in fits] if pairs else [
            [int(fits[j]) for j in members] for members in best_fit_decreasing(totals[fits], seq_len)]
        self.starts = np.cumsum([0] + [len(g) for g in groups])
        self.members = np.asarray([i for g in groups for i in g], np.int64)

    def __len__(self) -> int:
        return len(self.starts) - 1

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        members = self.members[self.starts[i]: self.starts[i + 1]]
        sequences = [s for m in members for s in self.examples[int(m)]]
        return layout(sequences, self.seq_len, self.pad_id, self.train_all, self.extras)


class SyntheticPairs:
    """Random preference rows, a pure function of (seed, index), laid out as real ones: a shared prompt of a
    quarter of the row, then a chosen and a rejected completion of a quarter each; random negative values for
    `extras` (reference log-probs). For benchmarks and compiles."""

    dropped = 0

    def __init__(self, vocab_size: int, seq_len: int, seed: int, extras: tuple[str, ...] = ()):
        self.vocab_size, self.seq_len, self.seed, self.extras = vocab_size, seq_len, seed, extras

    def __len__(self) -> int:
        return 1 << 30

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([self.seed, i])
        half = self.seq_len // 2
        prompt = rng.integers(0, self.vocab_size, half // 2, np.int32)
        pair = [Sequence(np.concatenate([prompt, rng.integers(0, self.vocab_size, half - len(prompt), np.int32)]),
                         np.arange(half) >= len(prompt),
                         {name: -rng.exponential(size=half).astype(np.float32) for name in self.extras})
                for _ in range(2)]
        return layout(pair, self.seq_len, 0, train_all=False, extras=self.extras)
