"""One ahead-of-time compile of scaletrain's train step for a TPU topology, reported as maxtext_driver.py reports
MaxText's; runs in the project's environment or in MaxText's (with the repository on PYTHONPATH).

    python ours_driver.py --out RESULT.json --config CONFIG --topology v5p:4x4x2 [--set K=V]...
                          [--unrolled-layers N]

Without --unrolled-layers: the step as the trainer builds it (scanned layers, default compiler options) - its
memory, XLA's raw costs and its kernels. With --unrolled-layers N: the step with N layers (N units of
model.moe_every for a mixture of experts: the caller says), one microbatch, every model loop unrolled and
windowed einsum off - planner/aot.py's cost compile (`unrolled_cost`), whose difference at two depths is the
loop correction.
"""

import argparse
import copy
import sys
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402


def _version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def remat_barrier() -> str:
    """scaletrain wrapped each layer in jax.checkpoint(prevent_cse=False), right for a scanned stack (the loop
    keeps the recomputation apart from the forward pass). Unrolled, nothing did: XLA merged the recomputed
    forward with the original (common-subexpression elimination), so the unrolled step ran no recomputation -
    one forward attention kernel per layer where the scanned step runs two under full remat - and the loop
    correction drawn from it left the remat out. prevent_cse=True puts the barrier back, as MaxText's unscanned
    layers have it. scaletrain's remat.apply now takes `unrolled` and adds the barrier itself (then nothing is
    patched: "project"); for a checkout from before, apply is wrapped here ("patched")."""
    import inspect

    import jax

    from scaletrain import remat

    if "unrolled" in inspect.signature(remat.apply).parameters:
        return "project"

    def apply(fn, name, custom=(), *_):
        if name == "none":
            return fn
        return jax.checkpoint(fn, policy=remat.policy(name, dict(custom)), prevent_cse=True)

    remat.apply = apply
    return "patched"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--config", required=True)
    p.add_argument("--topology", required=True)
    p.add_argument("--set", action="append", default=[], metavar="K=V")
    p.add_argument("--unrolled-layers", type=int)
    p.add_argument("--remat-barrier", action="store_true",
                   help="wrap each layer's jax.checkpoint with prevent_cse=True (see remat_barrier)")
    args = p.parse_args()
    res = {"framework": "scaletrain", "config": args.config, "set": args.set, "topology": args.topology,
           "unrolled_layers": args.unrolled_layers, "no_windowed_einsum": args.unrolled_layers is not None,
           "remat_barrier": args.remat_barrier}
    t0 = time.time()
    try:
        import jax

        from scaletrain import config
        from scaletrain.planner import aot
        from scaletrain.train import trainer

        res.update(jax=jax.__version__, jaxlib=_version("jaxlib"), libtpu=_version("libtpu"),
                   python=sys.version.split()[0])
        if args.remat_barrier:
            res["remat_barrier"] = remat_barrier()
        cfg = config.load(args.config, args.set)
        devices = aot.topology_devices(args.topology)
        res["chips"] = len(devices)
        res["device_kind"] = devices[0].device_kind
        res["tokens_per_step"] = cfg.train.global_batch * cfg.data.seq_len
        options = None
        if args.unrolled_layers is not None:
            # As planner/aot.py's _loop_corrected: one microbatch, N layers, every loop unrolled.
            accum = cfg.train.grad_accum_steps
            res["grad_accum_steps"] = accum
            cfg = copy.deepcopy(cfg)
            cfg.model.num_layers = args.unrolled_layers
            cfg.train.global_batch //= accum
            cfg.train.grad_accum_steps = 1
            options = dict(common.NO_WINDOWED_EINSUM)
        res["layers"] = cfg.model.num_layers
        setup = trainer.build(cfg, devices, unroll_loops=args.unrolled_layers is not None)
        res["mesh"] = {k: int(v) for k, v in setup.mesh.shape.items() if v > 1}
        common.compile_into(res, lambda: setup.step.lower(*setup.abstract_args()).compile(
            options), args.out)
    except SystemExit:
        pass
    except Exception as e:  # noqa: BLE001 - reported in the JSON, exit status 1
        common.failed(res, e)
    common.finish(res, args.out, t0)


if __name__ == "__main__":
    main()
