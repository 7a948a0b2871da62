"""`python -m scaletrain COMMAND`: the command-line entry point. Bad input: one `error:` line, exit 2."""

from __future__ import annotations

import argparse
import os
import sys

from scaletrain.errors import UserError

EXIT_USAGE = 2
EXIT_DOES_NOT_FIT = 3  # `compile`: the step needs more HBM per device than the chip has


class Parser(argparse.ArgumentParser):
    """argparse with its own usage errors as one `error:` line, exit status 2."""

    def error(self, message: str):
        print(f"error: {message}", file=sys.stderr)
        sys.exit(EXIT_USAGE)


def _step(text: str) -> int:
    """--step, checked as it is parsed: before a command reads a run directory, which may be in a bucket."""
    try:
        step = int(text)
    except ValueError:
        step = -1
    if step < 0:
        raise argparse.ArgumentTypeError(f"expected a checkpoint's step, an integer >= 0; got '{text}'")
    return step


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="YAML config, e.g. configs/llama_tiny.yaml")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key with a YAML scalar (repeatable), e.g. --set mesh.fsdp=4")


def parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m scaletrain", description="Train Llama-style models on TPU slices with JAX.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)
    train = sub.add_parser("train", help="train (or resume) a model")
    _add_config_args(train)
    train.add_argument("--cpu-devices", type=int, default=None, metavar="N",
                       help="simulate N devices on the CPU (ignored where an accelerator is present)")
    train.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                       help="join a multi-process job coordinated here (with --num-processes, --process-id); "
                            "on a multi-host Cloud TPU slice this is detected without flags")
    train.add_argument("--num-processes", type=int, default=None, metavar="N")
    train.add_argument("--process-id", type=int, default=None, metavar="I")
    st = sub.add_parser("status", help="where a run is: step, ETA, checkpoint, lock, loss curves, goodput (read only)")
    st.add_argument("run_dir", help="a run directory, local or gs://")
    st.add_argument("--json", action="store_true", help="print the report as JSON")
    st.add_argument("--plot", default=None, metavar="PNG",
                    help="where the loss curves go (default: RUN-status.png in the current directory)")
    ckpt = sub.add_parser("ckpt", help="look into a run's checkpoints")
    ckpt_sub = ckpt.add_subparsers(dest="ckpt_command", required=True, parser_class=Parser)
    inspect = ckpt_sub.add_parser("inspect", help="print a checkpoint's metadata")
    inspect.add_argument("run_dir", help="a run directory, its checkpoints/ folder or one step's folder")
    inspect.add_argument("--step", type=_step, default=None, help="which checkpoint (default: the newest)")
    inspect.add_argument("--json", action="store_true", help="print the metadata as JSON")
    convert = sub.add_parser("convert", help="rewrite a run's checkpoint")
    convert_sub = convert.add_subparsers(dest="convert_command", required=True, parser_class=Parser)
    fold = convert_sub.add_parser("fold-norms", help="fold the RMSNorm gains into the following weights")
    fold.add_argument("--run-dir", required=True)
    fold.add_argument("--out", required=True, help="the new run directory (new or empty, in an existing folder)")
    from_hf = convert_sub.add_parser("from-hf", help="a Hugging Face checkpoint (config.json + safetensors) to a "
                                     "run directory")
    from_hf.add_argument("--hf-dir", required=True, help="a folder with config.json, *.safetensors and the tokenizer")
    from_hf.add_argument("--out", required=True, help="the new run directory (new or empty, in an existing folder)")
    to_hf = convert_sub.add_parser("to-hf", help="a run's checkpoint to a Hugging Face folder (safetensors)")
    to_hf.add_argument("--run-dir", required=True)
    to_hf.add_argument("--out", required=True, help="the new folder (new or empty, in an existing folder)")
    to_hf.add_argument("--step", type=_step, default=None, help="which checkpoint (default: the newest)")
    to_hf.add_argument("--peft", action="store_true", help="a LoRA run's adapters as a PEFT adapter folder "
                       "(adapter_model.safetensors + adapter_config.json), not merged into the weights")
    logits = sub.add_parser("logits", help="float32 logits of a checkpoint for token ids")
    logits.add_argument("--run-dir", required=True)
    logits.add_argument("--step", type=_step, default=None, help="which checkpoint (default: the newest)")
    logits.add_argument("--tokens", required=True, help="int token ids [batch, seq], .npy")
    logits.add_argument("--out", required=True, help="a new .npy file for the logits [batch, seq, vocab]")
    logits.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override the run's config, e.g. --set model.norm=fused")
    gen = sub.add_parser("generate", help="continue a prompt with a run's checkpoint (KV-cached decoding)")
    gen.add_argument("--run-dir", required=True)
    gen.add_argument("--step", type=_step, default=None, help="which checkpoint (default: the newest)")
    gen.add_argument("--prompt", required=True, help="the text to continue")
    gen.add_argument("--max-new-tokens", type=int, default=64, metavar="N")
    gen.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0: greedy (the default)")
    gen.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling: the smallest set of "
                     "tokens whose probabilities sum to P (1: all)")
    gen.add_argument("--seed", type=int, default=0, help="the sampling seed")
    gen.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="override the run's config, e.g. --set model.norm=fused")
    data = sub.add_parser("data", help="prepare training data")
    data_sub = data.add_subparsers(dest="data_command", required=True, parser_class=Parser)
    prepare = data_sub.add_parser("prepare", help="tokenize a corpus into ArrayRecord shards (data.source: prepared)")
    prepare.add_argument("--tokenizer", required=True, help="bytes, a tokenizer.json, a folder holding one, or a "
                         "SentencePiece .model")
    prepare.add_argument("--input", required=True, nargs="+", metavar="PATH_OR_GLOB",
                         help=".txt, .jsonl or .parquet files, folders or globs, local or gs://")
    prepare.add_argument("--out", required=True, help="the new dataset folder (new or empty)")
    prepare.add_argument("--format", default="text",
                         help="what the inputs hold: documents (text, the default), or JSONL/Parquet rows of "
                              "conversations (chat: messages), prompts and completions (prompt_completion) or "
                              "preference pairs (preference: prompt, chosen, rejected); docs/post-training.md")
    prepare.add_argument("--chat-template", default="", metavar="PATH",
                         help="a .jinja chat template to render messages with (default: the tokenizer's)")
    prepare.add_argument("--field", default="text", help="the text field of JSONL and Parquet records (--format text)")
    prepare.add_argument("--eval-fraction", type=float, default=0.0, metavar="F",
                         help="the fraction of documents held out for evaluation")
    prepare.add_argument("--workers", type=int, default=None, metavar="N",
                         help="tokenizing processes (default: one per core)")
    reference = data_sub.add_parser("reference", help="a prepared preference dataset with DPO's reference "
                                    "log-probs stored (dpo.reference: precomputed)")
    reference.add_argument("--run-dir", required=True, help="the reference model's run (its newest checkpoint)")
    reference.add_argument("--data", required=True, help="a dataset `data prepare --format preference` wrote")
    reference.add_argument("--out", required=True, help="the new dataset folder (new or empty)")
    reference.add_argument("--rows", type=int, default=0, metavar="N",
                           help="pairs per forward pass (default: one per device)")
    reference.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                           help="override the run's config, e.g. --set mesh.fsdp=8")
    plan = sub.add_parser("plan", help="predict step time, memory and communication for a mesh (no compile)")
    _add_config_args(plan)
    plan.add_argument("--hardware", required=True, help="chip and slice, e.g. v5p:16x16x16 or v5e:16x16")
    plan.add_argument("--json", action="store_true", help="print the prediction as JSON")
    plan.add_argument("--tokens", type=float, default=None, metavar="N",
                      help="training tokens (e.g. 15e12): adds the run's FLOPs, days and chip-hours, and the fewest "
                           "chips it fits on")
    plan.add_argument("--mfu", type=float, default=None, metavar="M",
                      help="with --tokens: the model FLOPs utilisation to assume (0 < M <= 1); default: the "
                           "predicted step time's")
    plan.add_argument("--across-slices", action="store_true",
                      help="with SLICESxCHIP:DIMS: data parallelism, FSDP and every pipeline schedule across the "
                           "slices planned side by side, the winner, and the DCN bandwidth and slice counts where "
                           "it changes (docs/pipeline.md)")
    comp = sub.add_parser("compile", help="compile the train step ahead of time for a TPU topology")
    _add_config_args(comp)
    comp.add_argument("--topology", required=True, help="a TPU topology, e.g. v5e:4x4, v5p:4x4x4, v6e:8x8")
    comp.add_argument("--json", action="store_true", help="print the result as JSON")
    comp.add_argument("--no-loop-correction", action="store_true",
                      help="skip the two small compiles that correct XLA's estimate for loops (faster)")
    comp.add_argument("--cpu-devices", type=int, default=None, metavar="N",
                      help="with --topology cpu:N: simulate N devices on this CPU")
    sweep = sub.add_parser("sweep", help="plan, compile and run every variant of a sweep file")
    sweep.add_argument("sweep_file", metavar="SWEEP.yaml", help="e.g. configs/sweeps/tiny_cpu.yaml")
    sweep.add_argument("--out", required=True, help="directory for results.jsonl, summary.md, sweep.png; "
                       "an earlier run of the same sweep there is resumed")
    sweep.add_argument("--cpu-devices", type=int, default=None, metavar="N",
                       help="simulate N devices on the CPU for the run stage (ignored where an accelerator is present)")
    tune = sub.add_parser("tune", help="the fastest configuration that fits a TPU topology: every layout, remat "
                          "policy and offload planned, the best compiled ahead of time (docs/tune.md)")
    _add_config_args(tune)
    tune.add_argument("--topology", required=True, help="a TPU topology, e.g. v5p:4x4x2, 2xv5p:4x4x4; or cpu:N")
    tune.add_argument("--budget", type=int, default=4, metavar="N",
                      help="candidates compiled ahead of time, the best N by the plan (default 4; each is three "
                           "compiles with the loop correction)")
    tune.add_argument("--out", required=True, help="directory for best.yaml, tune.md, plan.jsonl and the "
                      "compiles' results.jsonl, summary.md, sweep.png; an earlier search there is resumed")
    tune.add_argument("--no-loop-correction", action="store_true",
                      help="one compile per candidate, ranked by XLA's raw estimate (loop bodies counted once)")
    tune.add_argument("--cpu-devices", type=int, default=None, metavar="N",
                      help="with --topology cpu:N: simulate N devices on this CPU")
    return p


def _check_out(out: str, existing: str | None, local: str | None = None) -> None:
    """`--out`, before any compile or restore. Nothing there is replaced: `existing` is what the path may
    already be - "folder", "empty folder" or None (nothing). A missing local parent folder is refused too: a
    typo there would otherwise surface only once the work is done (a bucket has no folders). `local` says what
    the command writes where it takes no gs:// path: refused before the bucket is asked anything (a bucket that
    cannot be reached costs a minute of retries)."""
    from scaletrain.store import storage

    if local and storage.is_remote(out):
        raise UserError(f"--out {out}: {local}; expected a local path (copy it to the bucket afterwards)")
    path = storage.path(out)
    if path.is_file() or (path.exists() and existing is None):
        expected = f"a new path or an existing {existing}" if existing else "a new path"
        raise UserError(f"--out {out} already exists{' as a file' if existing else ''}; expected {expected} "
                        f"(nothing is overwritten)")
    if existing == "empty folder" and path.is_dir() and any(path.iterdir()):
        raise UserError(f"--out {out} is a folder that is not empty; expected a new or empty folder")
    if not storage.is_remote(out) and not path.parent.is_dir():
        raise UserError(f"--out {out}: folder {path.parent} does not exist; create it or correct the path")


def sweep(args: argparse.Namespace) -> int:
    from scaletrain import runtime
    from scaletrain.planner import sweep as sweep_lib

    spec = sweep_lib.load(args.sweep_file)  # before JAX starts: a bad sweep file costs milliseconds
    # An earlier run of the sweep there is resumed.
    _check_out(args.out, existing="folder", local="a sweep writes its results to a local folder")
    sweep_lib.earlier(spec, args.out)  # another sweep's results there: refused before JAX starts
    runtime.configure(args.cpu_devices)
    records = sweep_lib.run(spec, args.out, log=lambda line: print(line, flush=True))
    ok = sum(r["status"] == "ok" for r in records)
    print(f"{ok} of {len(records)} variants ok; {args.out}/summary.md, results.jsonl, sweep.png")
    return 0


def tune(args: argparse.Namespace) -> int:
    from scaletrain import config, runtime

    if args.budget < 1:
        raise UserError(f"--budget must be at least 1 (the candidates compiled); got {args.budget}")
    config.load(args.config, args.set)  # before JAX starts: a bad config costs milliseconds
    # An earlier search there is resumed.
    _check_out(args.out, existing="folder", local="tune writes its results to a local folder")
    runtime.configure(args.cpu_devices)
    from scaletrain.planner import tune as tune_lib

    best = tune_lib.run(args.config, tuple(args.set), args.topology, args.budget, args.out,
                        loop_correction=not args.no_loop_correction, log=lambda line: print(line, flush=True))
    if best is None:
        print(f"error: none of the candidates compiled for {args.topology} fits it; {args.out}/{tune_lib.REPORT} "
              f"says why each lost", file=sys.stderr)
        return EXIT_DOES_NOT_FIT
    print(f"best: {best['name'] or 'the config as it is'}: {args.out}/{tune_lib.BEST}; ranked in "
          f"{args.out}/{tune_lib.REPORT}")
    return 0


def plan(args: argparse.Namespace) -> int:
    import json

    from scaletrain import config, runtime

    if args.tokens is not None and not (0 < args.tokens < float("inf")):
        raise UserError(f"--tokens must be a positive number of training tokens, e.g. 15e12; got {args.tokens}")
    if args.mfu is not None and args.tokens is None:
        raise UserError(f"--mfu {args.mfu:g} needs --tokens: it prices a run of that many tokens, e.g. --tokens "
                        f"15e12 --mfu {args.mfu:g}")
    if args.mfu is not None and not 0 < args.mfu <= 1:
        raise UserError(f"--mfu must be in (0, 1], a fraction of the chips' peak (e.g. 0.4 for 40%); got {args.mfu:g}")
    if args.across_slices and args.tokens is not None:
        raise UserError("--across-slices compares layouts for one step; --tokens prices one layout's run: use "
                        "them in separate calls")
    cfg = config.load(args.config, args.set)
    runtime.configure(None)  # `cpu:N` measures this machine's CPU
    from scaletrain.planner import budget, roofline

    if args.across_slices:
        from scaletrain.planner import slices

        verdict = slices.verdict(args.config, tuple(args.set), args.hardware)
        print(json.dumps(verdict, indent=1) if args.json else slices.format_table(verdict))
        return 0

    result = roofline.plan(cfg, args.hardware)
    training = chips = None
    if args.tokens is not None:
        training = result["training"] = budget.training(cfg, result, args.tokens, args.mfu)
        result["warnings"] += budget.warnings(training, result)
        chips = None if result["chip"] == "cpu" else budget.min_chips(cfg, args.hardware)
        if chips:
            chips["training"] = budget.on_fewest_chips(cfg, chips, args.tokens, args.mfu)
        result["min_chips"] = chips and chips["min_chips"]
        result["min_chips_detail"] = chips
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    # The warnings last, below the budget they may be about.
    sections = [roofline.format_table({**result, "warnings": []}), budget.describe(training, chips, result),
                [f"warning: {w}" for w in result["warnings"]]]
    print("\n\n".join(s if isinstance(s, str) else "\n".join(s) for s in sections if s))
    return 0


def compile_(args: argparse.Namespace) -> int:
    import json

    from scaletrain import config, runtime

    cfg = config.load(args.config, args.set)
    runtime.configure(args.cpu_devices)
    from scaletrain.planner import aot

    result = aot.compile_step(cfg, args.topology, loop_correction=not args.no_loop_correction)
    print(json.dumps(result, indent=1) if args.json else aot.describe(result))
    return 0 if result["fits"] else EXIT_DOES_NOT_FIT


def ckpt(args: argparse.Namespace) -> int:
    import json

    from scaletrain import runtime

    runtime.configure(None)
    from scaletrain.parallel.mesh import describe
    from scaletrain.store.checkpoint import locate, read_metadata

    directory, step = locate(args.run_dir)
    step, meta = read_metadata(directory, step if args.step is None else args.step)
    if args.json:
        print(json.dumps({"step": step, **meta}, indent=1))
        return 0
    print(f"step {step}  scaletrain {meta['scaletrain_version']}  config {meta['config_hash']}  "
          f"mesh {describe(meta['mesh']['axes'])} ({meta['mesh']['devices']} devices, "
          f"{meta['mesh']['processes']} processes)")
    width = max(len(p) for p in meta["arrays"])
    for path, a in meta["arrays"].items():
        shape = "x".join(map(str, a["shape"])) or "scalar"
        logical = ", ".join(str(n) for n in a["logical"])
        print(f"  {path:<{width}}  {a['dtype']:<8} {shape:<16} ({logical})")
    return 0


def convert(args: argparse.Namespace) -> int:
    from scaletrain import runtime
    from scaletrain.store import storage

    runtime.configure(None)
    if args.convert_command == "fold-norms":
        from scaletrain.tools import inference

        if storage.is_remote(args.out) and not storage.is_remote(args.run_dir):  # local first
            inference.load_config(args.run_dir)
        _check_out(args.out, existing="empty folder")
        return inference.fold_norms(args.run_dir, args.out)
    from scaletrain.tools import hf

    if args.convert_command == "from-hf":
        hf.read_source(args.hf_dir)  # a local folder: checked before a gs:// --out is asked anything
        _check_out(args.out, existing="empty folder")
        return hf.from_hf(args.hf_dir, args.out)
    _check_out(args.out, existing="empty folder", local=hf.LOCAL_OUT)
    return hf.to_hf(args.run_dir, args.out, args.step, peft=args.peft)


def generate(args: argparse.Namespace) -> int:
    from scaletrain import runtime

    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.temperature < 0:
        raise UserError(f"--temperature must be >= 0 (0: greedy), got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise UserError(f"--top-p must be in (0, 1], got {args.top_p}")
    runtime.configure(None)
    from scaletrain.tools import generate as generate_lib

    return generate_lib.main(args.run_dir, args.step, args.prompt, args.max_new_tokens, args.temperature,
                             args.top_p, args.seed, args.set)


def data(args: argparse.Namespace) -> int:
    from scaletrain.config import DATA_FORMATS
    from scaletrain.data import prepare

    if args.data_command == "reference":
        return _reference(args)
    if args.format not in DATA_FORMATS:
        raise UserError(f"--format must be one of {', '.join(DATA_FORMATS)}; got '{args.format}'")
    if not 0 <= args.eval_fraction < 1:
        raise UserError(f"--eval-fraction must be in [0, 1), got {args.eval_fraction}")
    if args.workers is not None and args.workers < 1:
        raise UserError(f"--workers must be >= 1, got {args.workers}")
    if args.chat_template and args.format == "text":
        raise UserError("--chat-template renders conversations: it goes with --format chat, prompt_completion or "
                        "preference")
    _check_out(args.out, existing="empty folder", local=prepare.LOCAL_OUT)
    return prepare.main(args.tokenizer, args.input, args.out, args.field, args.eval_fraction, args.workers,
                        args.format, args.chat_template)


def _reference(args: argparse.Namespace) -> int:
    from scaletrain import runtime
    from scaletrain.data import prepare

    if args.rows < 0:
        raise UserError(f"--rows must be >= 1 (or 0: one per device), got {args.rows}")
    _check_out(args.out, existing="empty folder", local=prepare.LOCAL_OUT)
    runtime.configure(None)
    import jax

    from scaletrain.tools import reference

    return reference.main(args.run_dir, args.data, args.out, args.rows or jax.device_count(), args.set)


def logits(args: argparse.Namespace) -> int:
    from scaletrain import runtime

    if not args.out.endswith(".npy"):  # numpy would add the suffix: the file would not be where it was asked
        raise UserError(f"--out {args.out}: expected a path ending in .npy")
    if not os.path.isfile(args.tokens):  # numpy reads local files only
        raise UserError(f"--tokens {args.tokens}: no such file; expected a local .npy file of int token ids "
                        f"[batch, seq]")
    _check_out(args.out, existing=None, local="logits writes a local .npy file")
    runtime.configure(None)
    from scaletrain.tools import inference

    return inference.logits(args.run_dir, args.step, args.tokens, args.out, args.set)


def _check_coordinator(address: str) -> None:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UserError(f"--coordinator expects HOST:PORT with a port in 1-65535 (e.g. 10.0.0.2:8476), got "
                        f"'{address}'")


def train(args: argparse.Namespace) -> int:
    from scaletrain import config, runtime
    from scaletrain.store import storage

    cfg = config.load(args.config, args.set)  # before JAX starts: a bad config costs milliseconds
    if args.cpu_devices is not None and args.cpu_devices < 1:
        raise UserError(f"--cpu-devices must be >= 1, got {args.cpu_devices}")
    distributed = (args.coordinator, args.num_processes, args.process_id)
    if any(a is not None for a in distributed):
        if None in distributed or not 0 <= args.process_id < args.num_processes:
            raise UserError("--coordinator HOST:PORT, --num-processes N and --process-id I (0 <= I < N) go together")
        _check_coordinator(args.coordinator)
    # A run's own config.yaml (a converted run's, fine-tuned from) names its tokenizer relative to the run.
    cfg.data.tokenizer = storage.resolve(cfg.data.tokenizer, os.path.dirname(args.config) or ".")
    runtime.configure(args.cpu_devices, *distributed)
    from scaletrain.train import trainer

    return trainer.run(cfg)


def status(args: argparse.Namespace) -> int:
    import json

    from scaletrain.tools import status as status_lib

    report = status_lib.status(args.run_dir)
    plot = args.plot or f"{os.path.basename(str(args.run_dir).rstrip('/')) or 'run'}-status.png"
    try:
        status_lib.plot(report, plot)
    except (OSError, ValueError) as e:  # the report stands without its picture
        report["warnings"].append(f"the loss curves cannot be written to {plot} ({str(e).splitlines()[0][:120]}); "
                                  f"expected a writable --plot path")
        plot = None
    for warning in report["warnings"]:
        print(f"warning: {warning}", file=sys.stderr)
    if args.json:
        print(json.dumps({**report, "plot": plot}, indent=1))
    else:
        print(status_lib.describe(report) + (f"\n  loss curves: {plot}" if plot else ""))
    return 0


COMMANDS = {"train": train, "status": status, "ckpt": ckpt, "convert": convert, "logits": logits, "generate": generate,
            "data": data, "plan": plan, "compile": compile_, "sweep": sweep, "tune": tune}


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:  # `... | head`: the reader has all it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
