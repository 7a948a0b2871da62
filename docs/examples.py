"""Example outputs in the docs that cannot go stale: each is written by this script from the command it shows.

A marker - an HTML comment at the start of a line, invisible once rendered - names the arguments of
`python -m scaletrain`:

    <!-- output: plan --config configs/llama3_70b.yaml --set data.seq_len=4096 --hardware v5p:16x20x28 -->

and the two fenced blocks after it belong to it: the command (a ```sh block) and what it prints on stdout (a
```text block). Both are generated from the marker, so the command shown is the command run. A marker may span
lines (the arguments are split as a shell splits them) and may keep only some of the output's lines:

    <!-- output lines=1-3,/^memory/-/activations:/,/^training/-: plan ... -->

`lines=` is a comma-separated list of ranges, in order: `N` one line, `A-B` lines A to B, `A-` from A to the end.
An endpoint is a 1-based line number or a /regular expression/ (Python's, no spaces or commas: use \\s): a start
is the first line at or after the previous range's end that matches it, an end the first at or after its start.
Each run of lines left out is shown as one `...` line.

    python docs/examples.py            # rewrite every marked block of docs/*.md in place
    python docs/examples.py --check    # change nothing; exit 1 naming each stale block
    python docs/examples.py [--check] docs/planner.md ...   # these files only

Every other command README.md and docs/*.md show - `python -m scaletrain ...` and `python train.py ...`, in a
fenced block or inline - is checked as written with `--commands`: it parses (the arguments and flags exist),
its `--config` loads with its `--set` overrides and passes the config checks, and a `plan` runs to exit status
0. A synopsis is not a command and is left alone: any argument with a placeholder (`[...]`, `<...>`, `$VAR`,
`...`, an upper-case name such as RUN_DIR), or a verb named in passing with one option or none (`python -m
scaletrain compile --topology`; `train` is a command with one, `status` and `ckpt` with none); so is a config
under runs/, which an earlier command on the page writes.

    python docs/examples.py --commands  # exit 1 naming each command shown that does not work as written

The commands run in this process (scaletrain.__main__.main, stdout captured) from the repository root, so a
check takes seconds. Only deterministic commands are allowed: `plan` for TPU or GPU hardware - not `cpu:N`, whose
peak and bandwidth are measured on the machine it runs on. A command that fails, a malformed marker or a `lines=`
that selects nothing is an error (exit 2). tests/test_docs.py runs the check for docs/planner.md.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import io
import os
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
COMMAND = "python -m scaletrain"
WIDTH = 116  # a shown command wraps (shell continuations) before an option that would pass this column
ALLOWED = ("plan",)

MARKER = re.compile(r"^<!--[ \t]*output(?:[ \t]+lines=(?P<lines>\S+?))?:\s+(?P<args>.*?)\s*-->[ \t]*\n?",
                    re.M | re.S)
# The blocks a marker owns, as this script writes them; blank lines between them are tolerated. An empty text
# block is matched as empty (the lazy `??`), never as reaching to the next fence.
BLOCKS = re.compile(r"(?:\n*```sh\n.*?\n```\n)?(?:\n*```text\n(?:.*?\n)??```(?:\n|\Z))?", re.S)
ENDPOINT = re.compile(r"\d+|/(?:[^/\\]|\\.)+/")


class MarkerError(Exception):
    """A marker that cannot be rendered: malformed, a command not allowed or failing, a selection of nothing."""


@dataclass(frozen=True)
class Block:
    line: int  # of the marker, 1-based
    args: tuple[str, ...]
    old: str  # the marker's blocks as the file has them
    new: str  # as the command prints them today


def parse_args(text: str) -> tuple[str, ...]:
    try:
        args = tuple(shlex.split(text))
    except ValueError as e:
        raise MarkerError(f"cannot split the arguments: {e}") from None
    if not args or args[0] not in ALLOWED:
        raise MarkerError(f"only {', '.join(ALLOWED)} commands are run (deterministic ones); got "
                          f"'{args[0] if args else ''}'")
    cpu = next((a for a in args if re.search(r"cpu:\d", a, re.I)), None)
    if cpu:
        raise MarkerError(f"{cpu}: a CPU's plan measures the machine it runs on; plan for a TPU or GPU")
    return args


_outputs: dict[tuple[str, ...], str] = {}


def output(args: tuple[str, ...]) -> str:
    """What `python -m scaletrain ARGS` prints on stdout, run here from the repository root (cached per args).
    The environment is restored afterwards (the commands set variables for libtpu)."""
    if args not in _outputs:
        from scaletrain.__main__ import main

        out, err, environ = io.StringIO(), io.StringIO(), dict(os.environ)
        try:
            with contextlib.chdir(ROOT), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                try:
                    code = main(list(args))
                except SystemExit as e:  # argparse's usage errors
                    code = e.code
        finally:
            os.environ.clear()
            os.environ.update(environ)
        if code:
            raise MarkerError(f"`{COMMAND} {shlex.join(args)}` exited {code}: {err.getvalue().strip()}")
        _outputs[args] = out.getvalue()
    return _outputs[args]


def _endpoint(token: str, lines: list[str], start: int) -> int:
    """Index of an endpoint: a 1-based line number, or the first line from index `start` that matches."""
    if token.startswith("/"):
        pattern = re.compile(token[1:-1])
        for i in range(start, len(lines)):
            if pattern.search(lines[i]):
                return i
        raise MarkerError(f"lines=: no line from line {start + 1} on matches {token}")
    if not 1 <= int(token) <= len(lines):
        raise MarkerError(f"lines=: line {token} is not in the output's {len(lines)} lines")
    return int(token) - 1


def select(text: str, spec: str | None) -> str:
    """The lines of `text` that `spec` (the marker's lines=) keeps, `...` for each run left out."""
    if not spec:
        return text
    lines = text.splitlines()
    ranges, pos, after = [], 0, 0
    while pos < len(spec):
        first = ENDPOINT.match(spec, pos)
        if not first:
            raise MarkerError(f"lines={spec}: expected a line number or /regex/ at '{spec[pos:]}'")
        start = _endpoint(first.group(), lines, after)
        pos, end = first.end(), None
        if spec.startswith("-", pos):
            second = ENDPOINT.match(spec, pos + 1)
            end = _endpoint(second.group(), lines, start) if second else len(lines) - 1
            pos = second.end() if second else pos + 1
        else:
            end = start
        if start < after or end < start:
            raise MarkerError(f"lines={spec}: ranges must be in order and not overlap")
        ranges.append((start, end))
        after = end + 1
        if pos < len(spec):
            if spec[pos] != ",":
                raise MarkerError(f"lines={spec}: expected ',' at '{spec[pos:]}'")
            pos += 1
    kept, previous = [], 0
    for start, end in ranges:
        if start > previous:
            kept.append("...")
        kept += lines[start:end + 1]
        previous = end + 1
    if previous < len(lines):
        kept.append("...")
    return "\n".join(kept) + "\n"


def shown(args: tuple[str, ...]) -> str:
    """The command as the reader types it: wrapped with shell continuations before an option (with its value)
    that would pass WIDTH. shlex.split of it, continuations removed, gives `args` back."""
    groups, current = [], [COMMAND, *map(shlex.quote, args[:1])]
    for a in args[1:]:
        if a.startswith("--"):
            groups.append(" ".join(current))
            current = []
        current.append(shlex.quote(a))
    groups.append(" ".join(current))
    lines = [groups[0]]
    for g in groups[1:]:
        if len(lines[-1]) + 1 + len(g) + 2 > WIDTH:
            lines[-1] += " \\"
            lines.append("    " + g)
        else:
            lines[-1] += " " + g
    return "\n".join(lines)


def render(args: tuple[str, ...], spec: str | None) -> str:
    """A marker's blocks: the command, then what it prints."""
    text = select(output(args), spec)
    return f"```sh\n{shown(args)}\n```\n\n```text\n{text}```\n"


def blocks(text: str) -> tuple[str, list[Block], list[str]]:
    """(`text` with every marked block rendered anew, the blocks, the errors as 'LINE: message')."""
    pieces, found, errors, pos = [], [], [], 0
    for marker in MARKER.finditer(text):
        line = text.count("\n", 0, marker.start()) + 1
        owned = BLOCKS.match(text, marker.end())
        old = text[marker.end():owned.end()]
        pieces.append(text[pos:marker.end()])
        pos = owned.end()
        try:
            args = parse_args(marker.group("args"))
            new = render(args, marker.group("lines"))
        except MarkerError as e:
            errors.append(f"{line}: {e}")
            pieces.append(old)
            continue
        if not marker.group().endswith("\n"):  # a marker on the file's last line
            new = "\n" + new
        if text[pos:] and not text.startswith("\n", pos):  # a paragraph right after: a blank line before it
            new += "\n"
        pieces.append(new)
        found.append(Block(line=line, args=args, old=old, new=new))
    pieces.append(text[pos:])
    return "".join(pieces), found, errors


def check_text(text: str, name: str) -> tuple[list[str], list[str], int]:
    """(stale blocks, errors, markers) of one document's text, each message naming NAME:LINE."""
    _, found, errors = blocks(text)
    stale = []
    for b in found:
        if b.old != b.new:
            diff = list(difflib.unified_diff(b.old.splitlines(), b.new.splitlines(), "in the file", "live",
                                             lineterm="", n=0))
            shown_diff = "\n".join("    " + d for d in diff[2:22]) + ("\n    ..." if len(diff) > 22 else "")
            stale.append(f"{name}:{b.line}: stale output of `{COMMAND} {shlex.join(b.args)}`\n{shown_diff}")
    return stale, [f"{name}:{e}" for e in errors], len(found) + len(errors)


CLI = re.compile(r"python3? (?:-m scaletrain|train\.py)\b[^`\n]*")
PLACEHOLDER = re.compile(r"[\[\]<>$|]|\.\.\.|^[A-Z][A-Z_]*$|^[A-Z]\.yaml$")


def shown_commands(text: str) -> list[tuple[int, str]]:
    """(line, command) of every scaletrain command `text` shows: in fenced blocks (shell continuations joined,
    comments dropped) and in inline code spans (which may wrap across lines)."""
    found, fence, joined = [], None, ""
    lines = text.splitlines()
    prose = []
    for number, line in enumerate(lines, 1):
        if line.lstrip().startswith("```"):
            fence = None if fence else number
            prose.append("")
            continue
        if fence is None:
            prose.append(line)
            continue
        prose.append("")
        joined += line[:-1] + " " if line.endswith("\\") else line
        if not line.endswith("\\"):
            found += [(number, re.sub(r"\s#.*", "", m.group())) for m in CLI.finditer(joined)]
            joined = ""
    flat = "\n".join(prose)
    for m in re.finditer(r"`(python3? (?:-m scaletrain|train\.py)[^`]*)`", flat):
        found.append((flat.count("\n", 0, m.start()) + 1, " ".join(m.group(1).split())))
    return sorted(found)


def check_commands(text: str, name: str) -> tuple[list[str], int]:
    """(problems, commands checked) of the commands `text` shows (the module's `--commands`)."""
    from scaletrain import config
    from scaletrain.__main__ import parser
    from scaletrain.errors import UserError

    problems, checked = [], 0
    for line, command in shown_commands(text):
        try:
            argv = shlex.split(command)
        except ValueError as e:
            problems.append(f"{name}:{line}: `{command}` cannot be split: {e}")
            continue
        argv = argv[3:] if argv[1] == "-m" else ["train", *argv[2:]]
        options = sum(a.startswith("--") for a in argv)
        in_passing = options < {"status": 0, "ckpt": 0, "train": 1}.get(argv[0] if argv else "", 2)
        if not argv or in_passing or any(PLACEHOLDER.search(a) for a in argv):
            continue  # a synopsis, or a verb named in passing with an option or none
        checked += 1
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                args = parser().parse_args(argv)
        except SystemExit:
            problems.append(f"{name}:{line}: `{command}`: {err.getvalue().strip()}")
            continue
        if getattr(args, "config", None) and not args.config.startswith("runs/"):
            try:
                with contextlib.chdir(ROOT):
                    config.validate(config.load(args.config, args.set))
            except UserError as e:
                problems.append(f"{name}:{line}: `{command}`: {e}")
                continue
        if argv[0] == "plan":
            try:
                output(tuple(argv))
            except MarkerError as e:
                problems.append(f"{name}:{line}: {e}")
    return problems, checked


def _files(paths: list[str]) -> list[Path]:
    if paths:
        return [Path(p).resolve() for p in paths]
    return sorted(p for p in DOCS.glob("*.md") if MARKER.search(p.read_text()))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python docs/examples.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 naming each stale block")
    p.add_argument("--commands", action="store_true", help="check every command README.md and docs/*.md show "
                   "instead (exit 1 naming each that does not work as written)")
    p.add_argument("files", nargs="*", help="markdown files (default: every docs/*.md with a marker)")
    args = p.parse_args(argv)
    if args.commands:
        paths = [Path(f).resolve() for f in args.files] or [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
        problems = [p for path in paths for p in check_commands(path.read_text(), os.path.relpath(path, ROOT))[0]]
        print("\n".join(problems) or "every command shown works as written")
        return 1 if problems else 0
    stale_all, errors_all = [], []
    for path in _files(args.files):
        name = os.path.relpath(path, ROOT)
        text = path.read_text()
        stale, errors, markers = check_text(text, name)
        stale_all += stale
        errors_all += errors
        if not args.check and stale and not errors:
            path.write_text(blocks(text)[0])
            print(f"{name}: {len(stale)} of {markers} blocks rewritten")
        elif not args.check:
            print(f"{name}: {markers} blocks{', up to date' if not stale else ''}")
    for e in errors_all:
        print(f"error: {e}", file=sys.stderr)
    if args.check:
        for s in stale_all:
            print(s)
        if stale_all:
            print(f"{len(stale_all)} stale block(s): run python docs/examples.py")
    if errors_all:
        return 2
    return 1 if args.check and stale_all else 0


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # plan compiles nothing; no accelerator probing
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
