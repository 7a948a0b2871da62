import json

import numpy as np
import pytest

from scaletrain import config
from scaletrain.data import loader as data
from scaletrain.data import tokenizer
from scaletrain.errors import ConfigError, DataError
from scaletrain.parallel import mesh


def test_packing_separators_positions_and_mask():
    tok = tokenizer.load("bytes")
    stream = np.concatenate([tok.document(d) for d in ("abc", "de", "fghij")])  # 5 + 4 + 7 = 16 tokens
    src = data.PackedSource(stream, 8, tok.eos_id)
    assert len(src) == 1
    ex = src[0]
    np.testing.assert_array_equal(ex["tokens"], stream[:8])
    np.testing.assert_array_equal(ex["targets"], stream[1:9])
    # tokens: BOS a b c EOS BOS d e
    np.testing.assert_array_equal(ex["segment_ids"], [2, 2, 2, 2, 2, 3, 3, 3])
    np.testing.assert_array_equal(ex["positions"], [0, 1, 2, 3, 4, 0, 1, 2])
    # the EOS -> next BOS target is masked
    np.testing.assert_array_equal(ex["loss_mask"], [1, 1, 1, 1, 0, 1, 1, 1])
    assert tok.decode(ex["tokens"]) == "abcde"


def test_order_is_a_pure_function_of_seed_and_index():
    cfg = config.load(None, ["data.source=synthetic", "data.seq_len=16", "train.global_batch=4"])
    a, b = data.make_dataset(cfg), data.make_dataset(cfg)
    for i in (0, 5, 123456):
        np.testing.assert_array_equal(a[i]["tokens"], b[i]["tokens"])
    other = data.make_dataset(config.load(None, ["data.source=synthetic", "data.seq_len=16", "seed=1"]))
    assert not np.array_equal(a[0]["tokens"], other[0]["tokens"])


def test_processes_read_disjoint_rows_that_make_up_the_global_batch(stdlib_dataset):
    whole = data.BatchIterator(stdlib_dataset, global_batch=8)
    parts = [data.BatchIterator(stdlib_dataset, global_batch=8, rows=np.arange(4) + 4 * p) for p in (0, 1)]
    for _ in range(2):
        full = next(whole)
        halves = [next(p) for p in parts]
        np.testing.assert_array_equal(np.concatenate([h["tokens"] for h in halves]), full["tokens"])


def test_process_rows_follow_the_batch_sharding():
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    m = mesh.make_mesh(config.load(None, ["mesh.data=2", "mesh.fsdp=4"]).mesh)
    for spec in (P(("data", "fsdp")), P("data"), P()):  # sharded, partly replicated, replicated
        np.testing.assert_array_equal(data.process_rows(NamedSharding(m, spec), 16), np.arange(16))


def test_iterator_state_resumes_exactly_even_with_another_batch_size(stdlib_dataset):
    it = data.BatchIterator(stdlib_dataset, global_batch=4)
    next(it)
    state = it.get_state()
    assert state == {"next_sample": 4}
    expected = next(it)
    fresh = data.BatchIterator(stdlib_dataset, global_batch=4)
    fresh.set_state(state)
    np.testing.assert_array_equal(next(fresh)["tokens"], expected["tokens"])
    bigger = data.BatchIterator(stdlib_dataset, global_batch=8)
    bigger.set_state(state)
    np.testing.assert_array_equal(next(bigger)["tokens"][:4], expected["tokens"])


def test_samples_are_shuffled(stdlib_dataset):
    source = data.make_source(config.load(None, ["data.seq_len=32"]))
    firsts = [stdlib_dataset[i]["tokens"].tolist() for i in range(8)]
    assert firsts != [source[i]["tokens"].tolist() for i in range(8)]


def test_epochs_reshuffle(stdlib_dataset):
    source = data.make_source(config.load(None, ["data.seq_len=32"]))
    n = len(source)
    first = [stdlib_dataset[i]["tokens"][:4].tolist() for i in range(3)]
    second = [stdlib_dataset[n + i]["tokens"][:4].tolist() for i in range(3)]
    assert first != second


def test_stdlib_corpus_is_large_and_byte_level():
    source = data.make_source(config.load(None, ["data.seq_len=256"]))
    assert len(source) > 10_000  # millions of tokens
    ex = source[0]
    assert ex["tokens"].max() < tokenizer.VOCAB_SIZE


def test_a_vocabulary_smaller_than_the_tokenizers_is_refused_when_the_data_opens():
    cfg = config.load(None, ["model.vocab_size=200"])  # reading the config needs no tokenizer
    with pytest.raises(ConfigError, match="model.vocab_size=200 is smaller than the byte tokenizer's"):
        data.make_source(cfg)


def test_text_and_jsonl_files(tmp_path):
    (tmp_path / "a.txt").write_text("hello world " * 10)
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps({"text": f"doc {i} " * 5}) for i in range(5)))
    docs = data.file_documents(str(tmp_path), "text")
    assert len(docs) == 6 and docs[0].startswith("hello")
    cfg = config.load(None, ["data.source=files", f"data.path={tmp_path}", "data.seq_len=16"])
    assert len(data.make_source(cfg)) > 5


def test_recursive_globs_match_any_number_of_folders(tmp_path):
    for name in ("top.txt", "a/mid.txt", "a/b/deep.txt", "a/b/deep.md"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(name)

    def found(pattern):
        return data.file_documents(f"{tmp_path}/{pattern}", "text")
    assert found("**/*.txt") == ["a/b/deep.txt", "a/mid.txt", "top.txt"]
    assert found("a/**/deep.*") == ["a/b/deep.md", "a/b/deep.txt"]
    assert found("**/b/*.txt") == ["a/b/deep.txt"]
    assert found("a/**") == ["a/b/deep.md", "a/b/deep.txt", "a/mid.txt"]
    with pytest.raises(DataError, match="matches no files"):
        found("missing/**/*.txt")


def test_files_in_a_bucket_read_as_local_ones(tmp_path, bucket):
    from etils import epath

    for name, text in {"a.txt": "hello world " * 10, "sub/b.jsonl": json.dumps({"text": "doc"}),
                       "c.md": "not read from a directory"}.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
        epath.Path(f"{bucket}/corpus/{name}").write_text(text)
    local, remote = data.file_documents(str(tmp_path), "text"), data.file_documents(f"{bucket}/corpus", "text")
    assert remote == local and len(local) == 2
    assert data.file_documents(f"{bucket}/corpus/*.txt", "text") == data.file_documents(f"{tmp_path}/*.txt", "text")
    assert data.file_documents(f"{bucket}/corpus/sub/b.jsonl", "text") == ["doc"]
    assert data.file_documents(f"{bucket}/corpus/**/*.jsonl", "text") == ["doc"]
    with pytest.raises(DataError, match="matches no files"):
        data.file_documents(f"{bucket}/corpus/*.parquet", "text")


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(DataError, match="matches no files"):
        data.file_documents(str(tmp_path / "nothing*.txt"), "text")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"body": "x"}\n')
    with pytest.raises(DataError, match="bad.jsonl:1: expected a JSON object with a string field 'text'"):
        data.file_documents(str(bad), "text")
    bad.write_bytes(b'{"text": "\xff\xfe"}\n')
    with pytest.raises(DataError, match="not UTF-8"):
        data.file_documents(str(bad), "text")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.txt").write_text("")
    cfg = config.load(None, ["data.source=files", f"data.path={tmp_path / 'empty'}"])
    with pytest.raises(DataError, match="fewer than one sequence"):
        data.make_source(cfg)
