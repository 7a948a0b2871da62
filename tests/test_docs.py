"""The docs' example outputs (docs/planner.md's, docs/pipeline.md's) are what the planner prints today: each
marked block is regenerated in this process (docs/examples.py) and compared. A planner change that moves a number
fails here until `python docs/examples.py` has rewritten the docs."""

import importlib.util
import re
import shlex
import sys

import pytest

from tests.conftest import ROOT

PLANNER_MD = ROOT / "docs" / "planner.md"
# The generated blocks docs/planner.md has: a floor, so that the check cannot pass by finding no markers.
MIN_MARKERS = 10


def _examples():
    spec = importlib.util.spec_from_file_location("docs_examples", ROOT / "docs" / "examples.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


examples = _examples()


@pytest.mark.parametrize("page, floor", [("planner.md", MIN_MARKERS), ("pipeline.md", 3)])
def test_docs_show_the_live_output_of_every_marked_command(page, floor):
    stale, errors, markers = examples.check_text((ROOT / "docs" / page).read_text(), f"docs/{page}")
    assert not errors, "\n".join(errors)
    assert not stale, "\n".join(stale) + "\nrun: python docs/examples.py"
    assert markers >= floor


def test_a_changed_number_is_named_and_rewritten():
    text = PLANNER_MD.read_text()
    # The first digit of the first generated output, changed: as if the planner had moved.
    start = text.index("```text\n", text.index("<!-- output"))
    digit = re.compile(r"\d").search(text, start)
    changed = text[:digit.start()] + str((int(digit.group()) + 1) % 10) + text[digit.end():]
    stale, errors, _ = examples.check_text(changed, "planner.md")
    assert not errors and len(stale) == 1
    marker_line = text.count("\n", 0, text.rindex("<!-- output", 0, start)) + 1
    assert stale[0].startswith(f"planner.md:{marker_line}: stale output of `python -m scaletrain plan ")
    assert examples.blocks(changed)[0] == text  # regenerating restores it


def test_a_new_marker_gets_its_command_and_output():
    marker = "<!-- output lines=1,/^memory/: plan --config configs/llama_tiny.yaml\n  --hardware v5e:2x4 -->\n"
    text = f"Before.\n\n{marker}After.\n"
    rendered, found, errors = examples.blocks(text)
    assert not errors and len(found) == 1
    full = examples.output(("plan", "--config", "configs/llama_tiny.yaml", "--hardware", "v5e:2x4")).splitlines()
    memory = next(line for line in full if line.startswith("memory"))
    assert rendered == (
        f"Before.\n\n{marker}"
        "```sh\npython -m scaletrain plan --config configs/llama_tiny.yaml --hardware v5e:2x4\n```\n\n"
        f"```text\n{full[0]}\n...\n{memory}\n...\n```\n\nAfter.\n")
    assert examples.blocks(rendered)[0] == rendered  # and is then up to date


def test_line_selection():
    text = "".join(f"line {i}\n" for i in range(1, 11))
    assert examples.select(text, None) == text
    assert examples.select(text, "1-2,5,/line 8/-") == "line 1\nline 2\n...\nline 5\n...\nline 8\nline 9\nline 10\n"
    assert examples.select(text, "/line 3/-/line 4/") == "...\nline 3\nline 4\n...\n"
    for bad, says in (("/nothing/", "no line"), ("11", "not in the output"), ("5,2", "in order"), ("1;2", "expected")):
        with pytest.raises(examples.MarkerError, match=says):
            examples.select(text, bad)


def test_only_deterministic_commands_are_run():
    with pytest.raises(examples.MarkerError, match="measures the machine"):
        examples.parse_args("plan --config configs/llama_tiny.yaml --hardware cpu:8")
    with pytest.raises(examples.MarkerError, match="only plan"):
        examples.parse_args("sweep configs/sweeps/tiny_cpu.yaml --out x")
    _, _, errors = examples.blocks("<!-- output: plan --config configs/nothing.yaml --hardware v5p:2x2x2 -->\n")
    assert len(errors) == 1 and errors[0].startswith("1: `python -m scaletrain plan") and "exited 2" in errors[0]


def test_a_long_command_wraps_into_the_same_arguments():
    args = ("plan", "--config", "configs/llama3_70b.yaml", *[f"--set=model.key{i}=value {i}" for i in range(9)],
            "--hardware", "v5p:16x20x28")
    shown = examples.shown(args)
    assert all(len(line) <= examples.WIDTH for line in shown.splitlines()) and shown.count("\n") >= 2
    assert tuple(shlex.split(shown.replace("\\\n", " "))) == ("python", "-m", "scaletrain", *args)


def test_an_empty_output_block_owns_nothing_after_it():
    """A new marker's empty text block is the marker's alone: rewriting it must not swallow the prose up to the
    next block (it once did, the lazy match reaching to the next fence)."""
    text = "```text\n```\n\nprose that stays\n\n```sh\nx\n```\n"
    assert examples.BLOCKS.match(text).group(0) == "```text\n```\n"


def test_every_command_the_readme_and_docs_show_works_as_written():
    """Every `python -m scaletrain ...` and `python train.py ...` README.md and docs/*.md show - not a synopsis -
    parses, its config loads and passes the checks, and a `plan` runs (docs/examples.py --commands)."""
    problems, checked = [], 0
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        found, count = examples.check_commands(page.read_text(), page.name)
        problems += found
        checked += count
    assert not problems, "\n".join(problems)
    assert checked >= 60  # a floor: the check cannot pass by finding no commands


def test_a_command_shown_with_a_stale_key_or_flag_is_named():
    text = ("Run `python -m scaletrain plan --config configs/llama_tiny.yaml --set mesh.fdsp=4 --hardware v5e:2x2`.\n"
            "```sh\npython -m scaletrain tune --config configs/llama_tiny.yaml \\\n    --topology v5e:2x2 --budget 2\n"
            "python train.py --config configs/llama_tiny.yaml  # a comment\n```\n"
            "A synopsis: `python -m scaletrain status RUN_DIR [--json]`; in passing: `python -m scaletrain compile`.\n")
    problems, checked = examples.check_commands(text, "page.md")
    assert checked == 3 and len(problems) == 2, problems
    assert problems[0].startswith("page.md:1: ") and "unknown config key 'mesh.fdsp'" in problems[0]
    assert problems[1].startswith("page.md:4: ") and "required: --out" in problems[1]
