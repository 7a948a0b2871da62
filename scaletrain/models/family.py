"""The one interface a model family gives (docs/design.md, "Adding a model family"): its decoder, the Hugging Face
architectures it reads and writes (their tensor tables and config.json mappings), and its matmul inventory for
the planner. A family lives in its own folder, models/<name>/, and is registered by one line in
models/__init__.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from scaletrain.models import lora

# A Hugging Face tensor table row: (Hugging Face name, scaletrain parameter path, in_dims), in Hugging Face's
# order. `{i}` is the layer and `{j}` the expert, whose parameters scaletrain stacks on leading axes ([layers,
# experts, ...]). in_dims None: the same array. Otherwise a linear weight [out, in], whose transpose is
# scaletrain's weight with its first `in_dims` dims flattened (e.g. wq [embed, heads, head_dim] is
# q_proj.weight.T [embed, heads * head_dim]). A row applies where the model has its parameter (q_norm/k_norm with
# qk_norm, lm_head without tied embeddings).
# in_dims 0: a vector of Hugging Face's that is scaletrain's parameter flattened (a bias [heads x head_dim] for
# [heads, head_dim]). An Interleaved in_dims: one of several parameters interleaved along the tensor's last axis.
Row = tuple[str, tuple[str, ...], "int | Interleaved | None"]


@dataclass(frozen=True)
class Interleaved:
    """A row whose Hugging Face tensor holds `of` scaletrain parameters interleaved along its last axis, this one
    in columns index, index + of, ... (GPT-OSS's gate_up_proj: the gate even, up odd), each otherwise as it is."""

    index: int
    of: int


@dataclass(frozen=True)
class Architecture:
    """One Hugging Face architecture (config.json's `architectures`) a family reads and writes."""

    model_type: str  # config.json's model_type
    tensors: tuple[Row, ...]  # every tensor, in Hugging Face's order
    config_keys: tuple[tuple[str, str], ...]  # config.json key -> model.* key, where one is the other
    bias_keys: tuple[str, ...] = ()  # the bias switches its config has, written false
    qk_norm: bool = False  # Q and K normalised per head with the model's rms_norm_eps (Qwen3's)
    sliding_window: bool = False  # its config's sliding_window must be null (scaletrain has no such attention)
    # The family's own model.* keys from config.json: (hf, source, refuse) -> keys, where refuse(what) is the
    # UserError naming what scaletrain cannot represent. After the shared keys; none by default.
    keys_in: Callable[[dict, str, Callable[[str], Exception]], dict] | None = None
    # The family's own config.json keys from the model section (written after the rope keys); none by default.
    keys_out: Callable[[Any], dict] | None = None
    # model.* keys every model of it has at these values (its family, its pieces' switches): set on import, and
    # a model whose values differ is not exported to it. Keys of other architectures' features must be at their
    # defaults.
    features: Mapping[str, Any] = field(default_factory=dict)
    # Sliding-window layers: its config's sliding_window and layer_types are model keys (tools/hf_window.py).
    windows: bool = False
    # Stacked layers in several stacks (DeepSeek's dense first layers, then its mixtures): the parameter trees'
    # roots, in Hugging Face's layer order; a stack's `{i}` counts on from the layers of those before it.
    stacks: tuple[str, ...] = ("layers",)
    # permute(model, path, array, to_hf): a parameter (scaletrain's layout) as scaletrain keeps it from Hugging
    # Face's (to_hf: back) where the two order its values differently (DeepSeek's interleaved RoPE); none by default.
    permute: Callable[[Any, tuple[str, ...], Any, bool], Any] | None = None
    # skipped(config.json) -> whether a tensor name of the checkpoint is skipped on import (transformers' own
    # unexpected keys: DeepSeek's multi-token prediction layer); none by default.
    skipped: Callable[[dict], Callable[[str], bool]] | None = None
    # The activation its config names (hidden_act, or hidden_activation), which model.mlp_activation computes.
    hidden_act: str = "silu"
    # Its own reading of the rope settings, (hf, refuse) -> keys, where the shared one cannot (rope per layer kind).
    rope_keys: Callable[[dict, Callable[[str], Exception]], dict] | None = None
    # Tensors a checkpoint repeats in every layer of a stack that are one parameter of scaletrain's (DeepSeek's
    # multi-token prediction layers' embedding and head): (name with {i}, the stack, the parameter's path, in_dims).
    # Written as copies on export; on import not required and not read (the parameter's own tensor is).
    copies: tuple[tuple[str, str, tuple[str, ...], int | None], ...] = ()
    # (config.json, the tensor names the files hold) -> (model.* keys that depend on which tensors are there, a
    # note to print or ""): DeepSeek's multi-token prediction layer, imported where the files have it.
    keys_from_files: Callable[[dict, set], tuple[dict, str]] | None = None
    # model.* keys only its config.json represents (its keys_in sets them, its keys_out writes them): an
    # architecture without one refuses a model that has it off its default (Gemma's pieces).
    own_keys: tuple[str, ...] = ()


@dataclass(frozen=True)
class Matmul:
    """One projection of a layer on one device: the share of the stack's layers that have it, its rows per
    token in those (a mixture of experts' k assignments), its features in and out, and the weight elements it
    reads."""

    layers: float
    rows: float
    inputs: float
    outputs: float
    weights: float

    @classmethod
    def dense(cls, layers: float, inputs: float, outputs: float) -> "Matmul":
        return cls(layers, 1.0, inputs, outputs, inputs * outputs)

    @property
    def flops(self) -> float:
        """Forward FLOPs per token, averaged over the stack's layers: 2 x rows x in x out."""
        return self.layers * 2 * self.rows * self.inputs * self.outputs

    def hbm_bytes(self, tokens: float, dtype_bytes: int) -> float:
        """One pass over `tokens`, averaged over the layers: it reads its input and weights and writes its output
        (scaling.md's 2BD + 2DF + 2BF in bf16)."""
        return self.layers * dtype_bytes * (tokens * self.rows * (self.inputs + self.outputs) + self.weights)


@dataclass(frozen=True)
class Family:
    """A model family. `decoder(model_cfg, rngs)` builds the model (a models.transformer.Decoder, or anything
    with its methods); `architectures` the Hugging Face architectures it covers, by name; `export(model)` the
    architecture `convert to-hf` writes for a model section (a UserError where there is none); `matmuls(m,
    tensor, expert)` a layer's projections on one device by matmul group (planner/roofline.py's `matmuls`);
    `experts` whether its models route tokens to experts (model.num_experts > 0: the config checks it);
    `adapters` the projections lora.targets may name (models/lora.py's names)."""

    name: str
    decoder: type
    matmuls: Callable[..., dict[str, Matmul]]
    architectures: Mapping[str, Architecture] = field(default_factory=dict)
    export: Callable[[Any], str] | None = None
    experts: bool = False
    adapters: tuple[str, ...] = lora.TARGETS
