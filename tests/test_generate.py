"""`generate`: the KV-cached decode loop against the full forward pass, sampling, and the command line."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from scaletrain import models as model_lib
from scaletrain.tools.generate import generate_tokens, pick

PROMPT = np.array([256, 72, 101, 108, 108, 111], np.int32)
NEW = 12


def tiny(**overrides):
    # A large init scale makes the logits decisive, so no near-tie can flip an argmax between the two paths.
    fields = dict(vocab_size=259, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, d_ff=128,
                  init_std=0.3, dtype=jnp.float32, qk_norm=True, rope_scaling="llama3", rope_theta=500000.0)
    return model_lib.ModelConfig.from_config(None, **(fields | overrides))


@pytest.fixture(scope="module")
def model():
    cfg = tiny()
    graphdef = model_lib.abstract(cfg)[0]
    return graphdef, model_lib.init_params(cfg, jax.random.PRNGKey(0))


def greedy(graphdef, params, prompt_t, eos=-1, new=NEW):
    """One prompt's greedy continuation and its length."""
    tokens, n = generate_tokens(graphdef, params, jnp.asarray(prompt_t)[None], jax.random.PRNGKey(0), eos, new, 0.0,
                                1.0)
    return np.asarray(tokens[0]), int(n[0])


def full_logits(graphdef, params, tokens_t):
    tokens_bt = jnp.asarray(tokens_t, jnp.int32)[None]
    positions = jnp.arange(tokens_bt.shape[1], dtype=jnp.int32)[None]
    return np.asarray(nnx.merge(graphdef, params)(tokens_bt, positions, jnp.ones_like(tokens_bt))[0])


def test_greedy_is_the_argmax_of_the_full_forward_pass_at_every_step(model):
    graphdef, params = model
    tokens, n = greedy(graphdef, params, PROMPT)
    assert n == NEW
    sequence = np.concatenate([PROMPT, tokens])
    logits = full_logits(graphdef, params, sequence)
    expected = logits[len(PROMPT) - 1: -1].argmax(-1)
    np.testing.assert_array_equal(tokens, expected)
    assert len(set(expected.tolist())) > 1  # a loop that repeats one token would prove little


def test_the_continuation_stops_at_eos(model):
    graphdef, params = model
    tokens, _ = greedy(graphdef, params, PROMPT)
    eos = int(tokens[3])  # pretend the fourth greedy token is the end of the text
    first = int(np.flatnonzero(tokens == eos)[0])
    stopped, n = greedy(graphdef, params, PROMPT, eos)
    assert n == first + 1
    np.testing.assert_array_equal(stopped[: first + 1], tokens[: first + 1])


def test_a_batch_of_prompts_decodes_each_as_alone(model):
    """Rows of a batch are independent: each continues as it would alone, and ends at its own EOS."""
    graphdef, params = model
    prompts = np.stack([PROMPT, PROMPT[::-1], (PROMPT + 7) % 259])
    alone = [greedy(graphdef, params, p)[0] for p in prompts]
    eos = int(alone[1][2])  # the second row's third token ends that row early
    tokens, n = generate_tokens(graphdef, params, jnp.asarray(prompts), jax.random.PRNGKey(0), eos, NEW, 0.0, 1.0)
    for row, want, got_n in zip(np.asarray(tokens), alone, np.asarray(n)):
        ends = np.flatnonzero(want == eos)
        length = int(ends[0]) + 1 if len(ends) else NEW
        assert got_n == length
        np.testing.assert_array_equal(row[:length], want[:length])


def test_sampling_follows_the_seed_and_top_p():
    logits = jnp.asarray([0.0, 3.0, 1.0, 2.9])
    draws = [int(pick(logits, jax.random.PRNGKey(s), 1.0, 1.0)) for s in range(200)]
    assert set(draws) == {0, 1, 2, 3}
    assert draws == [int(pick(logits, jax.random.PRNGKey(s), 1.0, 1.0)) for s in range(200)]
    # top_p keeps the smallest set of tokens whose probabilities reach it: here tokens 1 and 3 (0.48 + 0.43).
    nucleus = {int(pick(logits, jax.random.PRNGKey(s), 1.0, 0.8)) for s in range(200)}
    assert nucleus == {1, 3}
    assert {int(pick(logits, jax.random.PRNGKey(s), 5.0, 1e-6)) for s in range(50)} == {1}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A tiny random Hugging Face Llama (no tokenizer files: the run gets the byte tokenizer) and its run
    directory made by `convert from-hf`."""
    import torch
    import transformers

    from scaletrain.__main__ import main

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    hf_model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in hf_model.parameters():  # far from the initialisation: decisive logits
            p.copy_(1 + 0.2 * torch.randn_like(p) if p.ndim == 1 else 0.3 * torch.randn_like(p))
    root = tmp_path_factory.mktemp("generate")
    hf_model.save_pretrained(root / "hf")
    assert main(["convert", "from-hf", "--hf-dir", str(root / "hf"), "--out", str(root / "run")]) == 0
    return hf_model, root / "run"


def test_greedy_equals_transformers_generate(converted):
    import torch

    from scaletrain.store.checkpoint import restore_params
    from scaletrain.tools import inference

    hf_model, run = converted
    cfg = inference.load_config(run, ["model.dtype=float32"])
    setup = inference.one_device_setup(cfg)
    _, params = restore_params(str(run), setup.abstract_state.params)
    tokens, n = greedy(model_lib.abstract(setup.model_cfg)[0], params, PROMPT)
    with torch.no_grad():
        expected = hf_model.generate(torch.tensor(PROMPT[None], dtype=torch.long), max_new_tokens=NEW,
                                     do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(PROMPT):].numpy()
    assert n == NEW
    np.testing.assert_array_equal(tokens, expected)


def test_the_command_continues_a_prompt(converted, capsys):
    from scaletrain.__main__ import main

    _, run = converted
    assert main(["generate", "--run-dir", str(run), "--prompt", "Hello", "--max-new-tokens", "5"]) == 0
    greedy = capsys.readouterr().out
    assert greedy.startswith("Hello")
    texts = set()
    for norm in ("standard", "fused"):  # FlashNorm serves decoding: the same text in fp32
        assert main(["generate", "--run-dir", str(run), "--prompt", "Hello", "--max-new-tokens", "5",
                     "--set", f"model.norm={norm}", "--set", "model.dtype=float32"]) == 0
        texts.add(capsys.readouterr().out)
    assert len(texts) == 1
    assert main(["generate", "--run-dir", str(run), "--prompt", "Hello", "--max-new-tokens", "5",
                 "--temperature", "1", "--seed", "3"]) == 0
    assert capsys.readouterr().out.startswith("Hello")


@pytest.mark.parametrize("args, says", [
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--temperature", "-1"], "--temperature must be >= 0"),
    (["--top-p", "0"], "--top-p must be in (0, 1]"),
])
def test_bad_flags_are_one_error_line(converted, capsys, args, says):
    from scaletrain.__main__ import main

    _, run = converted
    assert main(["generate", "--run-dir", str(run), "--prompt", "x", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and says in err and err.count("\n") == 1


def test_a_folder_that_is_no_run_is_one_error_line(tmp_path, capsys):
    from scaletrain.__main__ import main

    assert main(["generate", "--run-dir", str(tmp_path), "--prompt", "x"]) == 2
    assert "is not a run directory" in capsys.readouterr().err
