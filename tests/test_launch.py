"""launch/tpu.py: the exact gcloud commands for a v5e-16 slice, a v5p-64 slice and a 2 x v6e-256 multislice
(`--dry-run`), bad launch files refused in one line, the GKE JobSet, and the `run` path as 2 local processes."""

import importlib.util
import json
import sys

import pytest
import yaml

from tests.conftest import ROOT, run_cli, tiny_overrides

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


def test_v5p_64_slice_counts_cores_and_sweeps_in_turn(capsys):
    [create] = _dry(capsys, "create", "v5p-64.yaml")
    assert "--accelerator-type=v5p-64 --runtime-version=v2-alpha-tpuv5 --reserved" in create
    assert tpu.load(CONFIGS / "v5p-64.yaml").chips == 32
    setup = _dry(capsys, "setup", "v5p-64.yaml")
    assert setup[0].startswith("tar -czf /tmp/scaletrain-llama8b-v5p64.tgz --exclude=./.venv")
    assert "scp /tmp/scaletrain-llama8b-v5p64.tgz 'llama8b-v5p64:~/scaletrain.tgz' --worker=all" in setup[1]
    # TPU VM images have Python 3.10: a 3.11 venv beside it, the pinned stack inside.
    assert ("uv venv --quiet --allow-existing --python 3.11 ~/venv && ~/.local/bin/uv pip install --quiet "
            "--python ~/venv/bin/python -c constraints.txt -e . 'jax[tpu]==0.10.2'") in setup[2]
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


def test_hosts_and_the_local_dry_run(capsys):
    assert [tpu.load(CONFIGS / f).hosts for f in ("v5e-16.yaml", "v5p-64.yaml", "v6e-256x2.yaml")] == [4, 8, 64]
    assert tpu.main(["run", "--config", str(CONFIGS / "v5e-16.yaml"), "--local", "2", "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and all("train.py --config configs/llama3_1b.yaml" in x for x in lines)
    assert all("--cpu-devices 4 --coordinator localhost:" in x for x in lines)
    assert lines[0].endswith("--num-processes 2 --process-id 0") and lines[1].endswith("--process-id 1")


def _records(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines()]


@pytest.fixture(scope="module")
def local_launch(tmp_path_factory, bucket):
    """A launch file for the tiny model whose bucket is the local Cloud Storage server's."""
    sets = tiny_overrides("unused", steps=6, **{"mesh.fsdp": -1, "checkpoint.every_steps": 2})
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


def test_a_run_dir_in_a_missing_bucket_is_one_error_line(bucket):
    sets = tiny_overrides("gs://no-such-bucket/run", steps=1)
    result = run_cli(["--config", "configs/llama_tiny.yaml", "--cpu-devices", "8",
                      *(a for s in sets for a in ("--set", s))])
    assert result.returncode == 2, result.stderr
    [line] = [x for x in result.stderr.splitlines() if x.strip()]
    assert line.startswith("error: run_dir 'gs://no-such-bucket/run': cannot write to the bucket (no such bucket)")
