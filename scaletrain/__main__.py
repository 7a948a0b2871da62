"""`python -m scaletrain COMMAND`: the command-line entry point. Bad input: one `error:` line, exit 2."""

from __future__ import annotations

import argparse
import sys

from scaletrain.errors import UserError

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's own usage errors follow the same one-line rule
        print(f"error: {message}", file=sys.stderr)
        sys.exit(EXIT_USAGE)


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="YAML config, e.g. configs/llama_tiny.yaml")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key with a YAML scalar (repeatable), e.g. --set mesh.fsdp=4")


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m scaletrain", description="Train Llama-style models on TPU slices with JAX.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    train = sub.add_parser("train", help="train (or resume) a model")
    _add_config_args(train)
    train.add_argument("--cpu-devices", type=int, default=None, metavar="N",
                       help="simulate N devices on the CPU (ignored where an accelerator is present)")
    return p


def train(args: argparse.Namespace) -> int:
    from scaletrain import config, runtime

    cfg = config.load(args.config, args.set)  # before JAX starts: a bad config costs milliseconds
    if args.cpu_devices is not None and args.cpu_devices < 1:
        raise UserError(f"--cpu-devices must be >= 1, got {args.cpu_devices}")
    runtime.configure(args.cpu_devices)
    from scaletrain import trainer

    return trainer.run(cfg)


COMMANDS = {"train": train}


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
