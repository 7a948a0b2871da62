"""The post-training rows (scaletrain/data/examples.py, packing.py): prompt/completion and preference rows, strings
and lists of messages, tokenized and masked as specified (string rows `[BOS] prompt completion [EOS]`, message rows
as TRL renders them, through transformers); chat examples packed whole by best-fit decreasing, each row's segments,
positions, targets and loss mask; long examples dropped and counted; a preference pair a row; random pairs; and
`data prepare` for each format, read back equal to the rows made from the files, with the format checked."""

import hashlib
import json

import numpy as np
import pytest

from scaletrain import config
from scaletrain.data import examples, packing, prepare, tokenizer
from scaletrain.data import loader as data
from scaletrain.errors import DataError
from tests import chat_fixtures as fx

CONVERSATIONS = fx.conversations(30, seed=3)
QUESTION = [{"role": "user", "content": "why is the sky blue?"}]
ANSWERS = [[{"role": "assistant", "content": "because light scatters."}], [{"role": "assistant", "content": "hello"}]]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return fx.write_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def hf(folder):
    return fx.hf_tokenizer(folder)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """One JSONL file per format."""
    root = tmp_path_factory.mktemp("rows")
    rng = np.random.RandomState(0)
    fx.write_jsonl(root / "chat.jsonl", [{"messages": m} for m in CONVERSATIONS])
    fx.write_jsonl(root / "prompt_completion.jsonl", [
        {"prompt": fx.sentence(rng), "completion": fx.sentence(rng)} if i % 2 else
        {"prompt": m[:-1], "completion": m[-1:]} for i, m in enumerate(CONVERSATIONS)])
    fx.write_jsonl(root / "preference.jsonl", [
        {"prompt": fx.sentence(rng), "chosen": fx.sentence(rng), "rejected": fx.sentence(rng, 20, 40)} if i % 2 else
        {"prompt": m[:-1], "chosen": m[-1:], "rejected": [{"role": "assistant", "content": fx.sentence(rng)}]}
        for i, m in enumerate(CONVERSATIONS)])
    return root


def _cfg(folder, path, data_format, *extra):
    return config.load(None, ["data.source=files", f"data.path={path}", f"data.format={data_format}",
                              f"data.tokenizer={folder}", "model.vocab_size=512", "data.seq_len=128",
                              *(["train.objective=dpo", "checkpoint.init_from=runs/unread"]
                                if data_format == "preference" else []), *extra])


def _segments(row: dict) -> list[dict]:
    """Each segment of a row: its slice of every array."""
    return [{k: v[row["segment_ids"] == s] for k, v in row.items()} for s in range(1, row["segment_ids"].max() + 1)]


def _assert_laid_out(row: dict, sequences: list[examples.Sequence], train_all: bool = False) -> None:
    """`row` holds `sequences` as segments 1, 2, ... then padding, every target within its own sequence, trained
    where the target is a token to learn."""
    segments = _segments(row)
    assert len(segments) == len(sequences)
    for segment, s in zip(segments, sequences):
        np.testing.assert_array_equal(segment["tokens"], s.tokens)
        np.testing.assert_array_equal(segment["positions"], np.arange(len(s)))
        np.testing.assert_array_equal(segment["targets"][:-1], s.tokens[1:])
        learnt = np.ones(len(s) - 1) if train_all else s.trained[1:]
        np.testing.assert_array_equal(segment["loss_mask"], np.append(learnt, 0))
    pad = row["segment_ids"] == 0
    assert np.all(row["segment_ids"][~pad] > 0) and not row["loss_mask"][pad].any()
    assert pad.sum() == len(row["tokens"]) - sum(len(s) for s in sequences)
    assert np.all(pad[np.argmax(pad):]) if pad.any() else True  # padding only at the end


def test_string_rows_are_bos_prompt_completion_eos(folder, tmp_path):
    tok = tokenizer.load(str(folder))
    prompt, completion = "the sky <|im_end|> is", " blue because"  # a special token's text in a row stays text
    (s,) = examples.Maker("prompt_completion", str(folder), "")("row", {"prompt": prompt, "completion": completion})
    asked = [tok.bos_id, *tok.encode(prompt)]
    assert s.tokens.tolist() == asked + tok.encode(completion).tolist() + [tok.eos_id]
    assert s.trained.tolist() == [False] * len(asked) + [True] * (len(s) - len(asked))  # the completion and EOS
    assert tok.eos_id not in s.tokens[:-1]
    # A tokenizer without BOS (Qwen's): none.
    no_bos = fx.write_tokenizer(tmp_path / "no_bos")
    settings = json.loads((no_bos / "tokenizer_config.json").read_text())
    (no_bos / "tokenizer_config.json").write_text(json.dumps({**settings, "bos_token": None}))
    chosen, rejected = examples.Maker("preference", str(no_bos), "")(
        "row", {"prompt": prompt, "chosen": completion, "rejected": " red"})
    assert chosen.tokens.tolist() == s.tokens.tolist()[1:]
    assert rejected.tokens.tolist() == asked[1:] + tok.encode(" red").tolist() + [tok.eos_id]
    assert rejected.trained.sum() == len(tok.encode(" red")) + 1


def test_message_rows_are_rendered_as_trl_does(folder, hf):
    def expected(prompt, completion):
        asked = hf.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True)["input_ids"]
        whole = hf.apply_chat_template(prompt + completion, tokenize=True)["input_ids"]
        assert whole[:len(asked)] == asked
        return whole, [0] * len(asked) + [1] * (len(whole) - len(asked))

    (s,) = examples.Maker("prompt_completion", str(folder), "")("row", {"prompt": QUESTION, "completion": ANSWERS[0]})
    assert (s.tokens.tolist(), s.trained.astype(int).tolist()) == expected(QUESTION, ANSWERS[0])
    pair = examples.Maker("preference", str(folder), "")("row", {"prompt": QUESTION, "chosen": ANSWERS[0],
                                                                  "rejected": ANSWERS[1]})
    for s, answer in zip(pair, ANSWERS):
        assert (s.tokens.tolist(), s.trained.astype(int).tolist()) == expected(QUESTION, answer)


def test_a_generation_prompt_that_does_not_begin_the_answer_is_refused(folder, tmp_path):
    (tmp_path / "t.jinja").write_text(fx.template("chatml", False).replace(
        "'<|im_start|>assistant\\n' }}", "'<|im_start|>assistant\\n<think>\\n' }}"))
    maker = examples.Maker("prompt_completion", str(folder), str(tmp_path / "t.jinja"))
    with pytest.raises(DataError, match="row 3: .* renders the prompt with add_generation_prompt to tokens that do "
                                        "not begin"):
        maker("row 3", {"prompt": QUESTION, "completion": ANSWERS[0]})
    with pytest.raises(DataError, match="row 4: expected 'prompt' and 'completion' to be all strings or all lists"):
        maker("row 4", {"prompt": "a", "completion": ANSWERS[0]})


def test_parquet_rows_of_messages_are_those_of_jsonl(folder, corpus, tmp_path):
    """A Parquet column of message lists (structs; a key one message lacks comes back null, and is dropped)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    named = [[{**m, "name": "x"} if i == 0 and j == 0 else m for j, m in enumerate(c)]
             for i, c in enumerate(CONVERSATIONS[:4])]
    pq.write_table(pa.table({"messages": named}), tmp_path / "chat.parquet")
    fx.write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in named])
    maker = examples.Maker("chat", str(folder), "")
    from_parquet = examples.made(maker, examples.rows(str(tmp_path / "chat.parquet"), "chat"))
    from_jsonl = examples.made(maker, examples.rows(str(tmp_path / "chat.jsonl"), "chat"))
    assert [e[0].tokens.tolist() for e in from_parquet] == [e[0].tokens.tolist() for e in from_jsonl]
    pq.write_table(pa.table({"text": ["x"]}), tmp_path / "text.parquet")
    with pytest.raises(DataError, match="text.parquet: no column 'messages'; its columns are text"):
        list(examples.rows(str(tmp_path / "text.parquet"), "chat"))


def test_a_records_extras_are_placed_like_its_targets():
    """Room for per-token arrays beside the tokens (a reference model's log-probs, ref_logprobs)."""
    pair = tuple(examples.Sequence(np.arange(n, dtype=np.int32) + 10, np.arange(n) >= 2,
                                   {"ref_logprobs": -np.arange(n, dtype=np.float32)}) for n in (5, 4))
    dtype = np.dtype(np.uint16)
    back = examples.from_record(examples.to_record(pair, dtype, ("ref_logprobs",)), np.array([5, 4]), dtype,
                                ("ref_logprobs",))
    for a, b in zip(back, pair):
        assert a.tokens.tolist() == b.tokens.tolist() and a.trained.tolist() == b.trained.tolist()
        assert a.extras["ref_logprobs"].tolist() == b.extras["ref_logprobs"].tolist()
    row = packing.layout(list(back), 12, 0, train_all=False, extras=("ref_logprobs",))
    np.testing.assert_array_equal(row["ref_logprobs"], [-1, -2, -3, -4, 0, -1, -2, -3, 0, 0, 0, 0])
    np.testing.assert_array_equal(row["loss_mask"], [0, 1, 1, 1, 0, 0, 1, 1, 0, 0, 0, 0])


def test_best_fit_decreasing_fills_the_tightest_room():
    assert packing.best_fit_decreasing(np.array([5, 4, 3, 3, 2, 1, 6]), 8) == [[4, 6], [0, 2], [1, 3, 5]]
    lengths = np.random.RandomState(0).randint(1, 60, 500)
    bins = packing.best_fit_decreasing(lengths, 64)
    assert sorted(i for b in bins for i in b) == list(range(500))
    assert max(lengths[b].sum() for b in bins) <= 64
    assert len(bins) <= -(-lengths.sum() // 64) * 1.1  # within 10% of a perfect packing


@pytest.mark.parametrize("loss_on", ["assistant", "all"])
def test_chat_examples_are_packed_whole(folder, corpus, loss_on):
    cfg = _cfg(folder, corpus / "chat.jsonl", "chat", "data.seq_len=64", f"data.loss_on={loss_on}")
    maker = examples.Maker("chat", str(folder), "")
    made = [example for example, in examples.made(maker, examples.rows(str(corpus / "chat.jsonl"), "chat"))]
    source = data.make_source(cfg)
    assert source.dropped == sum(len(s) > 64 for s in made) > 0
    seen = []
    for i in range(len(source)):
        row = source[i]
        assert {k: (v.shape, v.dtype) for k, v in row.items()} == {
            k: ((64,), np.float32 if k == "loss_mask" else np.int32)
            for k in ("tokens", "targets", "positions", "segment_ids", "loss_mask")}
        held = [next(j for j, s in enumerate(made) if np.array_equal(s.tokens, segment["tokens"]))
                for segment in _segments(row)]
        _assert_laid_out(row, [made[j] for j in held], train_all=loss_on == "all")
        seen += held
    assert sorted(seen) == [j for j, s in enumerate(made) if len(s) <= 64]  # each example once, whole
    assert len(source) < len(seen)  # several a row
    with pytest.raises(DataError, match=r"all 30 examples are longer than data.seq_len=8"):
        data.make_source(_cfg(folder, corpus / "chat.jsonl", "chat", "data.seq_len=8"))


def test_prompt_completion_rows_train_the_completion(folder, corpus):
    source = data.make_source(_cfg(folder, corpus / "prompt_completion.jsonl", "prompt_completion"))
    maker = examples.Maker("prompt_completion", str(folder), "")
    rows = list(examples.rows(str(corpus / "prompt_completion.jsonl"), "prompt_completion"))
    made = examples.made(maker, rows)
    by_tokens = {tuple(s.tokens): s for s, in made}
    count = 0
    for i in range(len(source)):
        row = source[i]
        sequences = [by_tokens[tuple(segment["tokens"])] for segment in _segments(row)]
        _assert_laid_out(row, sequences)
        count += len(sequences)
    assert count == len(made) and source.dropped == 0


def test_preference_rows_hold_one_pair_each(folder, corpus, hf):
    path = corpus / "preference.jsonl"
    source = data.make_source(_cfg(folder, path, "preference", "data.seq_len=64"))
    made = examples.made(examples.Maker("preference", str(folder), ""), examples.rows(str(path), "preference"))
    fits = [pair for pair in made if len(pair[0]) + len(pair[1]) <= 64]
    assert source.dropped == len(made) - len(fits) > 0 and len(source) == len(fits)
    for i, pair in enumerate(fits):
        row = source[i]
        _assert_laid_out(row, list(pair))  # segment 1 chosen, 2 rejected: each trained on its completion alone
        prompt = pair[0].tokens[~pair[0].trained]
        np.testing.assert_array_equal(pair[1].tokens[:len(prompt)], prompt)  # the same prompt
    with pytest.raises(DataError, match="dpo.reference=precomputed reads the reference's log-probs from the data, "
                                        "but data.path '.*' carries no ref_logprobs"):
        data.make_source(_cfg(folder, path, "preference", "dpo.reference=precomputed"))
    first = json.loads(path.read_text().splitlines()[0])  # a row of messages, as transformers renders it
    chosen = hf.apply_chat_template(first["prompt"] + first["chosen"], tokenize=True)["input_ids"]
    assert made[0][0].tokens.tolist() == chosen


def test_random_pairs_are_laid_out_as_real_ones():
    cfg = config.load(None, ["data.source=synthetic", "data.format=preference", "train.objective=dpo",
                             "dpo.reference=precomputed", "data.seq_len=32"])
    dataset = data.make_dataset(cfg)
    row = dataset[5]
    assert (row["ref_logprobs"] < 0).sum() == 30 and (row["ref_logprobs"][row["loss_mask"] == 0] < 0).sum() == 14
    chosen, rejected = _segments(row)
    assert len(chosen["tokens"]) == len(rejected["tokens"]) == 16
    np.testing.assert_array_equal(chosen["tokens"][:8], rejected["tokens"][:8])  # the prompt
    np.testing.assert_array_equal(row["loss_mask"], np.tile(np.r_[np.zeros(7), np.ones(8), 0], 2))
    np.testing.assert_array_equal(data.make_dataset(cfg)[5]["tokens"], row["tokens"])


@pytest.mark.parametrize("data_format, workers", [("chat", 1), ("prompt_completion", 1), ("preference", 2)])
def test_prepared_rows_equal_those_made_from_the_files(data_format, workers, folder, corpus, tmp_path):
    tok = tokenizer.load(str(folder))
    path = corpus / f"{data_format}.jsonl"
    meta = prepare.prepare(tok, [str(path)], str(tmp_path / "ds"), "text", 0.0, workers, records_per_shard=7,
                           data_format=data_format)
    assert meta["data_format"] == data_format and len(meta["splits"]["train"]["shards"]) == 5
    assert meta["chat_template"]["sha256"] == hashlib.sha256(tok.chat_template.encode()).hexdigest()
    variants = [()] if data_format == "preference" else [(), ("data.loss_on=all",)]
    for extra in variants:
        from_files = data.make_source(_cfg(folder, path, data_format, *extra))
        prepared = data.make_source(_cfg(folder, tmp_path / "ds", data_format, "data.source=prepared", *extra))
        assert len(prepared) == len(from_files) and prepared.dropped == from_files.dropped
        for i in range(len(prepared)):
            a, b = prepared[i], from_files[i]
            assert a.keys() == b.keys()
            for key in a:
                np.testing.assert_array_equal(a[key], b[key])


def test_prepared_eval_split_and_formats_checked(folder, corpus, tmp_path):
    tok = tokenizer.load(str(folder))
    prepare.prepare(tok, [str(corpus / "chat.jsonl")], str(tmp_path / "chat"), "text", 0.3, 1, data_format="chat")
    cfg = _cfg(folder, tmp_path / "chat", "chat", "data.source=prepared")
    train, held_out = data.make_source(cfg), data.make_eval_dataset(cfg)
    meta = json.loads((tmp_path / "chat" / "metadata.json").read_text())
    assert meta["splits"]["train"]["examples"] + meta["splits"]["eval"]["examples"] == len(CONVERSATIONS)
    assert 0 < len(held_out) < len(train)
    for i in range(len(held_out)):  # packed and masked as for training: the assistant's tokens alone
        row = held_out[i]
        assert 0 < row["loss_mask"].sum() < (row["segment_ids"] > 0).sum() - row["segment_ids"].max()
    (tmp_path / "other.jinja").write_text(fx.template("qwen25", False))
    with pytest.raises(DataError, match="was rendered with another chat template"):
        data.make_source(_cfg(folder, tmp_path / "chat", "chat", "data.source=prepared",
                              f"data.chat_template={tmp_path / 'other.jinja'}"))
    with pytest.raises(DataError, match=r"holds chat data .* not data.format=prompt_completion"):
        data.make_source(_cfg(folder, tmp_path / "chat", "prompt_completion", "data.source=prepared"))
    text_cfg = config.load(None, ["data.source=prepared", f"data.path={tmp_path / 'chat'}", f"data.tokenizer={folder}",
                                  "model.vocab_size=512"])
    with pytest.raises(DataError, match="holds chat data .* not data.format=text"):
        data.make_source(text_cfg)
    (tmp_path / "text.txt").write_text("the model answers")
    prepare.prepare(tok, [str(tmp_path / "text.txt")], str(tmp_path / "text"), "text", 0.0, 1)
    with pytest.raises(DataError, match="holds text data .* not data.format=chat"):
        data.make_source(_cfg(folder, tmp_path / "text", "chat", "data.source=prepared"))
