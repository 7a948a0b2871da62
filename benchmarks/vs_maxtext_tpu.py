"""scaletrain against MaxText on TPU topologies, compiled ahead of time by one jax and libtpu, in one run.

    python benchmarks/vs_maxtext_tpu.py [--rows 8b,70b,mixtral] [--sides maxtext,ours] [--ours-env auto]
                                        [--results DIR] [--force] [--markdown FILE] [--setup-only] [--dry-run]

MaxText 0.2.5 is installed (pinned, with jax/jaxlib 0.12.0.1 and libtpu 0.0.50.1) into its own Python 3.12
virtual environment under $MAXTEXT_DIR (default ~/.cache/scaletrain-maxtext) on first use; scaletrain's step is
compiled in that same environment (the repository on PYTHONPATH, its missing dependencies installed there), so
both steps are compiled by the same compiler. If scaletrain cannot compile there, `--ours-env auto` (the
default) says why and compiles it with the project's own environment instead, and the table says the compilers
differ (`--ours-env shared` refuses to fall back; `--ours-env project` does not try the shared one).

Every step is compiled for the TPU topology on this machine's CPU (JAX_PLATFORMS=cpu: libtpu compiles for
chips that are not here), one compile at a time, each in its own process (benchmarks/maxtext_aot/), results
kept under --results (default runs/vs_maxtext_tpu) and reused unless --force. For each row and side:
- the step as it trains (scanned layers, default compiler options): HBM per chip;
- the step with 2 and 3 layers (units of a layer group), every model loop unrolled, windowed einsum off - the
  loop correction of scaletrain/planner/aot.py applied to both: per unit = c(3) - c(2), step = c(2) + (L - 2)
  per unit, for XLA's FLOPs, bytes and optimal_seconds, and for the kernels' cost;
- kernels: XLA counts a Pallas (Mosaic) kernel as nothing; every tpu_custom_call in the compiled HLO is costed
  from its shapes by one formula per kind (benchmarks/maxtext_aot/kernels.py) and timed at the chip's
  roofline (scaletrain/facts/hardware.yaml), then added to XLA's estimate.
docs/maxtext-comparison.md explains the rows, the formulas and the results.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent / "maxtext_aot"
sys.path.insert(0, str(HERE))

import kernels  # noqa: E402

MAXTEXT_PIN = "maxtext==0.2.5"
# MaxText 0.2.5's requirement lists say only jax>=0.11.1; these are the versions it resolved to when this script
# was written, libtpu being the one jax 0.12.0.1's TPU extra names.
COMPILER_PINS = ("jax==0.12.0.1", "jaxlib==0.12.0.1", "libtpu==0.0.50.1")
GIB = 2 ** 30

# Each row: the TPU topology (scaletrain's spelling and MaxText's), the layer count, the MaxText recipe (its own
# keys) and scaletrain's variants (config and overrides) at the same global batch and sequence length.
ROWS = {
    "8b": {
        "title": "Llama-3.1-8B, v5p-64 (32 chips)",
        "topology": "v5p:4x4x2", "maxtext_topology": "v5p-64", "layers": 32,
        "maxtext": ["model_name=llama3.1-8b", "per_device_batch_size=4", "max_target_length=8192",
                    "remat_policy=full", "ici_fsdp_parallelism=-1", "dtype=bfloat16", "attention=flash",
                    "use_iota_embed=true"],
        "maxtext_note": "pdb 4 x 8192, remat full, FSDP, splash attention",
        "ours": {
            # tune's choice for this slice (docs/tune.md): no remat over 4 microbatches of a sequence per chip.
            # (Before tune, full remat: 29.81 GiB, 6.099 s - docs/benchmarks.md, issue 30's table.)
            "config (tune's: remat none, 4 microbatches)": ("configs/llama3_8b.yaml", [
                "train.global_batch=128", "data.seq_len=8192"]),
        },
    },
    "70b": {
        "title": "Llama-2-70B, v5p-128 (64 chips)",
        "topology": "v5p:4x4x4", "maxtext_topology": "v5p-128", "layers": 80,
        # MaxText's v5p-128 recipe for llama2-70b (its benchmarks' llama2_70b_v5p_128 and configs/tpu/v5p/
        # llama2_70b.sh): 4096 tokens, save_dot_except_mlpwi, iota embedding, with attention named explicitly
        # (its `autoselected` default) - at 2 sequences per chip, not the recipe's 4: compiled here, 4 need
        # 100.65 GiB of HBM per chip, more than a v5p has (docs/maxtext-comparison.md).
        "maxtext": ["model_name=llama2-70b", "per_device_batch_size=2", "max_target_length=4096",
                    "remat_policy=save_dot_except_mlpwi", "ici_fsdp_parallelism=-1", "dtype=bfloat16",
                    "attention=flash", "use_iota_embed=true"],
        "maxtext_note": "pdb 2 x 4096, remat save_dot_except_mlpwi, FSDP, splash attention",
        # configs/llama3_70b.yaml is Llama 3.1 70B: Llama 2's vocabulary and RoPE instead.
        "ours": {
            # One microbatch of 2 x 4096 per chip, as MaxText's recipe (the config's own 2 microbatches are for
            # 2 x 8192).
            "full remat (the config before tune)": ("configs/llama3_70b.yaml", [
                "model.vocab_size=32000", "model.rope_theta=10000.0", "model.rope_scaling=none",
                "train.global_batch=128", "data.seq_len=4096", "remat.policy=full", "train.grad_accum_steps=1"]),
            "remat minimal (= save_dot_except_mlpwi)": ("configs/llama3_70b.yaml", [
                "model.vocab_size=32000", "model.rope_theta=10000.0", "model.rope_scaling=none",
                "train.global_batch=128", "data.seq_len=4096", "remat.policy=minimal", "train.grad_accum_steps=1"]),
        },
    },
    "mixtral": {
        "title": "Mixtral 8x7B, v5p-128 (64 chips)",
        "topology": "v5p:4x4x4", "maxtext_topology": "v5p-128", "layers": 32,
        # MaxText's v5p recipe for Mixtral 8x7B (its benchmarks' mixtral_8x7b_dropless_v5p_512, written for
        # v5p-512): remat full, FSDP, splash with 2048 blocks and the fused backward kernel, megablox grouped
        # matmuls (dropless), bf16 weights - at 8 sequences of 4096 per chip, not the recipe's 36: compiled here,
        # 36 need 132.6 GiB of HBM per chip with MaxText and 185.7 GB of temporaries with scaletrain, more than a
        # v5p has (docs/maxtext-comparison.md).
        "maxtext": ["model_name=mixtral-8x7b", "per_device_batch_size=8", "max_target_length=4096",
                    "remat_policy=full", "ici_fsdp_parallelism=-1", "dtype=bfloat16", "weight_dtype=bfloat16",
                    "attention=flash", "megablox=true", "sparse_matmul=true",
                    "sa_block_q=2048", "sa_block_kv=2048", "sa_block_kv_compute=2048", "sa_block_q_dkv=2048",
                    "sa_block_kv_dkv=2048", "sa_block_kv_dkv_compute=2048", "sa_block_q_dq=2048",
                    "sa_block_kv_dq=2048", "sa_use_fused_bwd_kernel=true"],
        "maxtext_note": "pdb 8 x 4096, remat full, FSDP, megablox, splash 2048 blocks fused bwd, bf16 weights",
        # The recipe's scoped-VMEM limit (MaxText's MOE_VMEM_LIMIT_FLAG), for both sides: without it libtpu
        # 0.0.50.1 refuses MaxText's step (CompileTimeScopedVmemOom). The recipe's other libtpu options reorder
        # collectives around compute, which XLA's cost estimate does not see; none is passed to either side.
        "libtpu_args": "--xla_tpu_scoped_vmem_limit_kib=81920",
        "ours": {
            # The config before issue 31: experts over mesh.expert, tokens to them by ragged all-to-all.
            "expert 8 x fsdp 8, full remat": ("configs/mixtral_8x7b.yaml", [
                "train.global_batch=512", "data.seq_len=4096", "mesh.expert=8", "mesh.fsdp=8",
                "remat.policy=full"]),
            # MaxText's layout: no expert parallelism, every expert's weights gathered by FSDP, tokens stay put
            # (no all-to-all, so no receive buffer sized for the most a device could be sent).
            "fsdp 64 (= the recipe's layout)": ("configs/mixtral_8x7b.yaml", [
                "train.global_batch=512", "data.seq_len=4096", "mesh.expert=1", "remat.policy=full"]),
            # The same layout keeping every matmul's output (nothing but elementwise work recomputed) over 4
            # microbatches of 2 sequences per chip. (Nothing recomputed at all, over 8 microbatches: XLA needs
            # 164 GB of temporaries; save_dots over 8: 39.6 GiB.)
            "fsdp 64, save_dots, 4 microbatches": ("configs/mixtral_8x7b.yaml", [
                "train.global_batch=512", "data.seq_len=4096", "mesh.expert=1", "remat.policy=save_dots",
                "train.grad_accum_steps=4"]),
        },
    },
}
# Mixtral at 4 sequences per chip, configs/mixtral_8x7b.yaml's batch as `tune` configured it, beside MaxText's
# recipe at the same batch: the recipe's keys but per_device_batch_size.
ROWS["mixtral_pdb4"] = {
    **ROWS["mixtral"],
    "title": "Mixtral 8x7B, v5p-128 (64 chips), 4 x 4096 per chip",
    "maxtext": [("per_device_batch_size=4" if k.startswith("per_device_batch_size=") else k)
                for k in ROWS["mixtral"]["maxtext"]],
    "maxtext_note": ROWS["mixtral"]["maxtext_note"].replace("pdb 8", "pdb 4"),
    "ours": {"config (as tune chose it)": ("configs/mixtral_8x7b.yaml", ["data.seq_len=4096"])},
}
# Long context (issue 32): Llama-3.1-8B at 131,072 tokens on a v5p-64, each sequence over 8 chips. MaxText's
# context parallelism (ici_context_parallelism; its all-gather of keys and values, load-balanced, with splash
# attention) at one sequence per 8 chips (per_device_batch_size 1/8), FSDP over the other 4, full remat.
ROWS["8b_128k"] = {
    "title": "Llama-3.1-8B, v5p-64 (32 chips), 131,072 tokens, context parallelism 8",
    "topology": "v5p:4x4x2", "maxtext_topology": "v5p-64", "layers": 32,
    "maxtext": ["model_name=llama3.1-8b", "per_device_batch_size=0.125", "max_target_length=131072",
                "remat_policy=full", "ici_context_parallelism=8", "ici_fsdp_parallelism=4", "dtype=bfloat16",
                "attention=flash", "context_parallel_load_balance=true", "use_iota_embed=true"],
    "maxtext_note": "pdb 1/8 x 131072, remat full, context 8 x FSDP 4, splash attention, load-balanced",
    "ours": {
        # The ring (model.context_attention=ring) is left out: its blocks are XLA's, whose scores at 16,384 keys a
        # pass make the step HBM-bound (plan: 82 s against 8.2 s; docs/context.md).
        "config (all-gather, flash)": ("configs/llama3_8b_128k.yaml", []),
    },
}
# DeepSeek-V3 671B (issue 53) on a v5p-512 (256 chips), one sequence of 4096 per chip, full remat. MaxText's
# deepseek3-671b model config with the device-limited routing its header asks for (8 groups, top 4), its defaults
# otherwise: FSDP over every chip (as its 256-chip v7x recipe), megablox grouped matmuls (dropless), float32
# weights and moments, no multi-token prediction. The 3 dense layers stay in every compile: the unrolled ones
# have 3 + 2 and 3 + 3 layers, and the correction counts the 58 mixtures (`first_dense`).
ROWS["deepseek"] = {
    "title": "DeepSeek-V3 671B, v5p-512 (256 chips)",
    "topology": "v5p:4x8x8", "maxtext_topology": "v5p-512", "layers": 61, "first_dense": 3,
    "maxtext": ["model_name=deepseek3-671b", "per_device_batch_size=1", "max_target_length=4096",
                "remat_policy=full", "ici_fsdp_parallelism=-1", "dtype=bfloat16", "attention=flash",
                "n_routing_groups=8", "topk_routing_group=4", "megablox=true", "sparse_matmul=true"],
    "maxtext_note": "pdb 1 x 4096, remat full, FSDP, megablox, splash attention, fp32 weights and moments",
    "libtpu_args": ROWS["mixtral"]["libtpu_args"],
    "ours": {
        # MaxText's layout: the experts split by FSDP and gathered, tokens stay put.
        "fsdp 256 (= the recipe's layout)": ("configs/deepseek_v3_671b.yaml", [
            "train.global_batch=256", "model.mtp_depth=0", "optim.moment_dtype=float32", "mesh.expert=1"]),
        # The config's layout: experts over 8 chips, tokens to them by ragged all-to-all.
        "expert 8 x fsdp 32 (the config's layout)": ("configs/deepseek_v3_671b.yaml", [
            "train.global_batch=256", "model.mtp_depth=0", "optim.moment_dtype=float32"]),
    },
}
COMMON_MAXTEXT = ["compile_topology_num_slices=1", "dataset_type=synthetic", "enable_checkpointing=false",
                  "jax_cache_dir=", "enable_goodput_recording=false", "monitor_goodput=false",
                  "enable_tensorboard=false", "skip_jax_distributed_system=true"]


def maxtext_dir() -> Path:
    return Path(os.environ.get("MAXTEXT_DIR") or Path.home() / ".cache" / "scaletrain-maxtext")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _python312() -> str:
    for cand in sorted((Path.home() / ".pyenv" / "versions").glob("3.1[2-9]*/bin/python3.1[2-9]")):
        return str(cand)
    for name in ("python3.12", "python3.13"):
        path = shutil.which(name)
        if path and subprocess.run([path, "-V"], capture_output=True).returncode == 0:
            return path
    sys.exit("error: MaxText needs Python >= 3.12 (its every release says Requires-Python >=3.12); none found "
             "(pyenv install 3.12, or the system's python3.12)")


def _installed(py: Path, names) -> dict[str, str | None]:
    code = ("import json,sys\nfrom importlib.metadata import version\nout={}\nfor n in sys.argv[1:]:\n"
            "  try: out[n]=version(n)\n  except Exception: out[n]=None\nprint(json.dumps(out))")
    r = subprocess.run([str(py), "-c", code, *names], capture_output=True, text=True)
    return json.loads(r.stdout) if r.returncode == 0 else {n: None for n in names}


def _pip(py: Path, *args: str) -> None:
    cmd = [str(py), "-m", "pip", "install", "-q", *args]
    log("pip install " + " ".join(args))
    r = subprocess.run(cmd)
    if r.returncode:
        sys.exit(f"error: `{shlex.join(cmd)}` failed (exit {r.returncode})")


def _our_requirements() -> list[str]:
    """pyproject.toml's dependencies (the project's pins), without jax and jaxlib: the shared environment keeps
    MaxText's compiler."""
    import tomllib
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return [d for d in deps if d.split("=")[0].split("[")[0].strip() not in ("jax", "jaxlib")]


def ensure_env() -> Path:
    """MaxText's virtual environment (created on first use), with scaletrain's missing dependencies: its python."""
    base = maxtext_dir()
    py = base / "venv" / "bin" / "python"
    want = {p.split("==")[0]: p.split("==")[1] for p in (MAXTEXT_PIN, *COMPILER_PINS)}
    have = _installed(py, want) if py.exists() else {}
    if any(have.get(k) != v for k, v in want.items()):
        base.mkdir(parents=True, exist_ok=True)
        if not py.exists():
            log(f"creating MaxText's environment in {base / 'venv'}")
            subprocess.run([_python312(), "-m", "venv", str(base / "venv")], check=True)
            _pip(py, "--upgrade", "pip")
        # The wheel carries its own requirement lists; "decoupled" is the one without Google Cloud clients and
        # accelerator wheels (for DECOUPLE_GCLOUD=TRUE on any machine).
        dl = base / "dl"
        subprocess.run([str(py), "-m", "pip", "download", "-q", "--no-deps", "-d", str(dl), MAXTEXT_PIN], check=True)
        wheel = next(dl.glob("maxtext-0.2.5-*.whl"))
        import zipfile
        with zipfile.ZipFile(wheel) as z:
            reqs = z.read("dependencies/requirements/generated_requirements/decoupled-requirements.txt")
        (base / "decoupled-requirements.txt").write_bytes(reqs)
        _pip(py, str(wheel), "-r", str(base / "decoupled-requirements.txt"), *COMPILER_PINS)
    reqs = _our_requirements()
    names = [r.split("==")[0].split("[")[0].strip() for r in reqs]
    missing = [r for r, n in zip(reqs, names) if _installed(py, [n])[n] is None]
    if missing:
        _pip(py, *missing, *COMPILER_PINS)  # the compiler pins again: nothing may move them
    return py


def project_python() -> str:
    venv = ROOT / ".venv" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


def _env(shared: bool, libtpu_args: str = "") -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", DECOUPLE_GCLOUD="TRUE", TF_CPP_MIN_LOG_LEVEL="2",
               # libtpu refuses a second process while one holds its lockfile; no TPU is attached here.
               ALLOW_MULTIPLE_LIBTPU_LOAD="1")
    env.pop("LIBTPU_INIT_ARGS", None)
    if libtpu_args:  # a row's own libtpu options, read by libtpu when it loads, in both drivers
        env["LIBTPU_INIT_ARGS"] = libtpu_args
    if shared:
        env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def run_compile(cmd: list[str], out: Path, env: dict, force: bool, dry: bool, cached_only: bool = False) -> dict | None:
    """One compile in its own process, its JSON cached at `out` (reused when its command is the same). None: not
    compiled (a dry run, or `cached_only`)."""
    key = shlex.join(cmd[1:])  # the interpreter may move; what is compiled may not
    if "--config" in cmd:  # nor may the config file's content, which a path does not show
        key += f" config-sha256={hashlib.sha256(Path(cmd[cmd.index('--config') + 1]).read_bytes()).hexdigest()}"
    if env.get("LIBTPU_INIT_ARGS"):
        key = f"LIBTPU_INIT_ARGS={shlex.quote(env['LIBTPU_INIT_ARGS'])} {key}"
    if out.exists() and not force:
        cached = json.loads(out.read_text())
        if cached.get("command") == key and ("error" not in cached or cached.get("fits") is False):
            return cached
    if dry or cached_only:
        if dry:
            print(shlex.join(cmd))
        return None
    log(f"compiling {out.parent.name}/{out.stem}")
    t = time.time()
    r = subprocess.run(cmd + ["--out", str(out)], env=env, capture_output=True, text=True, cwd=ROOT)
    res = json.loads(out.read_text()) if out.exists() else {"error": f"no result (exit {r.returncode})"}
    if r.returncode and "error" not in res:
        res["error"] = f"exit {r.returncode}"
    res["command"] = key
    res["stderr_tail"] = r.stderr[-3000:] if res.get("error") else ""
    out.write_text(json.dumps(res, indent=1))
    log(f"  {'ERROR ' + res['error'] if res.get('error') else 'done'} in {time.time() - t:.0f} s")
    return res


def corrected(two: dict, three: dict, units: int, peak: float, bandwidth: float) -> dict:
    """The loop correction (planner/aot.py's): step = c(2) + (units - 2) (c(3) - c(2)), for XLA's costs and the
    kernels'; kernel seconds at the roofline, per kernel. With gradient accumulation the unrolled compiles take one
    microbatch (ours_driver.py), and every figure is multiplied by their number, as planner/aot.py does."""
    out = {}
    for k in ("flops", "bytes accessed", "optimal_seconds"):
        out[k] = two["cost"][k] + (units - 2) * (three["cost"][k] - two["cost"][k])
    k2, k3 = two["kernels"], three["kernels"]
    s2 = kernels.kernel_seconds(k2, peak, bandwidth)
    s3 = kernels.kernel_seconds(k3, peak, bandwidth)
    out["kernel_flops"] = k2["flops"] + (units - 2) * (k3["flops"] - k2["flops"])
    out["kernel_bytes"] = k2["bytes"] + (units - 2) * (k3["bytes"] - k2["bytes"])
    out["kernel_seconds"] = s2 + (units - 2) * (s3 - s2)
    out["kernel_calls"] = k2["calls"] + (units - 2) * (k3["calls"] - k2["calls"])
    out["uncosted_kernels"] = sorted(set(k2["uncosted"]) | set(k3["uncosted"]))
    out["kernels_in_loops"] = k2["calls_in_loops"] + k3["calls_in_loops"]
    # Kernels XLA counted by their own declared estimates (kernels.py): noted, not added.
    d2, d3 = k2.get("declared", {}).get("flops", 0.0), k3.get("declared", {}).get("flops", 0.0)
    out["declared_kernel_flops"] = d2 + (units - 2) * (d3 - d2)
    accum = two.get("grad_accum_steps", 1)
    for k in ("flops", "bytes accessed", "optimal_seconds", "kernel_flops", "kernel_bytes", "kernel_seconds",
              "kernel_calls", "declared_kernel_flops"):
        out[k] *= accum
    out["step_with_kernels"] = out["optimal_seconds"] + out["kernel_seconds"]
    return out


def chip_spec(chip: str = "v5p") -> tuple[float, float, float]:
    """bf16 FLOP/s, HBM bytes/s and HBM bytes of a chip from scaletrain/facts/hardware.yaml."""
    import yaml
    spec = yaml.safe_load((ROOT / "scaletrain" / "facts" / "hardware.yaml").read_text())[chip]
    return float(spec["bf16_flops"]), float(spec["hbm_bandwidth"]), float(spec["hbm_bytes"])


def side_results(row: str, spec: dict, side: str, label: str, cmd_base: list[str], layer_arg, env: dict,
                 results: Path, args) -> dict:
    """The full compile and the two unrolled ones of one side of a row, corrected."""
    d = results / row / label.split(" (")[0].replace(" ", "_").replace("/", "_").replace("=", "")
    d.mkdir(parents=True, exist_ok=True)
    def compile_(extra, name):
        return run_compile(cmd_base + extra, d / name, env, args.force, args.dry_run, args.table_only)

    full = compile_(layer_arg(None), "full.json")
    dense = spec.get("first_dense", 0)  # layers outside the repeated ones, in every compile
    two = compile_(layer_arg(dense + 2), "unrolled2.json")
    three = compile_(layer_arg(dense + 3), "unrolled3.json")
    return {"row": row, "side": side, "label": label, "full": full, "two": two, "three": three,
            "hlo": {name: str(d / f"{name}.hlo.gz") for name in ("full", "unrolled2", "unrolled3")}}


def _kept_kernels(path: str | None) -> dict | None:
    """The kernels of a kept compiled program, read again with today's kernels.py (a change to it needs no
    compile)."""
    if not path or not Path(path).exists():
        return None
    import gzip
    with gzip.open(path, "rt") as f:
        return kernels.inventory(f.read())


def summarize(entry: dict, units: int, peak: float, bandwidth: float) -> dict:
    full, two, three = entry["full"], entry["two"], entry["three"]
    s = {"row": entry["row"], "side": entry["side"], "label": entry["label"]}
    ref = next((r for r in (full, two, three) if r and r.get("jax")), {}) or {}
    s["compiler"] = f"jax {ref.get('jax')} / libtpu {ref.get('libtpu')}" if ref else "?"
    errors = [f"error, {n}: {r.get('error')}" for n, r in (("full", full), ("2 layers", two), ("3 layers", three))
              if r and r.get("error") and r.get("fits") is not False]
    if errors:
        s["error"] = "; ".join(errors)
    if full and full.get("fits") is False:
        s["hbm_gib"] = None
        s["fits"] = False
        s["full_error"] = full.get("error")
    elif full and full.get("memory"):
        s["hbm_gib"] = full["memory"]["device_total"] / GIB
        s["host_gib"] = full["memory"]["host_total"] / GIB
        s["fits"] = True
        s["raw_optimal_seconds"] = full["cost"]["optimal_seconds"]
        # The scanned program's kernels, each counted by its loops' trip counts: a cross-check of the correction.
        scanned = _kept_kernels(entry.get("hlo", {}).get("full"))
        if scanned:
            s["scanned_kernel_flops"] = scanned["flops"]
            s["scanned_kernel_uncosted"] = scanned["uncosted"]
        s["mesh"] = full.get("mesh")
        s["tokens_per_step"] = full.get("tokens_per_step")
        if full.get("maxtext_tflops_per_device"):
            s["maxtext_model_tflops_per_chip"] = full["maxtext_tflops_per_device"]["total"]
    if two and three and two.get("cost") and three.get("cost"):
        hlo = entry.get("hlo", {})
        two = {**two, "kernels": _kept_kernels(hlo.get("unrolled2")) or two["kernels"]}
        three = {**three, "kernels": _kept_kernels(hlo.get("unrolled3")) or three["kernels"]}
        s.update(corrected(two, three, units, peak, bandwidth))
    missing = [n for n, r in (("full", full), ("2 layers", two), ("3 layers", three)) if r is None]
    if missing:
        s["error"] = "not compiled yet: " + ", ".join(missing)
    return s


def fmt(v, spec="{:.2f}", none="-") -> str:
    return none if v is None else spec.format(v)


def table(summaries: list[dict], capacity: float) -> str:
    lines = ["| row | framework, settings | compiler | HBM/chip GiB | XLA TFLOP/chip | XLA step s | kernel TFLOP/chip "
             "| kernel s | step with kernels s | vs MaxText |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for s in summaries:
        mt = next((x for x in summaries if x["row"] == s["row"] and x["side"] == "maxtext"), None)
        ratio = "-"
        if s["side"] != "maxtext" and mt and mt.get("step_with_kernels") and s.get("step_with_kernels"):
            ratio = f"{s['step_with_kernels'] / mt['step_with_kernels'] - 1:+.1%}"
        hbm = fmt(s.get("hbm_gib")) if s.get("fits", True) else "does not fit"
        if s.get("hbm_gib") and s["hbm_gib"] * GIB > capacity:
            hbm += f" (over the chip's {capacity / GIB:.1f})"
        if s.get("host_gib"):
            hbm += f" (+{s['host_gib']:.1f} host)"
        cells = [ROWS[s["row"]]["title"], s["label"], s["compiler"], hbm,
                 fmt(s.get("flops") and s["flops"] / 1e12, "{:,.0f}"), fmt(s.get("optimal_seconds"), "{:.3f}"),
                 fmt(s.get("kernel_flops") and s["kernel_flops"] / 1e12, "{:,.0f}"),
                 fmt(s.get("kernel_seconds"), "{:.3f}"), fmt(s.get("step_with_kernels"), "**{:.3f}**"), ratio]
        if s.get("error"):
            cells[4] = s["error"][:160].replace("|", "/")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[2:]))
    p.add_argument("--rows", default="8b,70b,mixtral", help=f"comma-separated, of {', '.join(ROWS)}")
    p.add_argument("--sides", default="maxtext,ours", help="maxtext, ours, or both (default)")
    p.add_argument("--ours-env", choices=("auto", "shared", "project"), default="auto",
                   help="where scaletrain compiles: MaxText's environment (one compiler for both; `auto` falls "
                        "back to the project's own on failure, and says so) or the project's")
    p.add_argument("--variant", help="only scaletrain's variants whose label contains this (e.g. minimal)")
    p.add_argument("--no-remat-barrier", action="store_true",
                   help="scaletrain's unrolled compiles without the driver's remat barrier, kept apart under "
                        "RESULTS/.../no-barrier: before commit fcc80ba scaletrain's unrolled step had none (XLA "
                        "merged each layer's recomputation with its forward pass); since, scaletrain adds it "
                        "itself and this changes nothing")
    p.add_argument("--results", default=str(ROOT / "runs" / "vs_maxtext_tpu"))
    p.add_argument("--force", action="store_true", help="compile again even when a result is kept")
    p.add_argument("--markdown", help="also write the table and notes to this file")
    p.add_argument("--setup-only", action="store_true", help="create MaxText's environment and stop")
    p.add_argument("--dry-run", action="store_true", help="print the compile commands not yet done")
    p.add_argument("--table-only", action="store_true",
                   help="compile nothing: the table from the results kept (compiles not done show as such)")
    args = p.parse_args()
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        p.error(f"unknown rows {unknown}; expected some of {', '.join(ROWS)}")
    sides = [s.strip() for s in args.sides.split(",")]
    shared_py = ensure_env()
    if args.setup_only:
        print(shared_py)
        return
    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    peak, bandwidth, capacity = chip_spec("v5p")
    ours_py, ours_shared, fallback_reason = str(shared_py), True, None
    if args.ours_env == "project":
        ours_py, ours_shared = project_python(), False
    entries = []
    for row in rows:
        spec = ROWS[row]
        libtpu_args = spec.get("libtpu_args", "")
        if "maxtext" in sides:
            base = [str(shared_py), str(HERE / "maxtext_driver.py"), f"compile_topology={spec['maxtext_topology']}",
                    f"run_name=vs_{row}", f"base_output_directory={results / row / 'maxtext_out'}",
                    *COMMON_MAXTEXT, *spec["maxtext"]]

            def mt_layers(n):
                return [] if n is None else ["scan_layers=false", "override_model_config=true",
                                             f"base_num_decoder_layers={n}", "--no-windowed-einsum"]

            entries.append(side_results(row, spec, "maxtext", f"MaxText 0.2.5 recipe ({spec['maxtext_note']})",
                                        base, mt_layers, _env(True, libtpu_args), results, args))
        if "ours" in sides:
            for label, (cfg, sets) in spec["ours"].items():
                if args.variant and args.variant not in label:
                    continue
                def our_cmd(py):
                    return [py, str(HERE / "ours_driver.py"), "--config", str(ROOT / cfg), "--topology",
                            spec["topology"], *[a for s in sets for a in ("--set", s)]]

                def our_layers(n):
                    if n is None:
                        return []
                    return ["--unrolled-layers", str(n)] + ([] if args.no_remat_barrier else ["--remat-barrier"])

                where = results / ("shared" if ours_shared else "project")
                if args.no_remat_barrier:
                    label, where = label + ", unrolled without remat barrier", where / "no-barrier"
                entry = side_results(row, spec, "ours", f"scaletrain {label}", our_cmd(ours_py), our_layers,
                                     _env(ours_shared, libtpu_args), where, args)
                failed = [r for r in (entry["full"], entry["two"], entry["three"])
                          if r and r.get("error") and r.get("fits") is not False]
                if failed and ours_shared and args.ours_env == "auto":
                    fallback_reason = failed[0]["error"]
                    log(f"scaletrain failed in MaxText's environment ({fallback_reason}); compiling it with the "
                        f"project's own environment instead - two compilers")
                    ours_py, ours_shared = project_python(), False
                    where = results / "project" / ("no-barrier" if args.no_remat_barrier else "")
                    entry = side_results(row, spec, "ours", f"scaletrain {label}", our_cmd(ours_py), our_layers,
                                         _env(False, libtpu_args), where, args)
                entry["label"] = f"scaletrain {label}" + ("" if ours_shared else " [project env]")
                entries.append(entry)
    if args.dry_run:
        return
    summaries = [summarize(e, ROWS[e["row"]]["layers"] - ROWS[e["row"]].get("first_dense", 0), peak,
                           bandwidth) for e in entries]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    head = (f"Command: `python benchmarks/vs_maxtext_tpu.py --rows {','.join(rows)} --sides {','.join(sides)}"
            f"{'' if args.ours_env == 'auto' else ' --ours-env ' + args.ours_env}`, commit {commit}, "
            f"{datetime.date.today().isoformat()}, {platform.node()} ({os.cpu_count()} CPUs), compiled for v5p "
            f"through libtpu on the CPU; v5p roofline {peak / 1e12:.0f} TFLOP/s bf16, {bandwidth / 1e12:.2f} TB/s "
            f"HBM (scaletrain/facts/hardware.yaml).")
    notes = []
    if fallback_reason:
        notes.append(f"scaletrain could not compile in MaxText's environment ({fallback_reason}): its rows were "
                     f"compiled by the project's own jax/libtpu - the two compilers differ.")
    for s in summaries:
        if s.get("uncosted_kernels"):
            notes.append(f"{s['label']}: kernels not costed: {', '.join(s['uncosted_kernels'])}")
        if s.get("declared_kernel_flops"):
            notes.append(f"{s['label']}: {s['declared_kernel_flops'] / 1e12:,.1f} TFLOP/chip of kernels that declare "
                         f"their cost (grouped matmuls: megablox's, XLA's ragged dot) are in XLA's count, not in the "
                         f"kernels' columns")
        if s.get("kernel_flops") and s.get("scanned_kernel_flops"):
            notes.append(f"{s['label']}: kernel FLOPs from the unrolled compiles {s['kernel_flops'] / 1e12:,.1f} "
                         f"TFLOP/chip, from the scanned program with its loops' trip counts "
                         f"{s['scanned_kernel_flops'] / 1e12:,.1f}")
    text = head + "\n\n" + table(summaries, capacity) + "\n\n" + "\n".join(f"- {n}" for n in notes) + "\n"
    print(text)
    (results / "summary.json").write_text(json.dumps({"header": head, "rows": summaries, "notes": notes}, indent=1))
    if args.markdown:
        Path(args.markdown).write_text(text)


if __name__ == "__main__":
    main()
