"""The safetensors files of a Hugging Face folder, read for `convert from-hf` (tools/hf.py): a single
model.safetensors or shards named by model.safetensors.index.json, each file memory-mapped and opened once, every
tensor's shape and dtype checked from the headers before anything is read."""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors import safe_open

from scaletrain.errors import UserError, first_line
from scaletrain.tools import hf_mxfp4

# Buffers some checkpoints carry that the model recomputes: skipped on the way in.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
SINGLE_FILE, INDEX_FILE = "model.safetensors", "model.safetensors.index.json"
# Block-FP8 checkpoints (DeepSeek-V3's hub files): a float8_e4m3 weight beside its `<name>_scale_inv`, one float32
# scale per FP8_BLOCK x FP8_BLOCK block of it; the weight is their product. safetensors' numpy reader has no float8,
# so such a tensor's bytes are read from the file directly.
FP8, SCALE_SUFFIX, FP8_BLOCK = "F8_E4M3", "_scale_inv", 128


def read_json(path: Path, what: str) -> dict:
    if not path.is_file():
        raise UserError(f"{what}: {path} not found")
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{what}: {path} is not readable JSON ({first_line(e)})") from None
    if not isinstance(value, dict):
        raise UserError(f"{what}: {path} holds no JSON object")
    return value


class Reader:
    """The safetensors files of a Hugging Face folder, single or sharded (model.safetensors.index.json), each
    opened once (memory-mapped: a tensor is read when asked for)."""

    def __init__(self, source: Path, stack: ExitStack):
        self.source, self._stack, self._handles = source, stack, {}
        if (source / INDEX_FILE).is_file():
            weight_map = read_json(source / INDEX_FILE, "--hf-dir").get("weight_map")
            if not isinstance(weight_map, dict):
                raise UserError(f"{source / INDEX_FILE} has no weight_map")
            self.location = dict(weight_map)
        elif (source / SINGLE_FILE).is_file():
            self.location = {name: SINGLE_FILE for name in self._file(SINGLE_FILE).keys()}
        else:
            raise UserError(f"--hf-dir {source}: neither {SINGLE_FILE} nor {INDEX_FILE} found (only safetensors "
                            f"checkpoints are read)")
        self.files = sorted(set(self.location.values()))

    def _file(self, name: str):
        if name not in self._handles:
            if not (self.source / name).is_file():
                raise UserError(f"{self.source / INDEX_FILE} names {name}, which is not in {self.source}")
            try:
                self._handles[name] = self._stack.enter_context(safe_open(self.source / name, framework="numpy"))
            except Exception as e:  # noqa: BLE001 - safetensors' and the OS's errors alike: one line
                raise UserError(f"{self.source / name}: cannot read it as safetensors ({first_line(e)})") from None
        return self._handles[name]

    def check(self, layout: list, skipped=None) -> None:  # tools/hf.py's Tensors
        """Every tensor present with its shape and a float dtype, and no tensor left without a place but those
        `skipped(name)` says the architecture skips: checked from the files' headers, before anything is read."""
        expected = {t.name for t in layout} | {t.name + SCALE_SUFFIX for t in layout}
        for t in layout:
            if self._quantized(t.name):
                self._check_mxfp4(t)
                expected |= {t.name + hf_mxfp4.BLOCKS, t.name + hf_mxfp4.SCALES}
                continue
            if t.name not in self.location:
                raise UserError(f"{self.source}: no tensor {t.name} (expected {list(t.hf_shape)}) in "
                                f"{', '.join(self.files)}")
            file = self.location[t.name]
            if t.name not in self._file(file).keys():
                raise UserError(f"{self.source / file} lacks tensor {t.name} (expected {list(t.hf_shape)}), "
                                f"which {INDEX_FILE} places there")
            piece = self._file(file).get_slice(t.name)
            shape, dtype = tuple(piece.get_shape()), piece.get_dtype()
            if dtype == FP8 and t.name + SCALE_SUFFIX in self.location:
                dtype = "F32"  # dequantized when read
            if shape != t.hf_shape or dtype not in ("F32", "BF16", "F16"):
                raise UserError(f"{self.source / file}: tensor {t.name} is {dtype} {list(shape)}; expected "
                                f"{list(t.hf_shape)} (from config.json) in F32, BF16 or F16")
        # A tied checkpoint may still carry lm_head.weight: transformers ignores it too.
        extra = [n for n in self.location if n not in expected and not n.endswith(IGNORED_SUFFIXES)
                 and n != "lm_head.weight" and not (skipped and skipped(n))]
        if extra:
            raise UserError(f"{self.source}: tensor {extra[0]} has no place in scaletrain's model"
                            f"{f' (and {len(extra) - 1} more)' if len(extra) > 1 else ''}; its config.json "
                            f"describes another model")

    def _quantized(self, name: str) -> bool:
        """Whether the tensor is stored in MXFP4 (tools/hf_mxfp4.py) rather than as itself."""
        return name not in self.location and name + hf_mxfp4.BLOCKS in self.location

    def _check_mxfp4(self, t) -> None:
        pieces = {}
        for suffix in (hf_mxfp4.BLOCKS, hf_mxfp4.SCALES):
            name = t.name + suffix
            if name not in self.location:
                raise UserError(f"{self.source}: {t.name + hf_mxfp4.BLOCKS} without {name}")
            piece = self._file(self.location[name]).get_slice(name)
            pieces[suffix] = tuple(piece.get_shape()), piece.get_dtype()
        (blocks, blocks_dtype), (scales, scales_dtype) = pieces[hf_mxfp4.BLOCKS], pieces[hf_mxfp4.SCALES]
        if (blocks_dtype, scales_dtype) != ("U8", "U8") or blocks[:-1] != scales or \
                hf_mxfp4.shape(blocks) != t.hf_shape:
            raise UserError(f"{self.source}: MXFP4 tensor {t.name} has blocks {blocks_dtype} {list(blocks)} and "
                            f"scales {scales_dtype} {list(scales)}; expected uint8 blocks dequantizing to "
                            f"{list(t.hf_shape)} (from config.json)")

    def read(self, t) -> np.ndarray:
        """Tensor `t`'s values (a tools/hf.py Tensor: its name), as stored; a block-FP8 weight dequantized to
        float32, an MXFP4 one (tools/hf_mxfp4.py) too."""
        if self._quantized(t.name):
            return hf_mxfp4.dequantize(*(self.read_named(t.name + s) for s in (hf_mxfp4.BLOCKS, hf_mxfp4.SCALES)))
        return self.read_named(t.name)

    def read_named(self, name: str) -> np.ndarray:
        try:
            if self._file(self.location[name]).get_slice(name).get_dtype() == FP8:
                return self._dequantized(name)
            return self._file(self.location[name]).get_tensor(name)
        except Exception as e:  # noqa: BLE001 - a file truncated or damaged past its header
            raise UserError(f"{self.source / self.location[name]}: cannot read tensor {name} "
                            f"({first_line(e)})") from None



    def _dequantized(self, name: str) -> np.ndarray:
        """A float8_e4m3 weight [out, in] times its scales [ceil(out / 128), ceil(in / 128)], block by block."""
        path = self.source / self.location[name]
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            entry = json.loads(f.read(size))[name]
        start, end = entry["data_offsets"]
        raw = np.fromfile(path, np.uint8, end - start, offset=8 + size + start)
        weight = raw.view(ml_dtypes.float8_e4m3fn).reshape(entry["shape"]).astype(np.float32)
        scales = self._file(self.location[name + SCALE_SUFFIX]).get_tensor(name + SCALE_SUFFIX).astype(np.float32)
        rows, cols = weight.shape
        blocks = np.repeat(np.repeat(scales, FP8_BLOCK, axis=0), FP8_BLOCK, axis=1)[:rows, :cols]
        return weight * blocks
