"""`python -m scaletrain data reference`: a prepared preference dataset copied with each token's reference
log-probability stored beside it (`ref_logprobs`), computed once by a run directory's model. DPO then trains from
it with dpo.reference=precomputed: no reference copy on the devices and no reference forward pass in the step
(TRL's precompute_ref_log_probs). The log-probs are the step's own (Setup.logprobs: the same model code, mesh and
dtypes as dpo.reference copy).

Each pair is laid out as training lays it out (one pair a row, packing.layout) in rows as long as the longest pair,
rounded up to ROW_MULTIPLE; a sequence's value at token i is the log-prob of token i given those before it (its
first token's 0), which training places on the position that predicts it, as it places the loss mask. The copy is
written under a temporary name and renamed when complete, as `data prepare` writes.
"""

from __future__ import annotations

import json
import os
import shutil

import jax
import numpy as np

from scaletrain.data import examples, packing
from scaletrain.data import loader as data
from scaletrain.data.prepare import RECORDS_PER_SHARD, ExampleWriter
from scaletrain.errors import UserError

EXTRA = "ref_logprobs"
ROW_MULTIPLE = 128


def main(run_dir: str, source: str, out: str, rows: int, overrides: list[str]) -> int:
    from scaletrain.tools import inference
    from scaletrain.train import init_from, trainer

    meta = _preference_meta(source)
    longest = max(int(np.load(os.path.join(source, s["lengths"])).sum(axis=1).max(initial=0))
                  for s in meta["splits"].values() if s["examples"])
    seq_len = -(-longest // ROW_MULTIPLE) * ROW_MULTIPLE
    cfg = inference.load_config(run_dir, [f"data.seq_len={seq_len}", f"train.global_batch={rows}",
                                          "train.objective=lm", "data.format=text", "data.source=synthetic",
                                          "train.grad_accum_steps=1", *overrides], one_device=False)
    if jax.process_count() > 1:
        raise UserError("data reference runs on one host (its local devices); run it there, then copy the dataset")
    setup = trainer.build(cfg)
    step, params = init_from.restore_run_params(run_dir, setup, "data reference")
    params = setup.from_disk(params)
    pad = meta["tokenizer"]["eos_id"]
    final = os.path.abspath(out)
    partial = f"{final}.incomplete-{os.getpid()}"
    os.makedirs(partial)
    try:
        splits = {}
        for name, info in meta["splits"].items():
            splits[name] = _split(setup, params, source, meta, name, partial, seq_len, rows, pad) if info[
                "examples"] else info
        shutil.copytree(os.path.join(source, "tokenizer"), os.path.join(partial, "tokenizer"))
        with open(os.path.join(partial, data.METADATA), "w") as f:
            json.dump({**meta, "extras": [EXTRA], "splits": splits,
                       "reference": {"run_dir": run_dir, "step": step}}, f, indent=1)
        if os.path.isdir(final):
            os.rmdir(final)  # the command line let it through only empty
        os.rename(partial, final)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    pairs = sum(s["examples"] for s in splits.values())
    print(f"wrote {out}: {source} with the reference log-probs of step {step} of {run_dir} ({pairs} pairs); train "
          f"from it with dpo.reference=precomputed")
    return 0


def _preference_meta(source: str) -> dict:
    path = os.path.join(source, data.METADATA)
    if not os.path.isfile(path):
        raise UserError(f"--data {source}: not a prepared dataset (no {data.METADATA}); prepare it with `data "
                        f"prepare --format preference`")
    with open(path) as f:
        meta = json.load(f)
    if data.dataset_format(meta) != "preference":
        raise UserError(f"--data {source}: a {data.dataset_format(meta)} dataset; reference log-probs are DPO's, of "
                        f"a preference dataset (`data prepare --format preference`)")
    if EXTRA in meta["extras"]:
        raise UserError(f"--data {source} carries reference log-probs already (of {meta.get('reference')})")
    return meta


def _split(setup, params, source: str, meta: dict, name: str, folder: str, seq_len: int, rows: int,
           pad: int) -> dict:
    """One split's pairs with their reference log-probs, written to `folder`; its metadata entry."""
    records = data.ExampleRecords(source, meta, name)
    writer = ExampleWriter(folder, name, np.dtype(meta["token_dtype"]), 2, RECORDS_PER_SHARD, (EXTRA,))
    for start in range(0, len(records), rows):
        pairs = [records[i] for i in range(start, min(start + rows, len(records)))]
        laid = [packing.layout(list(pair), seq_len, pad, train_all=False) for pair in pairs]
        laid += [laid[-1]] * (rows - len(laid))  # the last batch filled up; the copies are not read
        batch = {k: np.stack([row[k] for row in laid]) for k in laid[0]}
        logprobs = np.asarray(jax.device_get(setup.logprobs(params, setup.put_batch(batch))))
        if setup.seq_order is not None:  # back from the context axis's layout to sequence order
            logprobs = logprobs[:, np.argsort(setup.seq_order)]
        for pair, row in zip(pairs, logprobs):
            writer.add(_with_logprobs(pair, row))
    return writer.close()


def _with_logprobs(pair: examples.Example, row: np.ndarray) -> examples.Example:
    """The pair's sequences with each token's log-prob given those before it, read off a row laid out as
    packing.layout lays it (position t holds the log-prob of the token at t + 1 of the same sequence)."""
    out, at = [], 0
    for s in pair:
        values = np.zeros(len(s), np.float32)
        values[1:] = row[at: at + len(s) - 1]
        out.append(examples.Sequence(s.tokens, s.trained, {EXTRA: values}))
        at += len(s)
    return tuple(out)
