"""What the post-training tests share: a byte-level BPE tokenizer trained here in a second (with the special tokens
of ChatML and of Llama 3's chat format), written as tokenizer.json + tokenizer_config.json so that scaletrain and
transformers load the same files; three chat templates in the styles of the models that use them, each with and
without {% generation %} markers; and conversations to render with them."""

import json
from pathlib import Path

import numpy as np

WORDS = ("the model answers a question about data while seven wizards quietly hex jovial kings; tokens, masks and "
         "packing decide what trains. hello world: why is the sky blue? because light scatters.").split()
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eot_id|>"]
BOS, EOS = "<|begin_of_text|>", "<|endoftext|>"

# Each template's assistant text is between GEN and END: {% generation %} markers, or nothing.
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}GEN{{ message['content'] + '<|im_end|>' }}END{{ '\\n' }}"
    "{% else %}{{ message['content'] + '<|im_end|>' + '\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
LLAMA3 = (
    "{{- bos_token }}\n"
    "{%- for message in messages %}\n"
    "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}\n"
    "    {%- if message['role'] == 'assistant' %}\n"
    "        GEN{{- message['content'] | trim + '<|eot_id|>' }}END\n"
    "    {%- else %}\n"
    "        {{- message['content'] | trim + '<|eot_id|>' }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n")
QWEN25 = (  # a default system prompt when the conversation brings none
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "{%- else %}\n"
    "    {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == 'assistant' %}\n"
    "        {{- '<|im_start|>assistant\\n' }}GEN{{- message.content + '<|im_end|>' }}END{{- '\\n' }}\n"
    "    {%- elif message.role != 'system' %}\n"
    "        {{- raise_exception('unknown role ' + message.role) }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n")
TEMPLATES = {"chatml": CHATML, "llama3": LLAMA3, "qwen25": QWEN25}
# Earlier assistant turns lose their thinking (as Qwen3's template drops it): a conversation's beginnings do not
# render as beginnings of it.
NOT_PREFIX_STABLE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' and not loop.last %}{{ message['content'].split('</think>')[-1] }}"
    "{% else %}{{ message['content'] }}{% endif %}{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def template(name: str, marked: bool) -> str:
    text = TEMPLATES[name]
    return text.replace("GEN", "{% generation %}" if marked else "").replace("END", "{% endgeneration %}" if marked
                                                                              else "")


def sentence(rng: np.random.RandomState, low: int = 3, high: int = 12) -> str:
    return " ".join(rng.choice(WORDS, rng.randint(low, high)))


def conversation(rng: np.random.RandomState, turns: int, system: bool) -> list[dict]:
    messages = [{"role": "system", "content": sentence(rng)}] if system else []
    for _ in range(turns):
        messages += [{"role": "user", "content": sentence(rng)}, {"role": "assistant", "content": sentence(rng)}]
    return messages


def conversations(count: int, seed: int = 0, turns: tuple[int, int] = (1, 3)) -> list[list[dict]]:
    rng = np.random.RandomState(seed)
    return [conversation(rng, rng.randint(*turns), system=bool(i % 2)) for i in range(count)]


def write_tokenizer(folder: Path, chat_template: str | None = CHATML.replace("GEN", "").replace("END", "")) -> Path:
    """A byte-level BPE of about 400 ids (the special tokens included) in `folder`; its tokenizer_config.json names
    BOS, EOS and (when given) the chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    rng = np.random.RandomState(0)
    texts = [sentence(rng, 5, 40) for _ in range(200)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def hf_tokenizer(folder: Path):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(folder))


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path
