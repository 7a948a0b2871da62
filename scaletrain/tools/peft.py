"""`convert to-hf --peft`: a LoRA run's adapters as a PEFT adapter folder - adapter_model.safetensors and
adapter_config.json - that `peft.PeftModel.from_pretrained(base, folder)` loads onto the Hugging Face model the run
started from (docs/post-training.md).

PEFT keeps each adapted Linear's pair as lora_A.weight [rank, in] and lora_B.weight [out, rank] beside the base
weight, named after it: model.layers.0.self_attn.q_proj.weight's are
base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight and ...lora_B.weight. scaletrain's A [in..., rank]
and B [rank, out...] are the transposes, flattened as the base weight's tensor table flattens W (tools/hf.py).
A mixture's experts have no such Linear in transformers 5 (one 3-D parameter holds every expert), so their
adapters are exported merged only: `convert to-hf` without --peft.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from scaletrain.errors import UserError
from scaletrain.models import lora

ADAPTER_FILE, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"
PREFIX = "base_model.model."  # PeftModel's wrapping of the model's own names


def adapters(cfg, params: dict, layout: list) -> dict[str, np.ndarray]:
    """The adapters of `params` (a run's, its base included) as PEFT's tensors, named after the base weights of
    `layout` (tools/hf.py's Tensors). UserError where PEFT has no place for one (an expert's)."""
    host = {}
    for t in layout:
        node = params
        for key in t.path[:-1]:
            node = node[key]
        adapter = node.get(t.path[-1] + lora.SUFFIX) if isinstance(node, dict) else None
        if adapter is None:
            continue
        if len(t.index) != 1:
            raise UserError(f"convert to-hf --peft: {t.name} is an expert's weight, which transformers keeps in one "
                            f"parameter for all experts; export the adapters merged (convert to-hf without --peft)")
        name = PREFIX + t.name.removesuffix(".weight")
        rank = cfg.lora.rank
        a = np.asarray(adapter["a"], np.float32)[t.index].reshape(-1, rank)  # [in, rank]
        b = np.asarray(adapter["b"], np.float32)[t.index].reshape(rank, -1)  # [rank, out]
        host[f"{name}.lora_A.weight"] = np.ascontiguousarray(a.T)
        host[f"{name}.lora_B.weight"] = np.ascontiguousarray(b.T)
    if not host:
        raise UserError("convert to-hf --peft: the run has no adapters (lora.rank is 0); export it without --peft")
    return host


def write(cfg, host: dict[str, np.ndarray], target: Path, base_model: str) -> None:
    """adapter_model.safetensors (`adapters`' tensors) and adapter_config.json, into `target`."""
    save_file(host, target / ADAPTER_FILE, metadata={"format": "pt"})
    modules = sorted({name.split(".")[-3] for name in host})
    (target / ADAPTER_CONFIG).write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": cfg.lora.rank, "lora_alpha": cfg.lora.alpha, "lora_dropout": cfg.lora.dropout,
        "target_modules": modules, "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
        "init_lora_weights": True, "modules_to_save": None, "inference_mode": True,
    }, indent=2) + "\n")
