"""Hugging Face checkpoints in and out: `convert from-hf` (config.json + safetensors -> a run directory) and
`convert to-hf` (a run's checkpoint -> config.json + safetensors). docs/huggingface.md.

Each model family (scaletrain/models/<family>/hf.py) gives the tables - for every Hugging Face architecture it
covers, every tensor's scaletrain parameter and the config.json keys - and this module reads and writes by them:
linear weights are transposed and reshaped, everything else is copied as is.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from etils import epath
from safetensors.numpy import save_file

from scaletrain import config as config_lib
from scaletrain import models
from scaletrain.errors import UserError
from scaletrain.models.family import Architecture, Interleaved
from scaletrain.store import storage
from scaletrain.tools import hf_features, hf_rope, hf_window
from scaletrain.tools.hf_files import INDEX_FILE, SINGLE_FILE, Reader, read_json

DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
# Copied into <run>/tokenizer/ and back: whichever exist.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "chat_template.jinja", "generation_config.json")
# Why to-hf's --out is a local path: the command line refuses a gs:// one before it asks the bucket anything.
LOCAL_OUT = "to-hf writes a local folder"
HF_CONFIG = "hf"  # the folder of the run directory that keeps the original config.json, for to-hf
SHARD_BYTES = 5 * 10**9


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One Hugging Face tensor and where it lives in scaletrain's parameters."""
    name: str
    path: tuple[str, ...]
    index: tuple[int, ...]  # its place on the stacked leading axes: (layer,), (layer, expert) or () for none
    in_dims: int | None
    shape: tuple[int, ...]  # scaletrain's, without the stacked axes
    part: Interleaved | None = None  # one of the parameters the tensor interleaves (family.Interleaved)
    copy: bool = False  # a repeat of the parameter's own tensor (Architecture.copies): written, never read

    @property
    def hf_shape(self) -> tuple[int, ...]:
        if self.part is not None:
            return *self.shape[:-1], self.shape[-1] * self.part.of
        if self.in_dims is None:
            return self.shape
        if self.in_dims == 0:  # a vector: the parameter flattened
            return (math.prod(self.shape),)
        return math.prod(self.shape[self.in_dims:]), math.prod(self.shape[:self.in_dims])

    def to_scaletrain(self, x: np.ndarray) -> np.ndarray:
        """Hugging Face's whole tensor -> this parameter's values."""
        if self.part is not None:
            return x[..., self.part.index::self.part.of]
        if self.in_dims == 0:
            return x.reshape(self.shape)
        return x if self.in_dims is None else x.T.reshape(self.shape)

    def to_hf(self, x: np.ndarray) -> np.ndarray:
        """This parameter's values as Hugging Face lays them out (its columns of the tensor, for a part)."""
        if self.in_dims == 0:
            return x.reshape(-1)
        return x if self.in_dims is None else x.reshape(*self.hf_shape[::-1]).T


def tensors(abstract_params: dict, arch: str) -> list[Tensor]:
    """Every Hugging Face tensor of a model with these parameters, named as `arch` names them, in Hugging Face's
    order: what precedes the layers in the table, the layers one after the other (each with its experts' tensors
    last, expert by expert), then the rest."""
    rows, stacks = _arch(arch).tensors, _arch(arch).stacks
    first_layer_row = next(row for row, (_, path, _) in enumerate(rows) if path[0] in stacks)
    # Each stack's first layer's number in Hugging Face's: after the layers of the stacks before it.
    sizes = [jax.tree.leaves(abstract_params[root])[0].shape[0] if root in abstract_params else 0 for root in stacks]
    offsets = dict(zip(stacks, itertools.accumulate([0, *sizes])))
    keyed = []
    for row, (name, path, in_dims) in enumerate(rows):
        try:
            shape = _leaf(abstract_params, path).shape
        except KeyError:  # the model has no such parameter
            continue
        stacked = ("{i}" in name) + ("{j}" in name)  # leading axes: layers, then experts
        for index in itertools.product(*map(range, shape[:stacked])):
            numbered = (index[0] + offsets[path[0]], *index[1:]) if stacked else index
            # (layer, expert): -1 for a layer's own tensors; before or after every layer for the rest
            place = (*numbered, -1)[:2] if stacked else (-1 if row < first_layer_row else math.inf, -1)
            part = in_dims if isinstance(in_dims, Interleaved) else None
            keyed.append(((*place, row), Tensor(name.format(**dict(zip("ij", numbered))), path, index,
                                                None if part else in_dims, shape[stacked:], part)))
    for row, (name, stack, path, in_dims) in enumerate(_arch(arch).copies, len(rows)):
        layers = jax.tree.leaves(abstract_params[stack])[0].shape[0] if stack in abstract_params else 0
        for layer in range(offsets[stack], offsets[stack] + layers):
            keyed.append(((layer, -1, row), Tensor(name.format(i=layer), path, (), in_dims,
                                                   _leaf(abstract_params, path).shape, copy=True)))
    return [t for _, t in sorted(keyed, key=lambda kt: kt[0])]


def _leaf(tree: dict, path: tuple[str, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


# ---------------------------------------------------------------------------------------------------------------
# config.json <-> model.* keys


def model_keys(hf: dict, source: str) -> dict[str, Any]:
    """The model.* keys of a Hugging Face config; anything scaletrain's model cannot represent is a UserError."""
    arch = _architecture(hf, source)
    facts = _arch(arch)

    def refuse(what: str) -> UserError:
        return UserError(f"{source}: {arch} with {what} is not supported (scaletrain's model has no such feature)")

    act = hf.get("hidden_activation") or hf.get("hidden_act", "silu")
    if act != facts.hidden_act:
        raise refuse(f"hidden_act={act}")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key) and not facts.features.get(key):
            raise refuse(f"{key}=true")
    if facts.sliding_window and hf.get("sliding_window") is not None:
        raise refuse(f"sliding_window={hf['sliding_window']} (sliding-window attention)")
    if hf.get("use_sliding_window"):
        raise refuse("use_sliding_window=true (sliding-window attention)")
    other_layers = sorted({t for t in hf.get("layer_types") or () if t != "full_attention"})
    if other_layers and not facts.windows:
        raise refuse(f"layer_types {', '.join(map(str, other_layers))}")
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"):
        if hf.get(key) is None:
            raise UserError(f"{source}: config.json has no {key}")
    keys = {ours: hf[theirs] for theirs, ours in facts.config_keys if hf.get(theirs) is not None}
    keys.setdefault("num_kv_heads", hf["num_attention_heads"])
    keys.setdefault("head_dim", hf["hidden_size"] // hf["num_attention_heads"])
    keys.setdefault("tie_embeddings", False)  # every supported architecture's default
    keys |= (facts.rope_keys or hf_rope.keys_in)(hf, refuse)
    if facts.windows:  # sliding-window layers
        keys |= hf_window.keys_in(hf, refuse)
    if facts.qk_norm:  # Qwen3 normalises q and k per head, with the model's eps
        keys |= {"qk_norm": True, "qk_norm_eps": keys.get("norm_eps", 1e-6)}
    if facts.keys_in:
        keys |= facts.keys_in(hf, source, refuse)
    return keys | dict(facts.features)


def _arch(name: str) -> Architecture:
    """The tables of a Hugging Face architecture, from the family that covers it."""
    return models.architectures()[name][1]


def _architecture(hf: dict, source: str) -> str:
    known = models.architectures()
    by_type = {a.model_type: name for name, (_, a) in known.items()}
    names = hf.get("architectures") or [by_type.get(hf.get("model_type"), f"model_type {hf.get('model_type')}")]
    if len(names) != 1 or names[0] not in known:
        raise UserError(f"{source}: architecture {', '.join(map(str, names))} is not supported; expected one of "
                        f"{', '.join(known)}")
    return names[0]




def hf_config(model) -> dict:
    """config.json for a run's model (`model`: its config's model section): Qwen3 where Q and K are normalised,
    else Llama - Qwen3-MoE and Mixtral with a mixture of experts. The rope settings are written as rope_theta and
    rope_scaling, which transformers 4 and 5 read."""
    if model.norm_weights != "standard":
        raise UserError(f"model.norm_weights={model.norm_weights}: Hugging Face's Llama keeps its RMSNorm gains; "
                        f"export a run with standard norms")
    if model.qk_norm and model.qk_norm_eps != model.norm_eps:
        raise UserError(f"model.qk_norm_eps={model.qk_norm_eps} differs from model.norm_eps={model.norm_eps}: "
                        f"Qwen3 normalises Q and K with the model's rms_norm_eps")
    family = models.family_of(model)
    if family.export is None:
        raise UserError(f"model family {family.name} has no Hugging Face architecture to export to")
    arch = family.export(model)  # refuses what the family's architectures cannot represent
    facts = _arch(arch)
    hf_features.check(model, arch, facts)
    return {"architectures": [arch], "model_type": facts.model_type,
            **{theirs: model[ours] for theirs, ours in facts.config_keys},
            "hidden_act": facts.hidden_act, **dict.fromkeys(facts.bias_keys, False),
            "rope_theta": model.rope_theta, "rope_scaling": hf_rope.scaling_out(model),
            **(hf_window.keys_out(model) if facts.windows else {}),
            **(facts.keys_out(model) if facts.keys_out else {}), "dtype": model.param_dtype}


def _dtype(hf: dict, default: str) -> Any:
    """The dtype the Hugging Face config names for its weights; the run's parameter dtype when it names none."""
    return DTYPES.get(hf.get("dtype") or hf.get("torch_dtype"), DTYPES[default])


# ---------------------------------------------------------------------------------------------------------------
# from-hf


def from_hf(hf_dir: str, out: str) -> int:
    """`convert from-hf`: a run directory at OUT (new or empty: the command line checks) with config.yaml, a
    parameters-only checkpoint at step 0 that `logits`, `to-hf` and `checkpoint.init_from` read, the tokenizer
    files and the original config.json. Everything is checked before anything is written."""
    from scaletrain.tools import inference

    source = Path(hf_dir)
    keys, arch = read_source(hf_dir)
    facts, hf = _arch(arch), read_json(source / "config.json", f"--hf-dir {hf_dir}")
    with ExitStack() as stack:
        reader = Reader(source, stack)
        if facts.keys_from_files:
            present, note = facts.keys_from_files(hf, set(reader.location))
            keys |= present
            if note:
                print(note)
        # Validated against the source's tokenizer (nothing is written yet), then written naming the copy.
        cfg = _run_config(keys, out, _tokenizer(source))
        setup = inference.one_device_setup(cfg)
        layout = tensors(setup.abstract_state.params, arch)
        copies = {t.name for t in layout if t.copy}
        skipped = facts.skipped(hf) if facts.skipped else (lambda name: False)
        reader.check([t for t in layout if not t.copy], lambda name: name in copies or skipped(name))
        params = _read_params(reader, layout, setup.abstract_state.params, setup.state_shardings.params,
                              _permute(facts, cfg.model, to_hf=False))
    run = storage.prepare(out)
    _save_params(setup, params, run)
    _copy({name: source / name for name in TOKENIZER_FILES if (source / name).is_file()}, run / "tokenizer")
    _copy({"config.json": source / "config.json"}, run / HF_CONFIG)
    cfg = _run_config(keys, out, _tokenizer(run / "tokenizer", relative_to=run))
    # Last: a run directory without config.yaml is an interrupted conversion, not a run.
    (run / "config.yaml").write_text(config_lib.to_yaml(cfg))
    count = sum(math.prod(x.shape) for x in jax.tree.leaves(setup.abstract_state.params))
    print(f"converted {hf_dir} ({arch}, {count / 1e6:.2f}M parameters, "
          f"{len(reader.files)} safetensors file{'s' if len(reader.files) > 1 else ''}) into {out} (step 0); "
          f"fine-tune it with checkpoint.init_from={out}")
    return 0


def read_source(hf_dir: str) -> tuple[dict[str, Any], str]:
    """The model.* keys and the architecture a Hugging Face folder's config.json describes. Raises UserError."""
    source = Path(hf_dir)
    config_json = read_json(source / "config.json", f"--hf-dir {hf_dir}")
    return model_keys(config_json, f"{source / 'config.json'}"), _architecture(config_json, hf_dir)


def _tokenizer(folder: Path | epath.Path, relative_to: Path | epath.Path | None = None) -> str:
    """data.tokenizer for the tokenizer files in `folder`: the folder where it holds a tokenizer.json, the
    SentencePiece model where that is all there is, else the byte tokenizer. With `relative_to` (the run), relative
    to it: a moved or copied run resolves it there when its config is loaded (storage.resolve)."""
    if (folder / "tokenizer.json").is_file():
        found = folder
    elif (folder / "tokenizer.model").is_file():
        found = folder / "tokenizer.model"
    else:
        return "bytes"
    return str(found if relative_to is None else found.relative_to(relative_to))


def _run_config(model: dict[str, Any], run_dir: str, tokenizer: str):
    # mesh.fsdp=-1: the converted config trains as it is on however many devices there are (every other degree
    # 1), as the shipped configs do.
    overrides = {**{f"model.{k}": v for k, v in model.items()}, "run_dir": str(storage.path(run_dir)),
                 "data.tokenizer": tokenizer, "model.param_dtype": "float32", "mesh.fsdp": -1}
    # JSON scalars are YAML scalars: strings stay strings, whatever they hold.
    return config_lib.load(None, [f"{k}={json.dumps(v)}" for k, v in overrides.items()])


def _permute(facts: Architecture, model, to_hf: bool):
    """tensor, array (scaletrain's layout) -> the array as the other side orders it (Architecture.permute)."""
    if facts.permute is None:
        return lambda t, x: x
    return lambda t, x: facts.permute(model, t.path, x, to_hf)


def _read_params(reader: Reader, layout: list[Tensor], abstract_params: dict, shardings: dict, permute) -> dict:
    """The parameters, one scaletrain array at a time: each filled tensor by tensor on the host, then handed to
    the device (here the host too) and dropped, so that host memory holds the model about once. `permute`:
    _permute's, to scaletrain's order."""
    by_path: dict[tuple[str, ...], list[Tensor]] = {}
    for t in layout:
        if not t.copy:
            by_path.setdefault(t.path, []).append(t)

    def fill(path: tuple[str, ...]) -> jax.Array:
        target = _leaf(abstract_params, path)
        host = np.empty(target.shape, target.dtype)
        for t in by_path[path]:
            host[t.index] = permute(t, t.to_scaletrain(reader.read(t)))
        return jax.device_put(host, _leaf(shardings, path))

    return _map_paths(fill, abstract_params)


def _map_paths(fn, tree: dict, prefix: tuple[str, ...] = ()) -> dict:
    return {k: _map_paths(fn, v, prefix + (k,)) if isinstance(v, dict) else fn(prefix + (k,))
            for k, v in tree.items()}


def _save_params(setup, params: dict, run: epath.Path) -> None:
    """A checkpoint of the parameters alone at step 0, with the metadata and fingerprints of a training run's:
    restore_params (logits, to-hf, checkpoint.init_from) reads it like any other. No optimizer state: Adam's
    moments would triple the memory and the files, and a fine-tuning run starts them afresh anyway."""
    from scaletrain.store.checkpoint import Checkpointer
    from scaletrain.train.step import TrainState
    from scaletrain.train.trainer import checkpoint_metadata

    state = TrainState(params=params, opt_state=None, step=jnp.zeros((), jnp.int32), rng=None)
    saved = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]}
    meta = checkpoint_metadata(setup)
    meta = {**meta, "params_only": True, "arrays": {p: a for p, a in meta["arrays"].items() if p in saved}}
    ckpt = Checkpointer(run / "checkpoints", max_to_keep=1, async_save=False)
    try:
        ckpt.save(0, state, {"next_sample": 0}, meta)
        ckpt.wait()
    finally:
        ckpt.close()


# ---------------------------------------------------------------------------------------------------------------
# to-hf


def to_hf(run_dir: str, out: str, step: int | None = None, shard_bytes: int = SHARD_BYTES, peft: bool = False) -> int:
    """`convert to-hf`: OUT (new or empty: the command line checks) gets config.json, the weights as safetensors
    in the config's dtype (files of at most `shard_bytes`, with model.safetensors.index.json when there are
    several) and the run's tokenizer files. The config is the one the run was converted from where there is one
    (kept in RUN_DIR/hf/, or in the run checkpoint.init_from names) and it describes this model; else it is built
    from the run's config. A LoRA run's adapters are folded into the weights (models/lora.py's `merged`); with
    `peft`, OUT gets them as a PEFT adapter instead (tools/peft.py), beside the tokenizer files."""
    from scaletrain.models import lora
    from scaletrain.tools import inference
    from scaletrain.tools import peft as peft_lib
    from scaletrain.train import init_from

    if storage.is_remote(out):
        raise UserError(f"--out {out}: {LOCAL_OUT}; expected a local path (copy it to the bucket afterwards)")
    cfg = inference.load_config(run_dir)
    built = hf_config(cfg.model)  # refuses what Hugging Face's models cannot represent
    kept = _kept_config(run_dir, cfg)
    hf = json.loads(kept) if kept else built
    if hf.pop("quantization_config", None) is not None:  # read dequantized (MXFP4, FP8), written unquantized
        kept = json.dumps(hf, indent=2) + "\n"
    dtype = _dtype(hf, cfg.model.param_dtype)
    setup = inference.one_device_setup(cfg)
    if peft and not cfg.lora.rank:
        raise UserError(f"convert to-hf --peft: {run_dir} has no adapters (lora.rank is 0); export it without --peft")
    step, params = init_from.restore_run_params(run_dir, setup, "convert to-hf", step)
    layout = tensors(setup.abstract_state.params, _architecture(hf, run_dir))
    target = Path(out)
    if peft:
        adapters = peft_lib.adapters(cfg, params, layout)  # refused before anything is written
        target.mkdir(exist_ok=True)
        peft_lib.write(cfg, adapters, target, hf.get("_name_or_path", ""))
        copied = _copy_tokenizer(run_dir, cfg.data.tokenizer, target)
        print(f"wrote the adapters of step {step} of {run_dir} to {out}: {peft_lib.ADAPTER_FILE} ({len(adapters)} "
              f"tensors), {peft_lib.ADAPTER_CONFIG}{', ' + ', '.join(copied) if copied else ''}")
        return 0
    target.mkdir(exist_ok=True)
    if cfg.lora.rank:  # in float32: the export's dtype is applied once, when written
        params = lora.merged(lora.dequantized(params, np.float32), cfg.lora.alpha / cfg.lora.rank, np.float32)
    files = _write_safetensors(params, layout, dtype, target, shard_bytes,
                               _permute(_arch(_architecture(hf, run_dir)), cfg.model, to_hf=True))
    (target / "config.json").write_text(kept or json.dumps(built, indent=2) + "\n")
    copied = _copy_tokenizer(run_dir, cfg.data.tokenizer, target)
    print(f"wrote step {step} of {run_dir} to {out}: {files} safetensors file{'s' if files > 1 else ''} "
          f"({np.dtype(dtype).name}{', adapters merged' if cfg.lora.rank else ''}), config.json "
          f"({'kept from the conversion' if kept else 'built'}){', ' + ', '.join(copied) if copied else ''}")
    return 0


def _kept_config(run_dir: str, cfg) -> str | None:
    """The config.json the run (or the run it was initialised from) was converted from, if it describes the
    run's model - the same model.* keys - so that the export names the same architecture and dtype."""
    from scaletrain.store.checkpoint import locate

    places = [storage.path(run_dir)]
    if cfg.checkpoint.init_from:
        try:
            places.append(locate(cfg.checkpoint.init_from)[0].parent)
        except UserError:  # gone since: the config is built instead
            pass
    for place in places:
        path = place / HF_CONFIG / "config.json"
        if not path.is_file():
            continue
        text = path.read_text()
        try:
            keys = model_keys(json.loads(text), str(path))
        except (UserError, ValueError):
            continue
        if all(cfg.model[k] == v for k, v in keys.items()):
            return text
    return None


def _write_safetensors(params: dict, layout: list[Tensor], dtype, target: Path, shard_bytes: int,
                       permute=lambda t, x: x) -> int:
    """The tensors in Hugging Face's order, a file at a time: host memory holds the model and one file's
    tensors. One file (model.safetensors) when all fit in `shard_bytes`, else model-0000K-of-0000N.safetensors
    and the index. Returns the number of files. `permute`: _permute's, to Hugging Face's order."""
    host = jax.tree.map(np.asarray, params)  # on the CPU device: views, not copies
    itemsize = np.dtype(dtype).itemsize
    shards = _shards(layout, itemsize, shard_bytes)
    names = ([SINGLE_FILE] if len(shards) == 1 else
             [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))])
    for name, shard in zip(names, shards):
        arrays = {}
        for t in shard:
            x = t.to_hf(permute(t, _leaf(host, t.path)[t.index]))
            if t.part is None:
                arrays[t.name] = np.ascontiguousarray(x, dtype)
            else:  # its columns of the tensor the parts share
                arrays.setdefault(t.name, np.empty(t.hf_shape, dtype))[..., t.part.index::t.part.of] = x
        save_file(arrays, target / name, metadata={"format": "pt"})
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(math.prod(t.hf_shape) * itemsize for t in layout
                                               if t.part is None or t.part.index == 0)},
                 "weight_map": {t.name: name for name, shard in zip(names, shards) for t in shard}}
        (target / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return len(shards)


def _shards(layout: list[Tensor], itemsize: int, limit: int) -> list[list[Tensor]]:
    """Consecutive tensors grouped into files of at most `limit` bytes (a larger tensor alone in its file); the
    parts of one tensor in the same file."""
    shards: list[list[Tensor]] = [[]]
    size = 0
    for t in layout:
        if t.part is not None and t.part.index > 0:
            shards[-1].append(t)
            continue
        nbytes = math.prod(t.hf_shape) * itemsize
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += nbytes
    return shards


def _copy_tokenizer(run_dir: str, tokenizer: str, target: Path) -> list[str]:
    """The tokenizer files a conversion kept in RUN_DIR/tokenizer/, else those data.tokenizer names (a folder
    of them, a tokenizer.json or a SentencePiece model), under their Hugging Face names."""
    kept = storage.path(run_dir) / "tokenizer"
    source = kept if kept.is_dir() or tokenizer == "bytes" else storage.path(tokenizer)
    if source.is_dir():
        found = {name: source / name for name in TOKENIZER_FILES if (source / name).is_file()}
    elif source.is_file():
        found = {"tokenizer.model" if source.suffix == ".model" else "tokenizer.json": source}
    else:
        if tokenizer != "bytes":
            print(f"warning: data.tokenizer {tokenizer} not found: no tokenizer files written", file=sys.stderr)
        return []
    _copy(found, target)
    return list(found)


def _copy(files: dict[str, Path | epath.Path], folder: Path | epath.Path) -> None:
    """Each file to `folder` / its name there, local or gs://."""
    if files:
        folder.mkdir(parents=True, exist_ok=True)
    for name, path in files.items():
        (folder / name).write_bytes(path.read_bytes())
