"""The input pipeline of a prepared dataset: throughput against the tiny config's step, and host memory while
streaming through a corpus far larger than the process.

    python benchmarks/input_pipeline.py [--gb 1.5] [--dir /tmp/scaletrain_input_bench] [--batches 400]
                                        [--stream-tokens 1e9]

Writes --gb GB of generated text (JSONL) into --dir once and prepares it with the byte tokenizer (timed); both are
reused on later runs. Then, at configs/llama_tiny.yaml's shapes (global batch 16 x seq 256, all rows on this one
process) with data.workers 0 and 2:
  - batches/s and tokens/s of the iterator alone (--batches batches after 20 of warm-up);
  - the tiny config's train step on 8 simulated CPU devices fed by it: the median step, and the median time the
    step loop waits in next() for its batch;
and finally the resident memory (this process and its data workers) sampled while reading --stream-tokens tokens
in batches of 64 windows of 4096, shuffled over the whole dataset. Results belong in docs/data.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scaletrain import config, runtime  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "llama_tiny.yaml"


def write_corpus(folder: Path, gigabytes: float) -> None:
    """Documents of 2-20 KB of words drawn from a Zipf distribution over 20,000 generated words, 100 MB a file."""
    import numpy as np

    rng = np.random.default_rng(0)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    words = np.array(["".join(rng.choice(letters, rng.integers(2, 10))) for _ in range(20_000)])
    folder.mkdir(parents=True)
    total, part = 0, 0
    while total < gigabytes * 1e9:
        with open(folder / f"part-{part:04d}.jsonl", "w") as f:
            written = 0
            while written < 100e6:
                ids = np.minimum(rng.zipf(1.3, rng.integers(300, 3000)), len(words)) - 1
                line = json.dumps({"text": " ".join(words[ids])}) + "\n"
                f.write(line)
                written += len(line)
        total += written
        part += 1


def rss_mb(pid: int | None = None) -> float:
    """Resident memory of a process and its descendants (data workers), MB."""
    pid = pid or os.getpid()
    with open(f"/proc/{pid}/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024
    # Grain starts its workers from threads other than the main one: every thread's children are counted.
    children = [c for task in Path(f"/proc/{pid}/task").iterdir() for c in (task / "children").read_text().split()]
    return rss + sum(rss_mb(int(c)) for c in children)


def iterator_rate(cfg, workers: int, batches: int) -> dict:
    from scaletrain.data import loader as data

    it = data.BatchIterator(data.make_dataset(cfg), cfg.train.global_batch, workers=workers)
    for _ in range(20):  # the workers start, the page cache warms
        next(it)
    t0 = time.perf_counter()
    for _ in range(batches):
        next(it)
    seconds = time.perf_counter() - t0
    it.close()
    return {"batches_per_s": batches / seconds,
            "tokens_per_s": batches * cfg.train.global_batch * cfg.data.seq_len / seconds}


def fed_step(cfg, workers: int, steps: int = 40) -> dict:
    """The tiny train step fed by the pipeline: each step waited for, so that next() sees what one step leaves it."""
    import jax

    from scaletrain.data import loader as data
    from scaletrain.train import trainer

    setup = trainer.build(cfg)
    step = setup.step.lower(*setup.abstract_args()).compile()
    state = setup.init(jax.random.PRNGKey(0))
    it = data.make_iterator(cfg, setup.batch_sharding, workers=workers)
    waits, times, no_ceiling = [], [], setup.loss_ceiling()
    for i in range(steps + 10):
        t0 = time.perf_counter()
        batch = next(it)
        t1 = time.perf_counter()
        state, metrics = step(state, setup.put_batch(batch), no_ceiling)
        jax.block_until_ready(metrics)
        if i >= 10:  # after the workers' start and the first steps
            waits.append(t1 - t0)
            times.append(time.perf_counter() - t0)
    it.close()
    return {"median_step_s": statistics.median(times), "median_wait_s": statistics.median(waits),
            "max_wait_s": max(waits)}


def streaming_rss(path: str, workers: int, tokens: int) -> dict:
    """Resident memory sampled while reading `tokens` tokens of shuffled 4096-token windows."""
    from scaletrain.data import loader as data

    cfg = config.load(None, ["data.source=prepared", f"data.path={path}", "data.seq_len=4096",
                             "train.global_batch=64", "model.vocab_size=384"])
    it = data.BatchIterator(data.make_dataset(cfg), 64, workers=workers)
    batches = tokens // (64 * 4096)
    samples, t0 = [], time.perf_counter()
    for i in range(batches):
        next(it)
        if i % max(batches // 20, 1) == 0:
            samples.append(rss_mb())
    seconds = time.perf_counter() - t0
    it.close()
    return {"batches": batches, "tokens_per_s": batches * 64 * 4096 / seconds, "rss_mb_first": samples[0],
            "rss_mb_min": min(samples), "rss_mb_max": max(samples), "rss_mb_last": samples[-1]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gb", type=float, default=1.5, help="GB of generated text")
    p.add_argument("--dir", default="/tmp/scaletrain_input_bench")
    p.add_argument("--batches", type=int, default=400, help="batches timed at the tiny config's shapes")
    p.add_argument("--stream-tokens", type=float, default=1e9, help="tokens read while sampling the memory")
    args = p.parse_args()
    runtime.configure(8)
    from scaletrain.data import prepare

    folder = Path(args.dir)
    results = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"}
    if not (folder / "corpus").exists():
        write_corpus(folder / "corpus", args.gb)
    text_bytes = sum(f.stat().st_size for f in (folder / "corpus").iterdir())
    dataset = folder / "prepared"
    if not (dataset / "metadata.json").exists():
        t0 = time.perf_counter()
        prepare.main("bytes", [str(folder / "corpus")], str(dataset), "text", 0.0, 2)
        results["prepare_s"] = time.perf_counter() - t0
        results["prepare_mb_per_s"] = text_bytes / 1e6 / results["prepare_s"]
    meta = json.loads((dataset / "metadata.json").read_text())
    tokens = meta["splits"]["train"]["tokens"]
    results.update(corpus_gb=text_bytes / 1e9, tokens=tokens,
                   dataset_gb=sum(f.stat().st_size for f in dataset.iterdir() if f.is_file()) / 1e9)
    print(json.dumps(results), flush=True)
    cfg = config.load(TINY, ["data.source=prepared", f"data.path={dataset}"])
    for workers in (0, 2):
        rate = iterator_rate(cfg, workers, args.batches)
        print(json.dumps({"workers": workers, "iterator": rate, "tiny_step": fed_step(cfg, workers)}), flush=True)
    for workers in (0, 2):
        streaming = streaming_rss(str(dataset), workers, int(min(args.stream_tokens, tokens)))
        print(json.dumps({"workers": workers, "streaming": streaming}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
