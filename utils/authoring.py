"""Generate the student copies in labs/ from solutions/ (nbgrader-style markers).

In a code cell of ``solutions/NAME.ipynb``, the lines between ``### BEGIN SOLUTION`` and
``### END SOLUTION`` are the answer. In ``labs/NAME.ipynb`` they become (at the same
indentation)::

    # HINT: ...        <- every line of the answer that starts with "# HINT:" is kept
    raise NotImplementedError("Exercise: write this part (see the hint above)")

Outputs and execution counts are cleared everywhere. ``python -m utils.authoring`` writes
labs/; ``--check`` writes nothing and exits 1 when labs/ differs from what it would write.
labs/assessment/ is hand-written and left alone.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import nbformat

from .files import atomic_write

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
PLACEHOLDER = 'raise NotImplementedError("Exercise: write this part (see the hint above)")'
ROOT = Path(__file__).resolve().parent.parent


class AuthoringError(ValueError):
    pass


def strip_solutions(source: str, where: str = "cell") -> str:
    """Replace every BEGIN/END SOLUTION block of ``source`` with its hints and a placeholder."""
    out, in_block, indent, hints = [], False, "", []
    for n, line in enumerate(source.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith(BEGIN):
            if in_block:
                raise AuthoringError(f"{where}, line {n}: {BEGIN} inside another solution block")
            in_block, indent, hints = True, line[: len(line) - len(line.lstrip())], []
            continue
        if stripped.startswith(END):
            if not in_block:
                raise AuthoringError(f"{where}, line {n}: {END} without {BEGIN}")
            out += [indent + h for h in hints] + [indent + PLACEHOLDER]
            in_block = False
            continue
        if in_block:
            if stripped.startswith("# HINT:"):
                hints.append(stripped)
        else:
            out.append(line)
    if in_block:
        raise AuthoringError(f"{where}: {BEGIN} without {END}")
    return "\n".join(out)


def student_copy(nb: nbformat.NotebookNode, name: str = "notebook") -> nbformat.NotebookNode:
    nb = nbformat.from_dict(nb)   # deep copy
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            cell.source = strip_solutions(cell.source, f"{name} cell {i}")
            cell.outputs = []
            cell.execution_count = None
        cell.get("metadata", {}).pop("execution", None)
    nb.metadata.pop("widgets", None)
    return nb


def render(nb) -> str:
    return nbformat.writes(nb, version=4) + "\n"


def plan(root: Path = ROOT) -> dict[Path, str]:
    """{labs/NAME.ipynb: its text} for every solutions/*.ipynb."""
    out = {}
    for src in sorted((root / "solutions").glob("*.ipynb")):
        nb = nbformat.read(src, as_version=4)
        out[root / "labs" / src.name] = render(student_copy(nb, src.name))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m utils.authoring", description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if labs/ is out of date; write nothing")
    ap.add_argument("--root", type=Path, default=ROOT, help="repository root (default: this checkout)")
    args = ap.parse_args(argv)
    try:
        wanted = plan(args.root)
    except (AuthoringError, nbformat.ValidationError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    stale = sorted(p for p in (args.root / "labs").glob("*.ipynb") if p not in wanted)
    differ = [p for p, text in wanted.items() if not p.exists() or p.read_text() != text]
    if args.check:
        for p in differ:
            print(f"out of date: {p.relative_to(args.root)}")
        for p in stale:
            print(f"no solutions/ source: {p.relative_to(args.root)}")
        if differ or stale:
            print("run `make labs` (python -m utils.authoring) and commit labs/", file=sys.stderr)
            return 1
        print(f"labs/ is up to date ({len(wanted)} notebooks)")
        return 0
    for p in differ:
        atomic_write(p, wanted[p])
        print(f"wrote {p.relative_to(args.root)}")
    for p in stale:
        p.unlink()
        print(f"removed {p.relative_to(args.root)} (its solutions/ source is gone)")
    if not differ and not stale:
        print(f"labs/ is up to date ({len(wanted)} notebooks)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
