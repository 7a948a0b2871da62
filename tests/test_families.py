"""Model families behind one seam (scaletrain/models/family.py): each registered family's Hugging Face tables
cover every parameter its decoder has, for every architecture it claims; a family defined and registered here,
outside scaletrain, trains and evaluates through trainer.build with no other edit; model.family is validated."""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from scaletrain import config, models
from scaletrain.data import loader as data
from scaletrain.errors import ConfigError, UserError
from scaletrain.models import llama
from scaletrain.models.family import Family
from scaletrain.models.gpt_oss import hf as gpt_oss_hf
from scaletrain.models.layers import param, project
from scaletrain.models.transformer import Block, Decoder
from scaletrain.planner import roofline
from scaletrain.tools import hf
from scaletrain.train import trainer
from tests import equivalence
from tests.conftest import tiny_overrides

STEPS = 3
TINY = dict(vocab_size=64, d_model=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16, d_ff=64)
# A family's own keys on top of TINY (each variant's parameters joined): its features on.
FAMILY_KEYS = {"deepseek": tuple(dict(family="deepseek", num_layers=3, num_heads=2, num_kv_heads=2, kv_lora_rank=8,
                                      rope_head_dim=8, q_lora_rank=q, first_dense_layers=1, shared_experts=1,
                                      router_score="sigmoid", router_correction_bias=True,
                                      mtp_depth=1) for q in (0, 8)),
               # GPT-OSS's pieces on (Q and K not normalised: no such rows)
               "gpt_oss": (dict(gpt_oss_hf.FEATURES, qk_norm=False),),
               "gemma": (dict(family="gemma", norm_plus_one=True, embed_scale=True, mlp_activation="gelu_tanh"),)}


def _leaf_paths(tree: dict, prefix=()) -> set[tuple[str, ...]]:
    return set().union(*(_leaf_paths(v, prefix + (k,)) if isinstance(v, dict) else {prefix + (k,)}
                         for k, v in tree.items()))


@pytest.mark.parametrize("name, arch", [(f.name, a) for f in models.FAMILIES.values() for a in f.architectures])
def test_each_architectures_table_covers_its_decoders_parameters(name, arch):
    """The parameters of the family's decoder - with and without QK norms, untied - are exactly the table's
    rows: none without a Hugging Face tensor, no row without a parameter."""
    family = models.FAMILIES[name]
    table = {path for _, path, _ in family.architectures[arch].tensors}
    params = set()
    for qk_norm, keys in itertools.product((False, True), FAMILY_KEYS.get(name, ({},))):
        model_cfg = models.ModelConfig.from_config(TINY | dict(qk_norm=qk_norm, num_experts=4 * family.experts,
                                                               moe_every=1) | keys)
        assert models.family_of(model_cfg) is family
        params |= _leaf_paths(models.abstract(model_cfg)[1])
    assert params == table


def test_every_family_exports_to_an_architecture_it_claims():
    for family, experts, qk_norm in itertools.product(models.FAMILIES.values(), (0, 4), (False, True)):
        if family.export is None or bool(experts) != family.experts:
            continue
        own = [f"model.{k}={v}" for k, v in FAMILY_KEYS.get(family.name, ({},))[0].items()]
        if own and qk_norm:  # a family whose attention has no QK norms
            continue
        m = config.load(None, [f"model.num_experts={experts}", f"model.qk_norm={qk_norm}",
                               "model.qk_norm_eps=1e-5", *own]).model
        assert family.export(m) in family.architectures
        assert hf.hf_config(m)["architectures"] == [family.export(m)]


# --- a toy family, defined here: a Llama whose MLP is a GELU feed-forward (two matmuls, no gate) --------------

class GeluMLP(nnx.Module):
    def __init__(self, cfg, rngs: nnx.Rngs):
        self.w_in = param(rngs, (cfg.d_model, cfg.d_ff), ("embed", "mlp"), cfg.param_dtype, cfg.init_std)
        self.w_out = param(rngs, (cfg.d_ff, cfg.d_model), ("mlp", "embed"), cfg.param_dtype, cfg.out_std)

    def __call__(self, x_btd, norm, one_matmul: bool = True):
        return project(jax.nn.gelu(norm.project(x_btd, self.w_in[...], ("embed", "mlp"))), self.w_out[...])


class GeluBlock(Block):
    @staticmethod
    def feed_forward(cfg, rngs):
        return GeluMLP(cfg, rngs)


class Toy(Decoder):
    @staticmethod
    def unit(cfg, rngs):
        return GeluBlock(cfg, rngs)


def toy_matmuls(m, tensor: int = 1, expert: int = 1):
    return llama.attention_matmuls(m, tensor) | {
        "gate_up": roofline.Matmul.dense(1, m.d_model, m.d_ff / tensor),
        "down": roofline.Matmul.dense(1, m.d_ff / tensor, m.d_model)}


TOY = Family(name="toy", decoder=Toy, matmuls=toy_matmuls)


@pytest.fixture
def toy():
    models.register(TOY)
    try:
        yield TOY
    finally:
        models.unregister(TOY.name)


def test_a_family_registered_from_outside_trains_and_evaluates(toy):
    cfg = config.load(None, tiny_overrides("unused", steps=STEPS) + ["model.family=toy", "mesh.fsdp=2",
                                                                     "mesh.tensor=2"])
    assert models.family_of(cfg.model) is toy
    setup = trainer.build(cfg, jax.devices()[:4])
    params = setup.abstract_state.params["layers"]["mlp"]
    assert set(params) == {"w_in", "w_out"} and params["w_in"].shape == (2, 64, 128)
    it = data.BatchIterator(data.make_dataset(config.load(None, ["data.seq_len=32"])), global_batch=8)
    batches = [setup.put_batch(next(it)) for _ in range(STEPS + 1)]
    # Compiled as tests/equivalence.py compiles the step (LLVM's optimisations off: the same program, in about half
    # the compile time).
    key, options = jax.random.PRNGKey(0), equivalence.COMPILER_OPTIONS
    state = setup.init.lower(key).compile(options)(key)
    step = setup.step.lower(*setup.abstract_args()).compile(options)
    losses = []
    for batch in batches[:STEPS]:
        state, metrics = step(state, batch, setup.loss_ceiling())
        losses.append(float(metrics["loss"]))
    assert all(map(math.isfinite, losses)) and losses[-1] < losses[0]
    eval_step = setup.eval_step.lower(setup.abstract_state.params, setup.abstract_batch(), None).compile(options)
    total, tokens = eval_step(state.params, batches[-1], None)
    assert np.isfinite(float(total)) and float(tokens) > 0
    # The planner reads its inventory; to-hf has nothing to export it as.
    assert roofline.matmuls(cfg.model)["gate_up"].outputs == cfg.model.d_ff
    with pytest.raises(UserError, match="model family toy has no Hugging Face architecture"):
        hf.hf_config(cfg.model)
    # Its decoder is its own: the same weights but for the MLP, a different function from llama's.
    tokens_bt = jnp.arange(8)[None] % 64
    llama_cfg = models.ModelConfig.from_config(TINY, dtype="float32")
    toy_cfg = models.ModelConfig.from_config(TINY, dtype="float32", family="toy")
    run = [nnx.merge(models.abstract(c)[0], models.init_params(c, jax.random.PRNGKey(0)))
           for c in (llama_cfg, toy_cfg)]
    outs = [np.asarray(m(tokens_bt, jnp.arange(8)[None], jnp.ones_like(tokens_bt))) for m in run]
    assert not np.allclose(*outs)


@pytest.mark.parametrize("overrides, message", [
    (["model.family=nope"], "model.family must be auto or one of llama, mixtral"),
    (["model.family=llama", "model.num_experts=4"], "model.family=llama has no mixture of experts"),
    (["model.family=mixtral"], "model.family=mixtral needs mixture of experts"),
])
def test_family_key_is_validated(overrides, message):
    cfg = config.load(None, overrides)  # the registry, above the config, checks it
    with pytest.raises(ConfigError, match=message):
        models.family_of(cfg.model)


def test_auto_picks_the_family_from_the_experts():
    assert models.family_name(config.load(None, []).model) == "llama"
    assert models.family_name(config.load(None, ["model.num_experts=4"]).model) == "mixtral"
    assert isinstance(models.Llama, type) and models.FAMILIES["mixtral"].decoder.__mro__[1] is models.Llama
