"""launch/tpu.py: the exact gcloud commands for a v5e-16 slice, a v5p-64 slice and a 2 x v6e-256 multislice
(`--dry-run`), bad launch files refused in one line, the GKE JobSet, and the `run` path as 2 local processes."""

import importlib.util
import json
import sys

import pytest
import yaml

from tests.conftest import ROOT, run_main, tiny_overrides

_spec = importlib.util.spec_from_file_location("launch_tpu", ROOT / "launch" / "tpu.py")
tpu = sys.modules["launch_tpu"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tpu)

CONFIGS = ROOT / "launch" / "configs"


def _dry(capsys, command, config) -> list[str]:
    assert tpu.main([command, "--config", str(CONFIGS / config), "--dry-run"]) == 0
    return capsys.readouterr().out.splitlines()


def test_single_v5e_16_slice(capsys):
    [create] = _dry(capsys, "create", "v5e-16.yaml")
    assert create == ("gcloud compute tpus queued-resources create llama1b-v5e16 --node-id=llama1b-v5e16 "
                      "--accelerator-type=v5litepod-16 --runtime-version=v2-alpha-tpuv5-lite --spot "
                      "--project=my-project --zone=us-west4-a")
    [run] = _dry(capsys, "run", "v5e-16.yaml")
    assert run.startswith("gcloud compute tpus tpu-vm ssh llama1b-v5e16 --worker=all --command=")
    assert ("~/venv/bin/python train.py --config configs/llama3_1b.yaml --set train.global_batch=32 --set steps=2000 "
            "--set run_dir=gs://my-bucket/scaletrain/llama1b-v5e16 > ~/llama1b-v5e16.log") in run
    assert "MEGASCALE" not in run and "nohup" in run
    assert _dry(capsys, "delete", "v5e-16.yaml") == [
        "gcloud compute tpus queued-resources delete llama1b-v5e16 --force --quiet --project=my-project "
        "--zone=us-west4-a"]


def test_a_dry_run_never_loads_libtpu():
    """The checks plan on the CPU: without a TPU, libtpu would print errors on stderr (and on a TPU VM hold the
    chips). A fresh process, JAX_PLATFORMS unset as a user's shell leaves it: stderr stays empty and libtpu's
    plugin is never loaded."""
    import os
    import subprocess

    probe = ("import sys; sys.path.insert(0, 'launch'); import tpu; code = tpu.main(['run', '--config', "
             "'launch/configs/v5p-64.yaml', '--dry-run']); from jax._src.lib import xla_client; "
             "print('libtpu loaded:', xla_client.pjrt_plugin_loaded('tpu')); sys.exit(code)")
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert done.stdout.splitlines()[-1] == "libtpu loaded: False"


def test_v5p_64_slice_counts_cores_and_sweeps_in_turn(capsys):
    [create] = _dry(capsys, "create", "v5p-64.yaml")
    assert "--accelerator-type=v5p-64 --runtime-version=v2-alpha-tpuv5 --reserved" in create
    assert tpu.load(CONFIGS / "v5p-64.yaml").chips == 32
    setup = _dry(capsys, "setup", "v5p-64.yaml")
    assert setup[0].startswith("tar -czf /tmp/scaletrain-llama8b-v5p64.tgz --exclude=./.venv")
    assert "scp /tmp/scaletrain-llama8b-v5p64.tgz 'llama8b-v5p64:~/scaletrain.tgz' --worker=all" in setup[1]
    # TPU VM images have Python 3.10: a 3.12 venv beside it, the pinned stack inside.
    assert ("uv venv --quiet --allow-existing --python 3.12 ~/venv && ~/.local/bin/uv pip install --quiet "
            "--python ~/venv/bin/python -c constraints.txt -e . 'jax[tpu]==0.12.0.1'") in setup[2]
    sweep = _dry(capsys, "sweep", "v5p-64.yaml")
    assert len(sweep) == 5 and all("--worker=all" in line and "nohup" not in line for line in sweep)
    # The sweep's 5 steps plus a warm-up, no checkpoint, and a failed variant does not stop the rest.
    assert ("--set mesh.fsdp=16 --set mesh.tensor=2 --set steps=6 --set checkpoint.every_steps=7 --set "
            "run_dir=gs://my-bucket/scaletrain/llama8b-v5p64/sweep/fsdp=16_tensor=2 ") in sweep[1]
    assert sweep[1].endswith("|| echo 'variant fsdp=16_tensor=2 failed: see ~/llama8b-v5p64-fsdp=16_tensor=2.log'")


def test_two_v6e_256_slices(capsys):
    [create] = _dry(capsys, "create", "v6e-256x2.yaml")
    assert "--node-count=2 --node-prefix=llama70b-v6e --accelerator-type=v6e-256" in create
    coordinator, *runs = _dry(capsys, "run", "v6e-256x2.yaml")
    assert coordinator == ("COORDINATOR=$(gcloud compute tpus tpu-vm describe llama70b-v6e-0 "
                           "'--format=value(networkEndpoints[0].ipAddress)' --project=my-project --zone=us-east5-b)")
    assert len(runs) == 2
    for i, line in enumerate(runs):
        assert line.startswith(f"gcloud compute tpus tpu-vm ssh llama70b-v6e-{i} --worker=all --command=\"")
        # The launcher's shell fills in the coordinator; each slice gets its own id; DCN carries data parallelism.
        assert (f"MEGASCALE_COORDINATOR_ADDRESS=$COORDINATOR:8080 MEGASCALE_NUM_SLICES=2 MEGASCALE_SLICE_ID={i} "
                f"MEGASCALE_PORT=8080") in line
        assert "LIBTPU_INIT_ARGS=--xla_tpu_enable_async_collective_fusion=true" in line
        assert "--set mesh.dcn_data=2" in line
    job = yaml.safe_load(tpu.manifest(tpu.load(CONFIGS / "v6e-256x2.yaml")))
    [replicated] = job["spec"]["replicatedJobs"]
    pod = replicated["template"]["spec"]["template"]["spec"]
    assert replicated["replicas"] == 2 and replicated["template"]["spec"]["parallelism"] == 64
    assert pod["nodeSelector"]["cloud.google.com/gke-tpu-topology"] == "16x16"


def test_the_remote_command_reaches_the_worker_intact():
    """What bash hands gcloud as --command: quotes and $ kept, only $COORDINATOR filled in."""
    import subprocess

    line = tpu.line(["echo", "--command=cd ~/x && A='b c' B=$COORDINATOR:1 C=\"$HOME\" `d`"])
    out = subprocess.run(["bash", "-c", f"COORDINATOR=10.0.0.2; {line}"], capture_output=True, text=True).stdout
    assert out == "--command=cd ~/x && A='b c' B=10.0.0.2:1 C=\"$HOME\" `d`\n"


@pytest.mark.parametrize("change, says", [
    ({"accelerator": "v7z-16"}, "unknown accelerator 'v7z-16'"),
    ({"bucket": None}, "'bucket' is missing"),
    ({"slices": 0}, "slices=0; expected a positive integer"),
    ({"accelerator": "v5p-63"}, "expected an even number"),
    ({"bucket": "/local/dir"}, "is not a gs:// path"),
    ({"capacity": "cheap"}, "capacity 'cheap'"),
    ({"colour": "blue"}, "unknown key(s) colour"),
])
def test_bad_launch_files_exit_2_with_one_error_line(tmp_path, capsys, change, says):
    raw = yaml.safe_load((CONFIGS / "v5e-16.yaml").read_text())
    raw.update(change)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({k: v for k, v in raw.items() if v is not None}))
    assert tpu.main(["create", "--config", str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and says in err and err.count("\n") == 1


def _changed(tmp_path, change: dict, base: str) -> str:
    """The launch file `base` with `change`, written under tmp_path."""
    raw = yaml.safe_load((CONFIGS / base).read_text())
    raw.update(change)
    path = tmp_path / "launch.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def _printed(tmp_path, capsys, command: str, change: dict, base: str = "v5e-16.yaml") -> list[str]:
    assert tpu.main([command, "--config", _changed(tmp_path, change, base), "--dry-run"]) == 0
    return capsys.readouterr().out.splitlines()


def _refused(tmp_path, capsys, command: str, change: dict, base: str = "v5e-16.yaml") -> str:
    """`command --dry-run` for the launch file `base` with `change`: refused before any gcloud command - exit 2,
    nothing on stdout, one `error:` line on stderr and no traceback. Returns that line."""
    assert tpu.main([command, "--config", _changed(tmp_path, change, base), "--dry-run"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err
    return err


def _train(*sets: str, config: str = "configs/llama3_1b.yaml") -> dict:
    return {"train": {"config": config, "set": list(sets)}}


@pytest.mark.parametrize("change, says", [
    (_train(config="configs/nope.yaml"), "the training run (configs/nope.yaml on v5litepod-16): config file"),
    (_train("train.global_bach=32"), "unknown config key 'train.global_bach'; did you mean 'train.global_batch'?"),
    (_train("train.global_batch=many"), "train.global_batch must be a number (integer), got 'many'"),
    ({"accelerator": "v5e-24"}, "accelerator v5e-24 does not exist; v5e sizes are v5e-1, v5e-4, v5e-8, v5e-16, "),
    ({"accelerator": "v5p-7", "zone": "us-east5-a"},
     "accelerator v5p-7 does not exist (v5p types count TensorCores, 2 per chip: expected an even number); v5p "
     "sizes are v5p-8, v5p-16, v5p-32, v5p-64, ..., v5p-17920 (96 sizes"),
    ({"accelerator": "v5p-400", "zone": "us-east5-a"}, "..., v5p-384, v5p-512, ..."),  # the sizes around it
    ({"zone": "us-east5-z"}, "zone us-east5-z has no v5e (no Cloud TPU is there, or the zone does not exist); "
                             "expected one of asia-southeast1-b, "),
    ({"zone": "us-central2-b"}, "zone us-central2-b has no v5e (it has v4); expected one of "),
    # 512 x 4096 tokens without remat: the saved activations alone are hundreds of GB per chip.
    (_train("train.global_batch=512", "remat.policy=none"), "does not fit: the planner predicts "),
    (_train("mesh.fsdp=8"), "ICI mesh degrees multiply to 8 (mesh.fsdp=8) but there are 16 devices per slice"),
    (_train("mesh.tensor=3"), "mesh.fsdp=-1 x mesh.tensor=3 cannot fill 16 devices"),
    # The trainer's own check: 8 sequences cannot be split over 16 chips.
    (_train("train.global_batch=8"), "train.global_batch / train.grad_accum_steps = 8 is not divisible by "
                                     "mesh.data x mesh.fsdp = 16"),
])
def test_what_would_fail_on_the_slice_is_refused_before_any_command(tmp_path, capsys, change, says):
    for command in tpu.SPENDING[:3]:  # create, setup, run: this launch file has no sweep
        assert says in _refused(tmp_path, capsys, command, change)


def test_the_fit_check_names_the_terms_and_the_way_out(tmp_path, capsys):
    err = _refused(tmp_path, capsys, "run", _train("train.global_batch=512", "remat.policy=none"))
    assert err.startswith("error: the training run (configs/llama3_1b.yaml on v5litepod-16) does not fit: the "
                          "planner predicts ")
    assert "GB per chip (parameters " in err and "of 16 GB HBM; expected at most 16 GB: more chips" in err
    assert "python -m scaletrain plan --config configs/llama3_1b.yaml --hardware v5e:4x4" in err


def test_multislice_degrees_are_checked_across_the_slices(tmp_path, capsys):
    err = _refused(tmp_path, capsys, "create", _train("train.global_batch=512", "mesh.dcn_data=3",
                                                      config="configs/llama3_70b.yaml"), base="v6e-256x2.yaml")
    assert "(configs/llama3_70b.yaml on 2 x v6e-256): DCN mesh degrees multiply to 3" in err


def test_sweep_files_and_variants_are_checked(tmp_path, capsys):
    sweeps = tmp_path / "sweeps"
    sweeps.mkdir()
    missing = {"sweep": str(sweeps / "nope.yaml")}
    # create and setup rent the slice the sweep will run on: its sweep file is checked then too.
    for command in ("sweep", "create", "setup"):
        assert "sweep file" in _refused(tmp_path, capsys, command, missing, base="v5p-64.yaml")
    assert _printed(tmp_path, capsys, "run", missing, base="v5p-64.yaml")  # a run needs no sweep
    bad, base = sweeps / "bad.yaml", {"base": str(ROOT / "configs" / "llama3_8b.yaml"), "hardware": "v5p:2x4x4"}
    bad.write_text(yaml.safe_dump({**base, "variants": [{"mesh.fsdp": 32}, {"mesh.fsdq": 16}]}))
    err = _refused(tmp_path, capsys, "sweep", {"sweep": str(bad)}, base="v5p-64.yaml")
    assert "sweep variant fsdq=16 (configs/llama3_8b.yaml on v5p-64): unknown config key 'mesh.fsdq'" in err
    bad.write_text(yaml.safe_dump({**base, "variants": [{"mesh.fsdp": 16}]}))
    err = _refused(tmp_path, capsys, "sweep", {"sweep": str(bad)}, base="v5p-64.yaml")
    assert "ICI mesh degrees multiply to 16" in err
    # A variant predicted not to fit is measured all the same: the sweep reports it and goes on.
    big = sweeps / "big.yaml"
    big.write_text(yaml.safe_dump({**base, "variants": [{"remat.policy": "none"}]}))
    assert len(_printed(tmp_path, capsys, "sweep", {"sweep": str(big)}, base="v5p-64.yaml")) == 1


def test_status_logs_and_delete_are_never_refused(tmp_path, capsys):
    """Checks guard what spends money; a slice created before Google's zone list changed can always be seen and
    deleted."""
    for command in ("status", "logs", "delete"):
        [line] = _printed(tmp_path, capsys, command, {"zone": "us-east5-z"})
        assert line.startswith("gcloud compute tpus ") and "--zone=us-east5-z" in line


def test_every_accelerator_type_is_a_slice_the_planner_knows():
    """hardware.yaml's cloud_tpu shapes name their sizes (v5p-64: 32 chips, 2x4x4) and parse as topologies."""
    from scaletrain.facts import hardware

    for chip in hardware.cloud_tpus():
        slices = hardware.cloud_slices(chip)
        assert [s.chips for s in slices] == sorted({s.chips for s in slices})  # smallest first, one per size
        for s in slices:
            assert hardware.accelerator_type(s.accelerator) == s
            assert hardware.topology(s.hardware()).dims == s.dims
    assert hardware.accelerator_type("v5p-64").dims == (2, 4, 4)
    assert hardware.accelerator_type("v5e-16") == hardware.accelerator_type("v5litepod-16")
    assert hardware.topology(hardware.accelerator_type("v5p-1408").hardware(2)).num_chips == 2 * 704


def test_hosts_and_the_local_dry_run(capsys):
    assert [tpu.load(CONFIGS / f).hosts for f in ("v5e-16.yaml", "v5p-64.yaml", "v6e-256x2.yaml")] == [4, 8, 64]
    assert tpu.main(["run", "--config", str(CONFIGS / "v5e-16.yaml"), "--local", "2", "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and all("train.py --config configs/llama3_1b.yaml" in x for x in lines)
    assert all("--cpu-devices 4 --coordinator localhost:" in x for x in lines)
    assert lines[0].endswith("--num-processes 2 --process-id 0") and lines[1].endswith("--process-id 1")


def _records(text: str) -> list[dict]:
    """metrics.jsonl's step records (events - a straggler named on a loaded machine - aside)."""
    return [r for r in map(json.loads, text.splitlines()) if "event" not in r]


@pytest.fixture(scope="module")
def local_launch(tmp_path_factory, bucket):
    """A launch file for the tiny model whose bucket is the local Cloud Storage server's. Saved every 4 steps: the
    preempted run's save is its SIGTERM's, the resumed one's at 4 and at the end."""
    sets = tiny_overrides("unused", steps=6, **{"mesh.fsdp": -1, "checkpoint.every_steps": 4})
    path = tmp_path_factory.mktemp("launch") / "local.yaml"
    path.write_text(yaml.safe_dump({
        "project": "p", "zone": "z", "accelerator": "v5e-8", "bucket": bucket, "run_name": "local",
        "train": {"config": "configs/llama_tiny.yaml", "set": [s for s in sets if not s.startswith("run_dir=")]}}))
    return path


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, local_launch) -> list[dict]:
    """The run command's training command, as 2 CPU processes x 4 devices joined by jax.distributed, into a local
    run directory: the metrics records of a run nobody interrupted."""
    run_dir = tmp_path_factory.mktemp("run")
    assert tpu.main(["run", "--config", str(local_launch), "--local", "2", "--run-dir", str(run_dir)]) == 0
    return _records((run_dir / "metrics.jsonl").read_text())


def test_run_locally_as_two_processes(uninterrupted):
    assert [r["step"] for r in uninterrupted] == [1, 2, 3, 4, 5, 6]


def test_a_preempted_run_resumes_from_the_bucket(local_launch, uninterrupted, bucket, capfd):
    """Spot capacity reclaimed: worker 0 gets SIGTERM after step 2, both processes agree to checkpoint into the
    bucket and exit 0; `run` again resumes from the bucket's newest checkpoint and ends exactly where the
    uninterrupted run ends."""
    from etils import epath

    run_dir = f"{bucket}/preempted"
    launch = tpu.load(local_launch)
    commands = tpu.local(launch, 2, run_dir)
    worker_0 = commands[0]
    at = worker_0.index("train.py")
    commands[0] = [*worker_0[:at], str(ROOT / "tests" / "faults.py"), "sigterm", "2", *worker_0[at + 1:]]
    assert tpu.run_local(launch, commands) == 0
    assert "preempted: checkpointed at step" in capfd.readouterr().out
    saved = sorted(int(p.name) for p in epath.Path(f"{run_dir}/checkpoints").iterdir() if p.name.isdigit())
    assert saved and max(saved) < 6

    assert tpu.main(["run", "--config", str(local_launch), "--local", "2", "--run-dir", run_dir]) == 0
    assert f"resumed at step {max(saved)}" in capfd.readouterr().out
    records = _records(epath.Path(f"{run_dir}/metrics.jsonl").read_text())
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in records] == [r["loss"] for r in uninterrupted]
    assert epath.Path(f"{run_dir}/config.yaml").exists()
    assert len(list(epath.Path(f"{run_dir}/tb").glob("events.out.tfevents.*"))) == 2  # one per attempt


def test_a_run_dir_in_a_missing_bucket_is_one_error_line(bucket, capfd):
    sets = tiny_overrides("gs://no-such-bucket/run", steps=1)
    result = run_main(["--config", "configs/llama_tiny.yaml", "--cpu-devices", "8",
                       *(a for s in sets for a in ("--set", s))], capfd)
    assert result.returncode == 2, result.stderr
    [line] = [x for x in result.stderr.splitlines() if x.strip()]
    # The bucket is probed before anything is written (storage.probe): its absence said at once.
    assert line.startswith("error: gs://no-such-bucket/run: there is no bucket gs://no-such-bucket")


def test_a_pipeline_across_slices_is_launched_as_set(tmp_path, capsys):
    """Stages across the two slices (mesh.dcn_pipeline=2) pass the trainer's checks on the planned slices, and
    the launcher, given a DCN degree, adds none of its own."""
    launch = _changed(tmp_path, _train("train.global_batch=2048", "data.seq_len=4096", "mesh.dcn_pipeline=2",
                                       "pipeline.microbatches=8", "train.grad_accum_steps=1", "remat.policy=full",
                                       "model.attention=xla",
                                       config="configs/llama3_70b.yaml"), "v6e-256x2.yaml")
    assert tpu.main(["run", "--config", launch, "--dry-run"]) == 0
    runs = capsys.readouterr().out.splitlines()[1:]
    assert len(runs) == 2 and all("--set mesh.dcn_pipeline=2" in r and "dcn_data" not in r for r in runs)
