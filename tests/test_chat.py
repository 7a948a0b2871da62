"""Chat templates (scaletrain/data/chat.py) against transformers: the rendered text and tokens of apply_chat_template
for three templates (ChatML, Llama 3's headers with the BOS the template writes, Qwen2.5's default system prompt),
with and without the generation prompt, over multi-turn conversations; the assistant masks - with {% generation %}
markers, transformers' return_assistant_tokens_mask; without, the prefix method, checked against the token deltas
of prefixes rendered by transformers; and the refusals, each one `error:` line from the command line."""

import pytest

from scaletrain.data import chat, tokenizer
from scaletrain.errors import DataError
from tests import chat_fixtures as fx
from tests.conftest import run_main

CONVERSATIONS = fx.conversations(8)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return fx.write_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def hf(folder):
    return fx.hf_tokenizer(folder)


@pytest.fixture(scope="module")
def templates(folder, tmp_path_factory):
    """(name, marked) -> (the template's text, scaletrain's ChatTemplate of it, loaded from a .jinja file)."""
    root = tmp_path_factory.mktemp("templates")
    made = {}
    for name in fx.TEMPLATES:
        for marked in (False, True):
            path = root / f"{name}{'_marked' * marked}.jinja"
            path.write_text(fx.template(name, marked))
            made[name, marked] = path.read_text(), chat.load(str(path), str(folder))
    return made


def _ids(hf, messages, text, **kwargs) -> list[int]:
    out = hf.apply_chat_template(messages, chat_template=text, tokenize=True, **kwargs)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.mark.parametrize("name", fx.TEMPLATES)
@pytest.mark.parametrize("marked", [False, True])
def test_text_and_tokens_equal_transformers(name, marked, templates, hf):
    text, template = templates[name, marked]
    for messages in CONVERSATIONS:
        for prompt in (False, True):
            rendered, _ = template.render(messages, "row", add_generation_prompt=prompt)
            assert rendered == hf.apply_chat_template(messages, chat_template=text, tokenize=False,
                                                      add_generation_prompt=prompt)
            assert list(template.tokens(messages, "row", add_generation_prompt=prompt)) == _ids(
                hf, messages, text, add_generation_prompt=prompt)
    if name == "llama3":  # the BOS the template writes, once; none is added beyond it
        assert template.tokens(CONVERSATIONS[0], "row")[:2].tolist() == [hf.convert_tokens_to_ids(fx.BOS),
                                                                         hf.convert_tokens_to_ids(
                                                                             "<|start_header_id|>")]
    if name == "qwen25":  # the default system prompt, where the conversation has none
        assert "You are a helpful assistant." in template.render(CONVERSATIONS[0], "row")[0]
        assert "You are a helpful assistant." not in template.render(CONVERSATIONS[1], "row")[0]


@pytest.mark.parametrize("name", fx.TEMPLATES)
def test_generation_markers_give_transformers_assistant_masks(name, templates, hf):
    text, template = templates[name, True]
    assert template.marked
    for messages in CONVERSATIONS:
        ids, trained = template.conversation(messages, "row", assistant=True)
        out = hf.apply_chat_template(messages, chat_template=text, tokenize=True, return_dict=True,
                                     return_assistant_tokens_mask=True)
        assert list(ids) == list(out["input_ids"])
        assert trained.astype(int).tolist() == list(out["assistant_masks"])


def test_a_token_straddling_a_marked_edge_counts_in(folder, hf, tmp_path):
    """The role glued to the answer: "assistant" + "he sky" tokenizes with "the" across the marked span's start."""
    text = ("{% for m in messages %}{{ m['role'] }}{% if m['role'] == 'assistant' %}{% generation %}"
            "{{ m['content'] }}{% endgeneration %}{% else %}{{ m['content'] + '\\n' }}{% endif %}{% endfor %}")
    (tmp_path / "glued.jinja").write_text(text)
    messages = [{"role": "user", "content": "the"}, {"role": "assistant", "content": "he sky"}]
    ids, trained = chat.load(str(tmp_path / "glued.jinja"), str(folder)).conversation(messages, "row", True)
    out = hf.apply_chat_template(messages, chat_template=text, tokenize=True, return_dict=True,
                                 return_assistant_tokens_mask=True)
    assert trained.astype(int).tolist() == list(out["assistant_masks"])
    assert [hf.decode([int(i)]) for i, t in zip(ids, trained) if t] == ["the", " sky"]


def _token_deltas(hf, messages, text) -> list[int]:
    """The prefix method computed on tokens, through transformers alone: assistant message i trains the tokens
    render(messages[:i+1]) adds to render(messages[:i], add_generation_prompt=True)."""
    full = _ids(hf, messages, text)
    mask = [0] * len(full)
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            start = len(_ids(hf, messages[:i], text, add_generation_prompt=True))
            end = len(_ids(hf, messages[:i + 1], text))
            assert _ids(hf, messages[:i + 1], text) == full[:end]
            mask[start:end] = [1] * (end - start)
    return mask


@pytest.mark.parametrize("name", fx.TEMPLATES)
def test_without_markers_the_prefix_method_finds_the_assistant_tokens(name, templates, hf):
    text, template = templates[name, False]
    assert not template.marked
    for messages in CONVERSATIONS:
        ids, trained = template.conversation(messages, "row", assistant=True)
        assert list(ids) == _ids(hf, messages, text)
        assert trained.astype(int).tolist() == _token_deltas(hf, messages, text)


def test_the_end_of_turn_trains_and_the_assistant_header_does_not(templates, hf):
    _, template = templates["chatml", False]
    messages = [{"role": "user", "content": "why is the sky blue?"},
                {"role": "assistant", "content": "because light scatters."},
                {"role": "user", "content": "hello world"}, {"role": "assistant", "content": "hello"}]
    ids, trained = template.conversation(messages, "row", assistant=True)
    pieces = [hf.decode([int(i)]) for i in ids]
    starts = [k for k, piece in enumerate(pieces) if piece == "<|im_start|>"]
    ends = [k for k, piece in enumerate(pieces) if piece == "<|im_end|>"]
    for turn, (start, end) in enumerate(zip(starts, ends)):
        assistant = turn % 2 == 1
        header = "".join(pieces[start:end]).index("\n")  # <|im_start|>assistant\n: the header's characters
        header_tokens = next(k for k in range(start, end) if len("".join(pieces[start:k + 1])) > header)
        assert not trained[start:header_tokens + 1].any()  # the header, never
        assert trained[header_tokens + 1:end + 1].all() == assistant  # the answer and its <|im_end|>
        assert trained[end] == assistant
    assert "".join(p for p, t in zip(pieces, trained) if t) == "because light scatters.<|im_end|>\nhello<|im_end|>\n"


def test_a_template_that_is_not_prefix_stable_is_refused(folder, tmp_path):
    path = tmp_path / "thinking.jinja"
    path.write_text(fx.NOT_PREFIX_STABLE)
    template = chat.load(str(path), str(folder))
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hmm</think>hello"},
                {"role": "user", "content": "why?"}, {"role": "assistant", "content": "because"}]
    with pytest.raises(DataError, match=r"row 7: .* add \{% generation %\} markers .* or set data.chat_template"):
        template.conversation(messages, "row 7", assistant=True)
    ids, trained = template.conversation(messages, "row 7", assistant=False)  # data.loss_on=all needs no mask
    assert len(ids) and not trained.any()


def test_the_tokenizers_own_template_and_its_special_tokens(folder):
    tok = tokenizer.load(str(folder))
    assert tok.special_tokens == {"bos_token": fx.BOS, "eos_token": fx.EOS}
    assert chat.load("", str(folder)).text == tok.chat_template == fx.template("chatml", False)
    # Special tokens in a document stay text; in a rendered template they are the tokens.
    assert len(tok.encode("<|im_end|>")) > 1
    assert len(tok.encode_rendered("<|im_end|>")[0]) == 1


def _one_error_line(result, *fragments):
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_bad_rows_are_one_error_line(folder, tmp_path, capfd):
    """Through the command line: `data prepare` and training from files."""
    (tmp_path / "thinking.jinja").write_text(fx.NOT_PREFIX_STABLE)
    no_answer = fx.write_jsonl(tmp_path / "no_answer.jsonl", [{"messages": CONVERSATIONS[0]},
                                                             {"messages": [{"role": "user", "content": "hi"}]}])
    unstable = fx.write_jsonl(tmp_path / "unstable.jsonl", [{"messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hm</think>hello"},
        {"role": "user", "content": "why?"}, {"role": "assistant", "content": "because"}]}])
    empty = fx.write_jsonl(tmp_path / "empty.jsonl", [{"prompt": "a", "chosen": "b", "rejected": "c"},
                                                     {"prompt": "a", "chosen": "b", "rejected": ""}])
    refused = fx.write_jsonl(tmp_path / "refused.jsonl", [{"messages": [{"role": "tool", "content": "x"}]}])

    def prepare(path, data_format, *extra):
        return run_main(["data", "prepare", "--tokenizer", str(folder), "--input", str(path), "--format", data_format,
                         "--out", str(tmp_path / f"out_{path.stem}"), "--workers", "1", *extra], capfd, module=True)

    _one_error_line(prepare(no_answer, "chat"), f"{no_answer}:2: the conversation has no assistant message")
    _one_error_line(prepare(unstable, "chat", "--chat-template", str(tmp_path / "thinking.jinja")),
                    f"{unstable}:1: ", "add {% generation %} markers", "data.chat_template")
    _one_error_line(prepare(empty, "preference"), f"{empty}:2: an empty completion")
    qwen = tmp_path / "qwen.jinja"
    qwen.write_text(fx.template("qwen25", False))
    _one_error_line(prepare(refused, "chat", "--chat-template", str(qwen)),
                    f"{refused}:1: the chat template ({qwen}) refused it: unknown role tool")
    _one_error_line(prepare(empty, "chat"), f"{empty}:1: 'messages' must be a non-empty list of messages")
    assert not list(tmp_path.glob("out_*"))  # nothing written
    # Training from the files: the same line, before anything compiles.
    train = run_main(["--config", "configs/llama_tiny.yaml", "--set", f"run_dir={tmp_path / 'run'}",
                      "--set", "data.source=files", "--set", f"data.path={no_answer}", "--set", "data.format=chat",
                      "--set", f"data.tokenizer={folder}", "--set", "model.vocab_size=512"], capfd)
    _one_error_line(train, f"{no_answer}:2: the conversation has no assistant message")
    assert "compiled" not in train.stdout
