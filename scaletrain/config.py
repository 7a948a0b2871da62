"""The config schema: every default once, YAML files over it, `--set key=value` over those.

A config is an `ml_collections.ConfigDict` whose every key is declared in `defaults()`. Values keep the
type of their default (ints widen to floats; `None` defaults name their type in `_NULLABLE`), so a typo or a
wrong type costs one `error:` line before anything is compiled.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import math
from pathlib import Path
from typing import Any, Iterable

import ml_collections
import yaml
from etils import epath

from scaletrain import config_bounds, config_deepseek, config_gemma, config_gpt_oss, config_moe, config_window, remat
from scaletrain.errors import ConfigError

MESH_AXES = ("data", "fsdp", "expert", "pipeline", "context", "tensor")
# model.norm: how RMSNorm meets the matmul after it; model.norm_weights: whether the norms carry their gains
# (docs/flashnorm.md). Here rather than in the model, so that checking a config never imports Flax.
ATTENTIONS = ("xla", "flash")
# model.context_attention: how attention meets a sequence split over mesh.context (docs/context.md).
CONTEXT_ATTENTIONS = ("allgather", "ring")
NORMS = ("standard", "deferred", "fused")
NORM_WEIGHTS = ("standard", "folded", "weightless")
# model.quantization: the dtype of the chosen matmuls' operands; model.quantized_matmuls: which groups of matmuls,
# comma-separated (docs/quantization.md). The output head is left out by default: its logits feed a softmax over
# the whole vocabulary, where rounding costs the most loss for the least time (one matmul a step).
QUANTIZATIONS = ("none", "int8", "fp8")
QUANTIZATION_SCALES = ("channel", "tensor")
MATMUL_GROUPS = ("attention", "mlp", "experts", "output")
# sharding.context_layout: how a sequence split over mesh.context is laid out (parallel/context.py).
CONTEXT_LAYOUTS = ("zigzag", "contiguous")
DEFAULT_QUANTIZED = "attention,mlp,experts"
# data.format: what a row of data.path holds (docs/post-training.md). `text`: documents, packed into a stream.
DATA_FORMATS = ("text", "chat", "prompt_completion", "preference")


def defaults() -> ml_collections.ConfigDict:
    """The schema: each key, its type (that of its default) and its default. docs/config.md explains each."""
    return ml_collections.ConfigDict(
        {
            "run_dir": "runs/default",
            "seed": 0,
            "steps": 100,
            "model": {
                "vocab_size": 384,
                "d_model": 128,
                "num_layers": 2,
                "num_heads": 4,
                "num_kv_heads": 2,
                "head_dim": 32,
                "d_ff": 512,
                "norm_eps": 1e-5,
                "rope_theta": 10000.0,
                "rope_scaling": "none",
                "rope_scaling_factor": 8.0,
                "rope_low_freq_factor": 1.0,
                "rope_high_freq_factor": 4.0,
                "rope_original_max_position": 8192,
                "tie_embeddings": False,
                "init_std": 0.02,
                "param_dtype": "float32",
                "dtype": "bfloat16",
                "attention": "xla",
                "attention_block": 0,
                "context_attention": "allgather",
                "logits_block": 0,
                "norm": "standard",
                "norm_weights": "standard",
                "qk_norm": False,
                "qk_norm_eps": 1e-6,
                "norm_cancellation": False,
                "num_experts": 0,
                "experts_per_token": 2,
                "moe_d_ff": 0,
                "moe_every": 1,
                "capacity_factor": 0.0,
                "moe_matmul": "auto",
                "router_aux_loss": 0.01,
                "router_z_loss": 0.001,
                "family": "auto",
                "quantization": "none",
                "quantization_scale": "channel",
                "quantized_matmuls": DEFAULT_QUANTIZED,
                **config_gpt_oss.DEFAULTS, **config_deepseek.DEFAULTS,  # GPT-OSS's pieces; YaRN, DeepSeek-V3's
                **config_window.DEFAULTS, **config_gemma.DEFAULTS,  # sliding-window layers; Gemma's pieces
            },
            "data": {
                "source": "stdlib",
                "path": "",
                "jsonl_field": "text",
                "seq_len": 256,
                "tokenizer": "bytes",
                "eval_path": "",
                "workers": 0,
                "format": "text",
                "chat_template": "",
                "loss_on": "auto",
            },
            "remat": {
                "policy": "none",
                "custom": {name: "remat" for name in remat.NAMES},
            },
            "train": {
                "global_batch": 16,
                "grad_accum_steps": 1,
                "log_every_steps": 1,
                "on_nonfinite": "skip",
                "profile_start": 0,
                "profile_steps": 0,
                "eval_every_steps": 0,
                "eval_batches": 4,
                "objective": "lm",
                "hang": {"factor": 20.0, "seconds": 600.0, "exit": False, "straggler": 0.25},
                "spike": {"action": "warn", "factor": 2.0, "window": 100, "limit": 3},
            },
            "optim": {
                "learning_rate": 3e-3,
                "warmup_steps": 20,
                "schedule_steps": 0,
                "min_lr_ratio": 0.1,
                "b1": 0.9,
                "b2": 0.95,
                "eps": 1e-8,
                "weight_decay": 0.1,
                "decay_norms": False,
                "decay_embeddings": False,
                "grad_clip_norm": 1.0,
                "moment_dtype": "float32",
                "offload": False,
            },
            "params": {"offload": False},
            "lora": {"rank": 0, "alpha": 16.0, "targets": "all", "dropout": 0.0, "base_dtype": "bfloat16"},
            "dpo": {"beta": 0.1, "loss": "sigmoid", "label_smoothing": 0.0, "reference": "auto"},
            "pipeline": {"schedule": "gpipe", "microbatches": 0, "repeats": 1, "gather_weights": "per_use",
                         "keep": "layer_inputs"},
            "mesh": {
                **{axis: 1 for axis in MESH_AXES},
                **{f"dcn_{axis}": 1 for axis in MESH_AXES},
            },
            "sharding": {"preset": "fsdp", "sequence_parallel": True, "context_layout": "zigzag"},
            "checkpoint": {
                "every_steps": 50,
                "every_minutes": 0.0,
                "max_to_keep": 3,
                "async_save": True,
                "init_from": "",
            },
            "hardware": {"peak_flops_per_device": None},
        }
    )


# Keys whose default is None, and the type they hold when set.
_NULLABLE = {"hardware.peak_flops_per_device": float}

CHOICES = {
    "model.rope_scaling": ("none", "llama3", "yarn", "linear"),
    "model.param_dtype": ("float32", "bfloat16"),
    "model.dtype": ("float32", "bfloat16"),
    "model.attention": ATTENTIONS,
    "model.context_attention": CONTEXT_ATTENTIONS,
    "model.moe_matmul": config_moe.MOE_MATMULS,
    "model.norm": NORMS,
    "model.norm_weights": NORM_WEIGHTS,
    "model.quantization": QUANTIZATIONS,
    "model.quantization_scale": QUANTIZATION_SCALES,
    "remat.policy": remat.POLICIES,
    **{f"remat.custom.{name}": remat.MODES for name in remat.NAMES},
    "data.source": ("stdlib", "synthetic", "files", "prepared"),
    "data.format": DATA_FORMATS,
    "data.loss_on": ("auto", "all", "assistant", "completion"),
    "train.objective": ("lm", "dpo"),
    "dpo.loss": ("sigmoid", "ipo", "hinge"),
    "dpo.reference": ("auto", "copy", "precomputed"),
    "lora.base_dtype": ("float32", "bfloat16", "int8"),
    "train.on_nonfinite": ("skip", "stop"),
    "train.spike.action": ("off", "warn", "skip", "rollback"),
    "sharding.preset": ("fsdp", "dp", "zero1", "zero2"),
    "sharding.context_layout": CONTEXT_LAYOUTS,
    "pipeline.schedule": ("gpipe", "circular", "1f1b", "interleaved_1f1b", "zero_bubble"),
    "pipeline.gather_weights": ("per_use", "once"),
    "pipeline.keep": ("layer_inputs", "stage_inputs"),
    "optim.moment_dtype": ("float32", "bfloat16"), **config_deepseek.CHOICES, **config_gpt_oss.CHOICES,
}

_POSITIVE = (
    "steps", "model.vocab_size", "model.d_model", "model.num_layers", "model.num_heads", "model.num_kv_heads",
    "model.head_dim", "model.d_ff", "data.seq_len", "train.global_batch", "train.grad_accum_steps",
    "train.log_every_steps", "train.eval_batches", "checkpoint.every_steps", "checkpoint.max_to_keep",
    "model.rope_original_max_position", "pipeline.repeats", "model.experts_per_token", "model.moe_every",
    "model.rope_theta", "model.rope_scaling_factor", "model.rope_low_freq_factor", "model.rope_high_freq_factor",
    "train.spike.window", "train.spike.limit", "dpo.beta", "train.hang.seconds", *config_deepseek.POSITIVE,
    *config_gpt_oss.POSITIVE,
)
_NON_NEGATIVE = ("seed", "pipeline.microbatches", "train.hang.factor", "train.hang.straggler",
                 "train.profile_start", "train.profile_steps", "train.eval_every_steps", "data.workers",
                 "checkpoint.every_minutes", "model.attention_block", "model.logits_block", "optim.learning_rate",
                 "optim.warmup_steps", "optim.schedule_steps", "optim.weight_decay", "optim.eps",
                 "optim.grad_clip_norm", "model.norm_eps", "model.init_std", "model.qk_norm_eps", "model.num_experts",
                 "model.moe_d_ff", "model.capacity_factor", "model.router_aux_loss", "model.router_z_loss",
                 "lora.rank", "lora.alpha", *config_deepseek.NON_NEGATIVE)
_UNIT_INTERVAL = ("optim.min_lr_ratio", "optim.b1", "optim.b2")


def flat_keys(cfg: ml_collections.ConfigDict, prefix: str = "") -> list[str]:
    keys = []
    for k, v in cfg.items():
        if isinstance(v, ml_collections.ConfigDict):
            keys += flat_keys(v, f"{prefix}{k}.")
        else:
            keys.append(f"{prefix}{k}")
    return keys


def _unknown_key(key: str, known: Iterable[str]) -> ConfigError:
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.5)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    return ConfigError(f"unknown config key '{key}'{hint}")


def get(cfg: ml_collections.ConfigDict, key: str) -> Any:
    node = cfg
    for part in key.split("."):
        node = node[part]
    return node


def _coerce(key: str, value: Any, default: Any) -> Any:
    """Return `value` as the type of `default`, or raise a ConfigError that says what was expected."""
    want = _NULLABLE.get(key, type(default))
    if value is None:
        if key in _NULLABLE:
            return None
        raise ConfigError(f"{key} must be a {want.__name__}, got null")
    if want is bool:
        if isinstance(value, bool):
            return value
    elif want is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif want is float:
        if isinstance(value, str):  # YAML 1.1 reads "3e-4" as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if math.isfinite(value):
                return float(value)
            raise ConfigError(f"{key} must be a finite number, got {value}")
    elif want is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
    raise ConfigError(f"{key} must be a {'number' if want in (int, float) else want.__name__}"
                      f"{' (integer)' if want is int else ''}, got {value!r}")


def _set(cfg: ml_collections.ConfigDict, key: str, value: Any, known: list[str]) -> None:
    if key not in known:
        raise _unknown_key(key, known)
    *parents, leaf = key.split(".")
    node = cfg
    for part in parents:
        node = node[part]
    coerced = _coerce(key, value, node[leaf])
    with node.unlocked():  # replaces the field's type-checked reference: _coerce has checked it
        del node[leaf]
        node[leaf] = coerced


def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def parse_override(text: str) -> tuple[str, Any]:
    """`key=value` with `value` a YAML scalar."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise ConfigError(f"--set expects KEY=VALUE (e.g. mesh.fsdp=4), got '{text}'")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        raise ConfigError(f"--set {key}: '{raw}' is not a YAML scalar") from None
    if isinstance(value, (dict, list)):
        raise ConfigError(f"--set {key}: expected a scalar value, got '{raw}'")
    return key.strip(), value


def read_mapping(path: str | Path, what: str, example: str, keys: Iterable[str] | None = None) -> dict:
    """A YAML file holding a mapping - a config, sweep or launch file - with every failure one ConfigError line;
    with `keys`, a key outside them is refused. A gs:// path is read from the bucket."""
    path = epath.Path(path)
    if not path.is_file():
        raise ConfigError(f"{what} '{path}' not found; expected a YAML file such as {example}")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{what} '{path}' is not UTF-8 text (byte {e.start}); expected a YAML file such as "
                          f"{example}") from None
    try:
        tree = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{what} '{path}' is not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"{what} '{path}' must hold a mapping of keys, got {type(tree).__name__}")
    if keys is not None and (unknown := set(tree) - set(keys)):
        raise ConfigError(f"{what} '{path}': unknown key(s) {', '.join(sorted(unknown))}; expected some of "
                          f"{', '.join(sorted(keys))}")
    return tree


def load(path: str | Path | None = None, overrides: Iterable[str] = ()) -> ml_collections.ConfigDict:
    """defaults() <- YAML file <- --set overrides, each key checked; then validated."""
    cfg = defaults()
    known = flat_keys(cfg)
    if path is not None:
        tree = read_mapping(path, "config file", example="configs/llama_tiny.yaml")
        for key, value in _flatten(tree).items():
            _set(cfg, key, value, known)
    for text in overrides:
        _set(cfg, *parse_override(text), known)
    validate(cfg)
    cfg.lock()
    return cfg


def validate(cfg: ml_collections.ConfigDict) -> None:
    """Checks that need no devices. Mesh and divisibility checks live with the mesh and sharding rules."""
    for key, options in CHOICES.items():
        if get(cfg, key) not in options:
            raise ConfigError(f"{key} must be one of {', '.join(options)}; got '{get(cfg, key)}'")
    for key in _POSITIVE:
        if get(cfg, key) <= 0:
            raise ConfigError(f"{key} must be > 0, got {get(cfg, key)}")
    for key in _NON_NEGATIVE:
        if get(cfg, key) < 0:
            raise ConfigError(f"{key} must be >= 0, got {get(cfg, key)}")
    for key in _UNIT_INTERVAL:
        if not 0 <= get(cfg, key) <= 1:
            raise ConfigError(f"{key} must be in [0, 1], got {get(cfg, key)}")
    if cfg.train.spike.factor <= 1:
        raise ConfigError(f"train.spike.factor must be > 1 (a loss this many times the running median is a spike), "
                          f"got {cfg.train.spike.factor}")
    for key in flat_keys(cfg.mesh):
        degree = cfg.mesh[key]
        if degree == 0 or degree < -1:
            raise ConfigError(f"mesh.{key} must be a positive degree or -1 (fill), got {degree}")
    if not cfg.run_dir.strip():
        raise ConfigError("run_dir must name a directory, got an empty string")
    if cfg.seed >= 2**32:
        raise ConfigError(f"seed must be < 2**32, got {cfg.seed}")
    config_bounds.check(cfg, {key: get(cfg, key) for key in flat_keys(cfg)})
    peak = cfg.hardware.peak_flops_per_device
    if peak is not None and peak <= 0:
        raise ConfigError(f"hardware.peak_flops_per_device must be > 0 (or null to look it up), got {peak}")
    m = cfg.model
    if m.rope_scaling == "llama3" and m.rope_high_freq_factor <= m.rope_low_freq_factor:
        raise ConfigError(f"model.rope_high_freq_factor={m.rope_high_freq_factor} must exceed "
                          f"model.rope_low_freq_factor={m.rope_low_freq_factor}")
    if m.num_heads % m.num_kv_heads:
        raise ConfigError(f"model.num_heads={m.num_heads} must be a multiple of model.num_kv_heads={m.num_kv_heads}")
    for key in ("attention_block", "logits_block"):
        if m[key] and cfg.data.seq_len % m[key]:
            raise ConfigError(f"data.seq_len={cfg.data.seq_len} must be divisible by model.{key}={m[key]} (or "
                              f"set it to 0: no blocking)")
    if m.norm_cancellation and not m.qk_norm:
        raise ConfigError("model.norm_cancellation=true needs model.qk_norm=true: the input norm's 1/rms can be "
                          "dropped for Q and K only where their own per-head norms renormalise them")
    if m.norm_cancellation and m.qk_norm_eps != 0:
        raise ConfigError(f"model.norm_cancellation=true is exact only with model.qk_norm_eps=0 (got "
                          f"{m.qk_norm_eps}): RMSNorm(c q) = RMSNorm(q) needs eps = 0")
    for check in (config_moe.check, config_gpt_oss.check, config_deepseek.check, _check_quantization,
                  config_gemma.check):
        check(m)  # config_gemma.check: the window's keys, then Gemma's
    if m.head_dim % 2:
        raise ConfigError(f"model.head_dim={m.head_dim} must be even (RoPE rotates pairs)")
    if cfg.train.global_batch % cfg.train.grad_accum_steps:
        raise ConfigError(f"train.global_batch={cfg.train.global_batch} must be divisible by "
                          f"train.grad_accum_steps={cfg.train.grad_accum_steps}")
    if cfg.train.profile_steps and cfg.train.profile_start < 1:
        raise ConfigError(f"train.profile_steps={cfg.train.profile_steps} needs train.profile_start >= 1, the first "
                          f"step to trace (steps count from 1; leave the first few out: they compile)")
    for check_run in (_check_data, _check_post_training, config_deepseek.check_run):
        check_run(cfg)


def quantized_groups(spec: str) -> tuple[str, ...]:
    """The matmul groups a model.quantized_matmuls value names ("attention,mlp"); ConfigError for unknown ones."""
    names = tuple(name.strip() for name in spec.split(",") if name.strip())
    unknown = [name for name in names if name not in MATMUL_GROUPS]
    if unknown:
        raise ConfigError(f"model.quantized_matmuls names unknown matmul group(s) {', '.join(unknown)}: expected a "
                          f"comma-separated list of {', '.join(MATMUL_GROUPS)}; got '{spec}'")
    return names


def _check_quantization(m: ml_collections.ConfigDict) -> None:
    groups = quantized_groups(m.quantized_matmuls)
    if m.quantization == "none":
        return
    if not groups:
        raise ConfigError(f"model.quantization={m.quantization} quantizes no matmul: model.quantized_matmuls is empty "
                          f"(name some of {', '.join(MATMUL_GROUPS)}, or set model.quantization=none)")
    if set(groups) == {"experts"} and not m.num_experts:
        raise ConfigError(f"model.quantized_matmuls={m.quantized_matmuls} on a dense model (model.num_experts=0) "
                          "quantizes nothing; name its groups (attention, mlp, output) or set model.quantization=none")
    if m.norm == "fused" and {"attention", "mlp", "output"} & set(groups):
        raise ConfigError(f"model.quantization={m.quantization} with model.norm=fused: the fused norm+matmul kernels "
                          f"multiply in the compute dtype, so the matmuls after a norm cannot be quantized; use "
                          f"model.norm=deferred (the same arithmetic in XLA, which quantizes its matmul)")
    if m.moe_matmul == "megablox" and m.num_experts and "experts" in groups:
        raise ConfigError(f"model.moe_matmul=megablox with model.quantization={m.quantization} on the experts: "
                          "megablox's kernels multiply in the compute dtype; quantized experts run their own grouped "
                          "matmul (model.moe_matmul=auto picks it), or leave experts out of model.quantized_matmuls")


def moe_d_ff(m) -> int:
    """The hidden width of each expert: model.moe_d_ff, or model.d_ff where that is 0."""
    return m.moe_d_ff or m.d_ff


def _check_data(cfg: ml_collections.ConfigDict) -> None:
    data = cfg.data
    if data.source == "files" and not data.path:
        raise ConfigError("data.source=files needs data.path (a .txt/.jsonl/.parquet file, a folder or a glob)")
    if data.source == "prepared" and not data.path:
        raise ConfigError("data.source=prepared needs data.path (a folder written by `python -m scaletrain data "
                          "prepare`)")
    if cfg.train.eval_every_steps and not (data.eval_path or data.source == "prepared"):
        raise ConfigError(f"train.eval_every_steps={cfg.train.eval_every_steps} needs evaluation data: data.eval_path "
                          f"(a prepared dataset) or data.source=prepared (its eval split)")


# data.loss_on's choices each data.format takes; the one after auto is what auto means.
LOSS_ON = {"text": ("auto", "all"), "chat": ("auto", "assistant", "all"),
           "prompt_completion": ("auto", "completion", "all"), "preference": ("auto", "completion")}


def loss_on(data) -> str:
    """The tokens a data section trains: all, assistant or completion (data.loss_on, auto resolved)."""
    return LOSS_ON[data.format][1] if data.loss_on == "auto" else data.loss_on


def _check_post_training(cfg: ml_collections.ConfigDict) -> None:
    data, lora, dpo = cfg.data, cfg.lora, cfg.dpo
    if data.loss_on not in LOSS_ON[data.format]:
        raise ConfigError(f"data.loss_on={data.loss_on} does not apply to data.format={data.format}: expected one of "
                          f"{', '.join(LOSS_ON[data.format])}")
    if data.format != "text" and data.source == "stdlib":
        raise ConfigError(f"data.format={data.format} reads rows of data.path: set data.source to files (a JSONL or "
                          f"Parquet file or folder) or prepared (a dataset `data prepare --format {data.format}` "
                          f"wrote)")
    if data.format not in ("text", "preference") and data.source == "synthetic":
        raise ConfigError(f"data.source=synthetic makes text or preference rows, not data.format={data.format}")
    if data.chat_template and data.format == "text":
        raise ConfigError("data.chat_template renders conversations: it needs data.format chat, prompt_completion or "
                          "preference")
    if (cfg.train.objective == "dpo") != (data.format == "preference"):
        raise ConfigError(f"train.objective={cfg.train.objective} with data.format={data.format}: DPO learns from "
                          f"preference rows and preference rows train only DPO; set train.objective=dpo with "
                          f"data.format=preference (or neither)")
    if cfg.train.objective == "dpo" and not cfg.checkpoint.init_from and dpo.reference != "precomputed":
        raise ConfigError("train.objective=dpo needs a reference model: checkpoint.init_from (the run whose "
                          "parameters both start the policy and are the reference) or dpo.reference=precomputed "
                          "(reference log-probs stored in a prepared dataset)")
    if dpo.reference == "copy" and lora.rank:
        raise ConfigError("dpo.reference=copy with lora.rank > 0: with LoRA the reference is the frozen base itself, "
                          "the adapters off - no second copy of the model (dpo.reference=auto)")
    if not 0 <= dpo.label_smoothing < 0.5:
        raise ConfigError(f"dpo.label_smoothing must be in [0, 0.5) (the share of pairs taken to be flipped), got "
                          f"{dpo.label_smoothing}")
    if not 0 <= lora.dropout < 1:
        raise ConfigError(f"lora.dropout must be in [0, 1), got {lora.dropout}")
    if lora.rank and lora.alpha <= 0:
        raise ConfigError(f"lora.alpha must be > 0 (the adapters' output is scaled by alpha / rank), got {lora.alpha}")


def to_yaml(cfg: ml_collections.ConfigDict) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)


def config_hash(cfg: ml_collections.ConfigDict) -> str:
    """A short fingerprint of the resolved config, stored in checkpoint metadata."""
    return hashlib.sha256(json.dumps(cfg.to_dict(), sort_keys=True).encode()).hexdigest()[:16]
