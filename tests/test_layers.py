"""The package's layers (docs/DESIGN.md): nothing imports upward. The mechanism modules never import
the experiments that drive them, the course's science or the grader; the core (data, models, the
training loop) knows nothing of distribution. Oracle: the import statements themselves, lazy imports
inside functions included, read with ast."""

import ast
from pathlib import Path

import pytest

UTILS = Path(__file__).resolve().parent.parent / "utils"

# module (or package) -> the utils modules it may import (its own package always allowed)
ALLOWED = {
    "files": set(),
    "rank_failures": set(),
    "config": set(),
    "device": set(),
    "data": {"config", "device", "files"},
    "models": set(),
    "gpt": set(),
    "train": {"device", "data"},
    "parallel": {"config", "data", "device", "files", "models", "rank_failures", "train"},
}


def utils_imports(path: Path, root: Path = UTILS) -> set:
    """The utils modules a file imports, by their first name under utils (``utils.parallel.shard`` ->
    ``parallel``), from absolute and relative imports anywhere in the file."""
    rel = path.relative_to(root)
    pkg_depth = len(rel.parts) - 1
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the file's package
                base = list(rel.parts[:-1])[: max(0, pkg_depth - (node.level - 1))]
                parts = base + (node.module.split(".") if node.module else [])
                if parts:
                    found.add(parts[0])
                else:  # from . import a, b (at the top of utils)
                    found.update(a.name for a in node.names)
            elif node.module and (node.module == "utils" or node.module.startswith("utils.")):
                rest = node.module.split(".")[1:]
                found.update([rest[0]] if rest else [a.name for a in node.names])
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("utils."):
                    found.add(a.name.split(".")[1])
    return found


def _files(name):
    p = UTILS / name
    return sorted(p.rglob("*.py")) if p.is_dir() else [UTILS / f"{name}.py"]


@pytest.mark.parametrize("name", sorted(ALLOWED))
def test_nothing_imports_upward(name):
    bad = {}
    for f in _files(name):
        extra = utils_imports(f) - ALLOWED[name] - {name}
        if extra:
            bad[str(f.relative_to(UTILS))] = sorted(extra)
    assert not bad, f"{name} may import only {sorted(ALLOWED[name])} of utils; found {bad}"


def test_the_scanner_sees_relative_lazy_and_absolute_imports(tmp_path):
    (tmp_path / "parallel").mkdir()
    f = tmp_path / "parallel" / "probe.py"
    f.write_text(
        "from ..memory import x\nfrom .group import setup\ndef f():\n"
        "    from utils.demos import shard_demo\n    import utils.grader.core\n"
    )
    assert utils_imports(f, root=tmp_path) == {"memory", "parallel", "demos", "grader"}
