"""The house's shape holds: every import in scaletrain/ points down the layers docs/design.md draws, and no file
is over 500 lines."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Bottom to top (docs/design.md, "The layers"); a module may import its own layer and those below. The first
# matching prefix decides.
LAYERS = (
    ("base", ("scaletrain.errors", "scaletrain.config", "scaletrain.config_bounds", "scaletrain.remat",
              "scaletrain.runtime", "scaletrain.config_window", "scaletrain.config_gemma", "scaletrain.config_deepseek",
              "scaletrain.config_gpt_oss", "scaletrain.config_moe")),
    ("hardware", ("scaletrain.facts.hardware",)),
    ("parallel", ("scaletrain.parallel",)),
    ("kernels", ("scaletrain.kernels",)),
    ("models", ("scaletrain.models",)),
    ("facts, data, store", ("scaletrain.facts", "scaletrain.data", "scaletrain.store")),
    ("train", ("scaletrain.train",)),
    ("planner", ("scaletrain.planner",)),
    ("tools", ("scaletrain.tools",)),
    ("commands", ("scaletrain.__main__",)),
)
MAX_LINES = 500


def _layer(module: str) -> int | None:
    for rank, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return rank
    return None


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(tree: ast.AST, package: str) -> list[tuple[str, int]]:
    """(module, line) of every scaletrain module an import names, function-local ones included."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names if a.name.startswith("scaletrain")]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("scaletrain"):
            # `from package import module` names modules; `from module import name` the module itself.
            subpackage = (ROOT / node.module.replace(".", "/")).is_dir()
            out += [(f"{node.module}.{a.name}" if subpackage else node.module, node.lineno) for a in node.names]
    return out


def test_every_import_points_down_the_layers():
    upward, unplaced = [], []
    for path in sorted((ROOT / "scaletrain").rglob("*.py")):
        module = _module(path)
        if module == "scaletrain":  # the package's own (empty) __init__
            continue
        mine = _layer(module)
        if mine is None:
            unplaced.append(module)
            continue
        for target, line in _imported(ast.parse(path.read_text()), module):
            theirs = _layer(target)
            if theirs is not None and theirs > mine:
                upward.append(f"{path.relative_to(ROOT)}:{line} ({LAYERS[mine][0]}) imports {target} "
                              f"({LAYERS[theirs][0]})")
    assert not unplaced, f"modules in no layer (add them to LAYERS and docs/design.md): {unplaced}"
    assert not upward, "imports pointing up the layers:\n  " + "\n  ".join(upward)


def test_no_file_is_over_the_line_limit():
    long = {str(p.relative_to(ROOT)): n for p in (ROOT / "scaletrain").rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"over {MAX_LINES} lines: {long}"
