"""One ahead-of-time compile of MaxText's train step for a TPU topology; run inside MaxText's own environment.

    python maxtext_driver.py --out RESULT.json [--no-windowed-einsum] key=value ...

The keys are MaxText's own (its base.yml, installed with the package): compile_topology=v5p-64,
model_name=llama3.1-8b, per_device_batch_size=4, ... It follows MaxText's train_compile path (the shaped train
state and batch, MaxText's shardings and its `train_step`, jitted and compiled for the topology's devices) and
writes one JSON: XLA's cost analysis, memory analysis, the Mosaic kernels of the compiled program
(kernels.py), versions and timings. `--no-windowed-einsum` passes the two libtpu options that turn XLA's
windowed-einsum loops off as compiler options (MaxText's compile_xla_flags), as scaletrain's cost compiles do.
Set JAX_PLATFORMS=cpu and DECOUPLE_GCLOUD=TRUE (vs_maxtext_tpu.py does).
"""

import os
import sys
import time
from importlib.metadata import version
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

# The same two libtpu options as common.NO_WINDOWED_EINSUM, in MaxText's compile_xla_flags spelling.
NO_WINDOWED_EINSUM = " ".join(f"--{k}={str(v).lower()}" for k, v in common.NO_WINDOWED_EINSUM.items())


def main(argv) -> None:
    out = argv[argv.index("--out") + 1]
    nowe = "--no-windowed-einsum" in argv
    keys = [a for a in argv if "=" in a and not a.startswith("--")]
    res = {"framework": "maxtext", "keys": keys, "no_windowed_einsum": nowe}
    t0 = time.time()
    try:
        import jax
        from flax.core.spmd import logical_axis_rules as axis_rules
        from maxtext.configs import pyconfig
        from maxtext.trainers.pre_train import train
        from maxtext.trainers.pre_train import train_compile as tc
        from maxtext.utils import maxtext_utils, sharding

        res.update(jax=jax.__version__, jaxlib=version("jaxlib"), libtpu=version("libtpu"),
                   maxtext=version("maxtext"), python=sys.version.split()[0])
        # As MaxText's train_compile: its RNG implementation and libtpu option.
        jax.config.update("jax_default_prng_impl", "unsafe_rbg")
        os.environ["LIBTPU_INIT_ARGS"] = (os.environ.get("LIBTPU_INIT_ARGS", "")
                                          + " --xla_tpu_spmd_rng_bit_generator_unsafe=true")
        import maxtext
        base = str(Path(maxtext.__file__).parent / "configs" / "base.yml")
        extra = [f"compile_xla_flags={NO_WINDOWED_EINSUM}"] if nowe else []
        config = pyconfig.initialize([argv[0], base, *keys, *extra])
        tc.validate_config(config)
        mesh = tc.get_topology_mesh(config)
        res["mesh"] = {k: int(v) for k, v in mesh.shape.items()}
        res["chips"] = int(mesh.devices.size)
        res["device_kind"] = str(mesh.devices.flat[0].device_kind)
        res["layers"] = int(config.num_decoder_layers)
        res["scan_layers"] = bool(config.scan_layers)
        res["tokens_per_step"] = int(config.global_batch_size_to_train_on * config.max_target_length)
        args, kwargs, state_shardings, _, model = tc.get_shaped_inputs(mesh, config)
        params_shardings, state_shardings = sharding.maybe_update_params_sharding_with_opt(config, state_shardings)
        in_state = sharding.build_zero1_input_state_mesh_shardings(config, state_shardings, params_shardings)
        data_sharding = sharding.get_input_data_sharding(config, mesh)
        func, in_shard, out_shard, static, donate = maxtext_utils.get_functional_train_with_signature(
            train.train_step, data_sharding, in_state, model, config, params_shardings)
        common.compile_into(res, lambda: tc.jit_and_compile(
            func, args, kwargs, mesh, in_shard, out_shard, static, donate, config,
            axis_rules(config.logical_axis_rules)), out)
        try:
            tot, weights, attn = maxtext_utils.calculate_tflops_training_per_device(config)
            res["maxtext_tflops_per_device"] = {"total": tot, "weights": weights, "attention": attn}
        except Exception as e:  # noqa: BLE001 - MaxText's own count is informative only
            res["maxtext_tflops_error"] = repr(e)[:200]
    except SystemExit:
        pass
    except Exception as e:  # noqa: BLE001 - reported in the JSON, exit status 1
        common.failed(res, e)
    common.finish(res, out, t0)


if __name__ == "__main__":
    main(sys.argv)
