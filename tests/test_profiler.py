"""`train.profile_start` / `train.profile_steps`: a jax.profiler trace of those steps in the run directory."""

from tests.conftest import run_main, tiny_overrides


def _set(overrides):
    return ["--config", "configs/llama_tiny.yaml"] + [arg for o in overrides for arg in ("--set", o)]


def test_the_chosen_steps_are_traced_into_the_run_directory(tmp_path, capfd):
    """In this process (conftest.run_main), as in one of its own, without its start."""
    run = tmp_path / "run"
    proc = run_main(_set(tiny_overrides(run, steps=4) + ["train.profile_start=2", "train.profile_steps=2"]), capfd)
    assert proc.returncode == 0, proc.stderr[-2000:]
    traces = list((run / "profile").rglob("*.xplane.pb"))  # TensorBoard's profile plugin
    assert len(traces) == 1 and traces[0].stat().st_size > 0
    assert list((run / "profile").rglob("*.trace.json.gz"))  # Perfetto
    assert "profile of steps 2-3 written to" in proc.stderr


def test_a_trace_needs_a_first_step(tmp_path, capfd):
    proc = run_main(_set(tiny_overrides(tmp_path / "run") + ["train.profile_steps=2"]), capfd)
    assert proc.returncode == 2 and "error: train.profile_steps=2 needs train.profile_start >= 1" in proc.stderr
