"""The CPU's measured matmul peak: the highest measurement is kept, a busy machine's low one never replaces it,
and a run can say which peak it used. The measuring function is replaced: no big matmuls here."""

import json
import time

import pytest

from scaletrain.facts import hardware


@pytest.fixture
def cache(tmp_path, monkeypatch):
    path = tmp_path / "cpu_peak.json"
    monkeypatch.setattr(hardware, "_CACHE", path)
    monkeypatch.setattr(hardware, "_SEEN", {})
    monkeypatch.delenv("SCALETRAIN_MEASURE_PEAK", raising=False)
    return path


def _measuring(monkeypatch, *values):
    readings = list(values)
    monkeypatch.setattr(hardware, "measure_cpu_peak", lambda: readings.pop(0))
    return readings


def test_lower_measurement_never_replaces_higher(cache, monkeypatch):
    _measuring(monkeypatch, 170e9, 94e9, 185e9)
    first = hardware.cpu_peak_measured()
    assert (first.value, first.now) == (170e9, 170e9)
    busy = hardware.cpu_peak_measured(recheck=True)  # the machine was busy: reads low
    assert busy.value == 170e9 and busy.now == 94e9 and busy.at == first.at
    assert "lower, so the cached best stands" in busy.describe()
    assert hardware.cpu_peak_measured(recheck=True).value == 185e9  # a higher one replaces it
    assert next(iter(json.loads(cache.read_text()).values()))["value"] == 185e9


def test_cached_peak_is_used_and_named(cache, monkeypatch):
    _measuring(monkeypatch, 170e9)
    assert "measured now" in hardware.cpu_peak_measured().describe()
    monkeypatch.setattr(hardware, "_SEEN", {})  # a later process
    monkeypatch.setattr(hardware, "measure_cpu_peak", lambda: pytest.fail("measured although cached"))
    later = hardware.cpu_peak_measured()
    assert later.value == 170e9 and later.now is None
    assert "170 GFLOP/s, cached (measured " + time.strftime("%Y-%m-%d") in later.describe()


def test_old_or_flagged_cache_is_checked_again(cache, monkeypatch):
    key = f"{hardware.platform.processor() or hardware.platform.machine()}/{hardware.os.cpu_count()}"
    cache.write_text(json.dumps({key: 94e9}))  # a cache written before times were kept
    _measuring(monkeypatch, 160e9, 150e9)
    assert hardware.cpu_peak() == 160e9
    entry = json.loads(cache.read_text())[key]
    entry["checked"] -= hardware.RECHECK_AFTER_S + 1  # a day later
    cache.write_text(json.dumps({key: entry}))
    monkeypatch.setattr(hardware, "_SEEN", {})
    assert hardware.cpu_peak_measured().now == 150e9  # measured again; still the best stands
    monkeypatch.setattr(hardware, "_SEEN", {})
    readings = _measuring(monkeypatch, 190e9)
    monkeypatch.setenv("SCALETRAIN_MEASURE_PEAK", "1")
    assert hardware.cpu_peak() == 190e9 and not readings


def test_best_of_repeats(monkeypatch):
    class Call:
        def block_until_ready(self):
            return self

    # warm-up, then four timed calls of 0.3, 0.1, 0.5, 0.2 s: the fastest counts.
    clock = iter([0.0, 0.3, 1.0, 1.1, 2.0, 2.5, 3.0, 3.2])
    monkeypatch.setattr(hardware.time, "perf_counter", lambda: next(clock))
    assert hardware._best_seconds(lambda _: Call(), None, repeats=4) == pytest.approx(0.1)


def test_peak_note_override_and_cpu(cache, monkeypatch):
    import jax

    _measuring(monkeypatch, 175e9)
    assert "2.5e+11 x 8 devices" in hardware.peak_note(jax.devices(), 2.5e11)
    note = hardware.peak_note(jax.devices())
    assert "matmul peak: 175 GFLOP/s, measured now" in note
