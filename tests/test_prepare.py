"""Tokenizers, `data prepare` and training from a prepared dataset (docs/data.md)."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest

from scaletrain import config
from scaletrain.data import loader as data
from scaletrain.data import prepare, tokenizer
from scaletrain.errors import ConfigError, DataError, UserError
from tests.conftest import ROOT, run_main
from tests.test_resume import _command, _finished_checkpoints, _losses, _resumed_step

WORDS = "the data of a model is text and the text is naïve café 数据 🎉 tokens windows".split()
TEXTS = [" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(5 + i % 11)) for i in range(60)]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A byte-level BPE tokenizer.json (300 ids) trained on TEXTS, beside a tokenizer_config.json naming BOS and
    EOS as Hugging Face folders do."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    folder = tmp_path_factory.mktemp("hf")
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": {"content": "</s>"}}))
    return folder


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """TEXTS as a .txt file (the first), a .jsonl file (with a blank line) and a .parquet file (row groups of 4)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path_factory.mktemp("corpus")
    (folder / "a.txt").write_text(TEXTS[0])
    (folder / "b.jsonl").write_text("\n".join(json.dumps({"text": t, "id": i}) for i, t in enumerate(TEXTS[1:30]))
                                    + "\n\n")
    pq.write_table(pa.table({"id": list(range(30, 60)), "text": TEXTS[30:]}), folder / "c.parquet", row_group_size=4)
    return folder


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, hf_dir, corpus):
    out = tmp_path_factory.mktemp("prepared") / "ds"
    prepare.prepare(tokenizer.load(str(hf_dir)), [str(corpus)], str(out), "text", 0.2, 1, record_tokens=16,
                    records_per_shard=5)
    return out


def _documents(folder, meta: dict, split: str, tok) -> list[str]:
    """The text of each document of a prepared split's stream, found by its EOS."""
    stream = data.RecordStream(str(folder), meta, split)
    stream = stream[0: len(stream)]
    return [tok.decode(doc) for doc in np.split(stream, np.flatnonzero(stream == tok.eos_id) + 1)[:-1]]


def test_byte_tokenizer_is_unchanged():
    tok = tokenizer.load("bytes")
    assert tokenizer.load("bytes") is tok and (tok.vocab_size, tok.bos_id, tok.eos_id) == (259, 256, 257)
    np.testing.assert_array_equal(tok.document("aé"), [256, 97, 195, 169, 257])
    assert tok.decode(tok.document("aé")) == "aé" and tok.dtype == np.uint16 and tok.files == ()
    # Stable: datasets prepared with it stay usable.
    assert tok.digest == "4a87af953b47510925d3fec0591f6a10d58ba450ba55ffc6e260510a88fc4641"


def test_hugging_face_tokenizer_json_and_its_config(hf_dir, tmp_path):
    tok = tokenizer.load(str(hf_dir))
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (300, 0, 1)
    assert [f.name for f in tok.files] == ["tokenizer.json", "tokenizer_config.json"]
    assert tokenizer.load(str(hf_dir / "tokenizer.json")).digest == tok.digest  # the same files
    for text in TEXTS[:5]:
        doc = tok.document(text)
        assert doc[0] == 0 and doc[-1] == 1 and 1 not in doc[1:-1] and tok.decode(doc) == text
    assert 1 not in tok.encode("a </s> in a document is text")  # only a document's end is an EOS
    # Qwen's kind: no BOS (tokenizer_config.json says null). Without a config, the well-known names are found.
    for name, cfg, bos in (("no_bos", {"bos_token": None, "eos_token": "</s>"}, None), ("no_config", None, 0)):
        (tmp_path / name).mkdir()
        shutil.copy(hf_dir / "tokenizer.json", tmp_path / name)
        if cfg is not None:
            (tmp_path / name / "tokenizer_config.json").write_text(json.dumps(cfg))
        other = tokenizer.load(str(tmp_path / name))
        assert (other.bos_id, other.eos_id) == (bos, 1)
    no_bos = tokenizer.load(str(tmp_path / "no_bos"))
    np.testing.assert_array_equal(no_bos.document("the"), [*tok.encode("the"), 1])
    assert no_bos.digest != tok.digest  # its streams differ


def test_sentencepiece_model(tmp_path):
    import sentencepiece as spm

    spm.SentencePieceTrainer.train(sentence_iterator=iter(TEXTS), model_prefix=str(tmp_path / "sp"), vocab_size=40,
                                   minloglevel=2)
    (tmp_path / "folder").mkdir()
    shutil.copy(tmp_path / "sp.model", tmp_path / "folder" / "tokenizer.model")
    tok = tokenizer.load(str(tmp_path / "sp.model"))
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (40, 1, 2)
    assert tokenizer.load(str(tmp_path / "folder")).digest == tok.digest
    doc = tok.document(TEXTS[3])
    assert doc[0] == 1 and doc[-1] == 2 and tok.decode(doc) == TEXTS[3]


def test_missing_or_broken_tokenizers(tmp_path):
    with pytest.raises(UserError, match=f"tokenizer '{tmp_path}/nope.json' not found; expected bytes, a tokenizer"):
        tokenizer.load(str(tmp_path / "nope.json"))
    with pytest.raises(UserError, match="the folder holds neither tokenizer.json nor tokenizer.model"):
        tokenizer.load(str(tmp_path))
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(UserError, match="is not a tokenizer.json"):
        tokenizer.load(str(tmp_path / "tokenizer.json"))
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>")).save(str(tmp_path / "no_eos.json"))
    with pytest.raises(UserError, match="has no EOS token"):
        tokenizer.load(str(tmp_path / "no_eos.json"))


def test_prepare_writes_each_format_as_one_stream_and_workers_do_not_matter(tmp_path, hf_dir, corpus, prepared,
                                                                            monkeypatch):
    tok = tokenizer.load(str(hf_dir))
    meta = json.loads((prepared / "metadata.json").read_text())
    assert meta["tokenizer"] == {"spec": str(hf_dir), "digest": tok.digest, "vocab_size": 300, "bos_id": 0,
                                 "eos_id": 1}
    assert (meta["token_dtype"], meta["record_tokens"], meta["files"], meta["eval_fraction"]) == ("uint16", 16, 3, 0.2)
    assert sorted(p.name for p in (prepared / "tokenizer").iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    train, held_out = (meta["splits"][s] for s in ("train", "eval"))
    assert train["documents"] + held_out["documents"] == 60 and held_out["documents"] > 0
    assert len(train["shards"]) > 1 and all(s["records"] <= 5 for s in train["shards"])
    # The documents of each split, in order: every document once, a hash of its index choosing the split.
    assert _documents(prepared, meta, "eval", tok) == [t for i, t in enumerate(TEXTS) if prepare._held_out(i, 0.2)]
    assert _documents(prepared, meta, "train", tok) == [t for i, t in enumerate(TEXTS)
                                                        if not prepare._held_out(i, 0.2)]
    # Two workers, many chunks: the same bytes.
    monkeypatch.setattr(prepare, "CHUNK_CHARS", 100)
    prepare.prepare(tok, [str(corpus)], str(tmp_path / "two"), "text", 0.2, 2, record_tokens=16, records_per_shard=5)
    for f in prepared.iterdir():
        if f.is_file():
            assert (tmp_path / "two" / f.name).read_bytes() == f.read_bytes(), f.name
    assert not list(tmp_path.glob("*.incomplete-*"))


def test_windows_of_a_prepared_dataset_are_those_of_its_stream_in_memory(prepared, hf_dir):
    tok = tokenizer.load(str(hf_dir))
    meta = data.read_metadata(str(prepared), tok)
    stream = data.RecordStream(str(prepared), meta, "train")
    from_disk = data.PackedSource(stream, 7, 1)  # windows of 7 + 1 tokens over records of 16: most straddle two
    in_memory = data.PackedSource(stream[0: len(stream)], 7, 1)
    assert len(from_disk) == (meta["splits"]["train"]["tokens"] - 1) // 7
    for i in range(len(from_disk)):
        for key, value in from_disk[i].items():
            np.testing.assert_array_equal(value, in_memory[i][key])


def test_documents_are_found_by_their_eos_alone():
    """No BOS (Qwen): a document starts after each EOS and at the stream's start; the target after an EOS (the
    next document's first token) is not learned."""
    eos = 9
    source = data.PackedSource(np.array([1, 2, eos, 3, 4, 5, eos, 6, eos, 7]), 4, eos)
    for i, tokens, segment_ids, positions in ((0, [1, 2, eos, 3], [2, 2, 2, 3], [0, 1, 2, 0]),
                                              (1, [4, 5, eos, 6], [1, 1, 1, 2], [0, 1, 2, 0])):
        ex = source[i]
        np.testing.assert_array_equal(ex["tokens"], tokens)
        np.testing.assert_array_equal(ex["segment_ids"], segment_ids)
        np.testing.assert_array_equal(ex["positions"], positions)
        np.testing.assert_array_equal(ex["loss_mask"], [1, 1, 0, 1])


def _cfg(*overrides):
    return config.load(None, ["data.seq_len=8", "train.global_batch=4", *overrides])


def test_training_and_eval_datasets(prepared, hf_dir, corpus, tmp_path):
    tok = f"data.tokenizer={hf_dir}"
    cfg = _cfg("data.source=prepared", f"data.path={prepared}", tok)
    meta = data.read_metadata(str(prepared), tokenizer.load(str(hf_dir)))
    held_out = data.RecordStream(str(prepared), meta, "eval")
    evaluation = data.make_eval_dataset(cfg)  # the eval split's windows, in order
    assert len(evaluation) == (len(held_out) - 1) // 8
    np.testing.assert_array_equal(evaluation[0]["tokens"], held_out[0:8])
    np.testing.assert_array_equal(evaluation[1]["tokens"], held_out[8:16])
    # Batches made ahead by two worker processes are those made on a thread, and resume anywhere.
    train = data.make_dataset(cfg)
    thread, workers = data.BatchIterator(train, 4), data.BatchIterator(train, 4, workers=2)
    expected = [next(thread) for _ in range(6)]
    for batch in expected[:3]:
        np.testing.assert_array_equal(next(workers)["tokens"], batch["tokens"])
    workers.set_state({"next_sample": 18})  # another batch size's position
    np.testing.assert_array_equal(next(workers)["tokens"][:2], expected[4]["tokens"][2:])
    workers.close()
    # data.eval_path: a dataset without an eval split gives its train split.
    plain = tmp_path / "plain"
    prepare.prepare(tokenizer.load(str(hf_dir)), [str(corpus)], str(plain), "text", 0, 1)
    with_eval_path = _cfg(f"data.eval_path={plain}", tok, "train.eval_every_steps=5")
    from_eval_path = data.make_eval_dataset(with_eval_path)
    plain_meta = data.read_metadata(str(plain), tokenizer.load(str(hf_dir)))
    np.testing.assert_array_equal(from_eval_path[0]["tokens"], data.RecordStream(str(plain), plain_meta, "train")[0:8])
    assert data.make_eval_dataset(_cfg()) is None  # stdlib, no data.eval_path
    assert data.make_eval_dataset(_cfg("data.source=prepared", f"data.path={plain}", tok)) is None
    with pytest.raises(DataError, match="needs evaluation data, but the eval split of .* is empty"):
        data.make_eval_dataset(_cfg("data.source=prepared", f"data.path={plain}", tok, "train.eval_every_steps=5"))
    with pytest.raises(ConfigError, match="train.eval_every_steps=5 needs evaluation data"):
        _cfg("train.eval_every_steps=5")


def test_damaged_shards(prepared, hf_dir, tmp_path):
    cfg = _cfg("data.source=prepared", f"data.path={tmp_path / 'ds'}", f"data.tokenizer={hf_dir}")
    shutil.copytree(prepared, tmp_path / "ds")
    shard = tmp_path / "ds" / "train-00001.array_record"
    raw = bytearray(shard.read_bytes())
    raw[100:140] = bytes(40)  # a record's bytes, the file's structure intact: found when read
    shard.write_bytes(bytes(raw))
    source = data.make_source(cfg)
    with pytest.raises(DataError, match=f"{shard}: corrupt \\(Corrupted Riegeli"):
        for i in range(len(source)):
            source[i]
    shard.write_bytes(bytes(raw[: len(raw) // 2]))
    with pytest.raises(DataError, match=f"{shard}: corrupt or truncated"):
        data.make_source(cfg)
    shard.unlink()
    with pytest.raises(DataError, match=f"{shard}: missing"):
        data.make_source(cfg)
    (tmp_path / "ds" / "metadata.json").unlink()
    with pytest.raises(DataError, match="is not a prepared dataset: it has no metadata.json"):
        data.make_source(cfg)


def _marked(mark: str) -> list[int]:
    """The processes whose environment holds `mark`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if mark.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


def test_training_from_a_prepared_dataset_is_killed_and_resumes_bitwise(tmp_path, hf_dir, corpus, capfd):
    """The killed run is a process of its own; `data prepare` and the rerun run in this one (conftest.run_main)."""
    result = run_main(["data", "prepare", "--tokenizer", str(hf_dir), "--input", str(corpus / "*.jsonl"),
                       str(corpus / "c.parquet"), "--out", str(tmp_path / "ds"), "--workers", "2"], capfd, module=True)
    assert result.returncode == 0 and "train: 59 documents" in result.stdout, result.stderr
    run = {"steps": 6, "checkpoint.every_steps": 2, "data.source": "prepared", "data.path": tmp_path / "ds",
           "data.tokenizer": hf_dir}
    mark = uuid.uuid4().hex
    killed = subprocess.run([sys.executable, str(ROOT / "tests" / "faults.py"), "between-steps", "5",
                             *_command(tmp_path / "run", **run, **{"data.workers": 1})], cwd=ROOT,
                            env={**os.environ, "JAX_PLATFORMS": "cpu", "SCALETRAIN_TEST_MARK": mark},
                            capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    before = _losses(tmp_path / "run")
    deadline = time.monotonic() + 10
    while _marked(mark):  # the killed run's data workers follow it
        assert time.monotonic() < deadline, "the killed run's data workers outlived it"
        time.sleep(0.2)
    committed = max(_finished_checkpoints(tmp_path / "run"))
    resumed = run_main(_command(tmp_path / "run", **run), capfd)
    assert resumed.returncode == 0, resumed.stderr
    assert _resumed_step(resumed) == committed < 5
    after = _losses(tmp_path / "run")
    assert len(after) == 6 and after[:5] == before  # steps redone after the resume: the same batches, bit for bit


def test_bad_input_is_one_error_line(tmp_path, hf_dir, prepared, capfd):
    """Each command as the command line runs it (scaletrain.__main__.main), in this process (conftest.run_main)."""
    (tmp_path / "bad.jsonl").write_text('{"body": "x"}\n')
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": ["x"]}), tmp_path / "other.parquet")
    shutil.copytree(prepared, tmp_path / "truncated")
    shard = tmp_path / "truncated" / "train-00000.array_record"
    shard.write_bytes(shard.read_bytes()[:100])
    (tmp_path / "empty").mkdir()

    def prep(*args):
        return ["data", "prepare", "--out", str(tmp_path / f"out{uuid.uuid4().hex}"), *args]

    def train(*sets):
        sets = _command(tmp_path / f"run{uuid.uuid4().hex}", **{"data.tokenizer": hf_dir, "data.source": "prepared",
                                                                 "data.path": prepared, **dict(sets)})
        return ["train", *sets]

    cases = {
        "tokenizer 'missing.json' not found":
            prep("--tokenizer", "missing.json", "--input", str(tmp_path / "bad.jsonl")),
        f"--input '{tmp_path}/*.txtx' matches no files": prep("--tokenizer", "bytes", "--input", f"{tmp_path}/*.txtx"),
        "bad.jsonl:1: expected a JSON object with a string field 'text'":
            prep("--tokenizer", "bytes", "--input", str(tmp_path / "bad.jsonl")),
        "latin1.txt: not UTF-8 text (byte 3)": prep("--tokenizer", "bytes", "--input", str(tmp_path / "latin1.txt")),
        "other.parquet: no column 'text'; its columns are content":
            prep("--tokenizer", "bytes", "--input", str(tmp_path / "other.parquet")),
        f"model.vocab_size=256 is smaller than tokenizer '{hf_dir}''s 300 ids": train(("model.vocab_size", 256)),
        f"'{prepared}' was prepared with tokenizer '{hf_dir}', whose tokens differ from data.tokenizer 'bytes''s":
            train(("data.tokenizer", "bytes")),
        f"{shard}: corrupt or truncated": train(("data.path", tmp_path / "truncated")),
        f"'{tmp_path / 'empty'}' is not a prepared dataset": train(("data.path", tmp_path / "empty")),
    }
    for error, args in cases.items():
        result = run_main(args, capfd, module=True)
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and error in lines[0], \
            result.stderr
        assert "compiled" not in result.stdout


@pytest.mark.parametrize("files, found", [({"empty.txt": ""}, "no documents"),
                                          ({"blank.txt": " \n\t\n", "blank.jsonl": '{"text": "  "}\n\n'},
                                           "2 documents of whitespace alone")])
def test_a_corpus_without_text_is_one_error_line(tmp_path, capsys, files, found):
    """A dataset of separators alone would train on nothing: refused, and nothing is left at --out."""
    from scaletrain.__main__ import main

    for name, text in files.items():
        (tmp_path / name).write_text(text)
    out = tmp_path / "ds"
    assert main(["data", "prepare", "--tokenizer", "bytes", "--input", str(tmp_path / "*"), "--out", str(out),
                 "--workers", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --input: ") and f"no text ({found}); expected files with text" in err, err
    assert err.count("\n") == 1 and not out.exists() and len(list(tmp_path.iterdir())) == len(files)
    (tmp_path / "one.txt").write_text("one document")
    assert main(["data", "prepare", "--tokenizer", "bytes", "--input", str(tmp_path / "one.txt"), "--out", str(out),
                 "--workers", "1", "--eval-fraction", "0.99"]) == 2
    assert capsys.readouterr().err.startswith("error: --eval-fraction 0.99 held out every document (1): the train "
                                              "split would be empty")
