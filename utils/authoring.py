"""Generate the student copies in labs/ from solutions/ (nbgrader-style markers).

In a code cell of ``solutions/NAME.ipynb``, the lines between ``### BEGIN SOLUTION`` and
``### END SOLUTION`` are the answer, with its hints among them::

    # HINT 1 (the idea): ...       <- three tiers: the idea, the API or docs to look up
    # HINT 2 (look up): ...           (names, never a call with its arguments), the steps in
    # HINT 3 (pseudo-code): ...       words; a plain ``# HINT: ...`` line has no tier

In ``labs/NAME.ipynb`` the block becomes, at the same indentation,
``raise NotImplementedError("Exercise: write this part (see the hints above)")``, and its hints
move into a markdown cell just above the code cell, one collapsed ``<details>`` per hint, so a
student opens the idea first and the steps only when stuck. A line that starts with ``# HINT`` in
any other form is an error, so a mistyped hint never vanishes silently; tiers go 1, 2, 3 in
order. Hints never contain a line of the answer's code (``tests/test_authoring.py`` checks it).

Between ``### BEGIN ANSWER KEY`` and ``### END ANSWER KEY`` (code or markdown cells) is what
only instructors see: the key to a question, a prediction's expected value. The block is
removed from labs/ with nothing in its place; a cell left empty is removed.

Outputs and execution counts are cleared everywhere. ``python -m utils.authoring`` writes
labs/; ``--check`` writes nothing and exits 1 when labs/ differs from what it would write.
labs/assessment/ is hand-written and left alone. ``solution_answer`` reads a solution notebook's answer to an
exercise of ``utils.checks``, for the tests and ``make gpu-check`` (``utils.checks.engine`` re-exports it).

``--release DEST`` (``make release DEST=dir``) writes what students get: the repository's
tracked files without ``solutions/`` (the answers and the assessment's reference), ``tests/``
(which read the answers), CI and contributor files, with labs/ regenerated first so it matches
solutions/. The library stays whole: the labs ask students to write by hand what it implements,
and their checks refuse it.
"""

from __future__ import annotations

import argparse
import ast
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import nbformat

from .files import atomic_write

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
PLACEHOLDER = 'raise NotImplementedError("Exercise: write this part (see the hints above)")'
KEY_BEGIN, KEY_END = "### BEGIN ANSWER KEY", "### END ANSWER KEY"
TIERS = {1: "the idea", 2: "look up", 3: "pseudo-code"}
HINT_RE = re.compile(r"# HINT(?: ([1-3]) \(([a-z -]+)\))?:")
ROOT = Path(__file__).resolve().parent.parent


class AuthoringError(ValueError):
    pass


def hint_tier(line: str, where: str = "cell") -> int | None:
    """0 for a plain ``# HINT:`` line, 1 to 3 for a tiered one, None for a line that is no hint;
    AuthoringError for a line that starts like a hint but has neither form."""
    stripped = line.strip()
    if not stripped.startswith("# HINT"):
        return None
    m = HINT_RE.match(stripped)
    if not m or (m.group(1) and TIERS[int(m.group(1))] != m.group(2)):
        forms = ", ".join(f"'# HINT {n} ({label}):'" for n, label in TIERS.items())
        raise AuthoringError(f"{where}: malformed hint {stripped[:40]!r}; write '# HINT:' or one of {forms}")
    return int(m.group(1)) if m.group(1) else 0


def strip_answer_keys(source: str, where: str = "cell") -> str:
    """Remove every BEGIN/END ANSWER KEY block of ``source`` (markers included)."""
    out, in_key = [], False
    for n, line in enumerate(source.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith(KEY_BEGIN):
            if in_key:
                raise AuthoringError(f"{where}, line {n}: {KEY_BEGIN} inside another answer key")
            in_key = True
        elif stripped.startswith(KEY_END):
            if not in_key:
                raise AuthoringError(f"{where}, line {n}: {KEY_END} without {KEY_BEGIN}")
            in_key = False
        elif not in_key:
            out.append(line)
    if in_key:
        raise AuthoringError(f"{where}: {KEY_BEGIN} without {KEY_END}")
    return "\n".join(out).strip("\n") if out else ""


Hints = list[tuple[int, str]]  # (tier, text); tier 0 for a plain ``# HINT:`` line


def split_solutions(source: str, where: str = "cell") -> tuple[str, Hints, list[Hints]]:
    """``source`` with every BEGIN/END SOLUTION block replaced by a placeholder and every hint line
    removed; the hints outside any block (a prediction's), and each block's hints."""
    out, loose, blocks, in_block, indent = [], [], [], False, ""
    for n, line in enumerate(source.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith(BEGIN):
            if in_block:
                raise AuthoringError(f"{where}, line {n}: {BEGIN} inside another solution block")
            in_block, indent = True, line[: len(line) - len(line.lstrip())]
            blocks.append([])
        elif stripped.startswith(END):
            if not in_block:
                raise AuthoringError(f"{where}, line {n}: {END} without {BEGIN}")
            out.append(indent + PLACEHOLDER)
            in_block = False
        elif (t := hint_tier(line, f"{where}, line {n}")) is not None:
            hints = blocks[-1] if in_block else loose
            if t and t < max((h[0] for h in hints), default=0):
                raise AuthoringError(f"{where}, line {n}: HINT {t} after a later tier; give the tiers in order 1, 2, 3")
            hints.append((t, stripped[HINT_RE.match(stripped).end() :].strip()))
        elif not in_block:
            out.append(line)
    if in_block:
        raise AuthoringError(f"{where}: {BEGIN} without {END}")
    return "\n".join(out), loose, blocks


def strip_solutions(source: str, where: str = "cell") -> str:
    """``source`` with every BEGIN/END SOLUTION block replaced by a placeholder, hints removed."""
    return split_solutions(source, where)[0]


ORDINALS = ("first", "second", "third", "fourth", "fifth", "sixth")


def _folded(hints: Hints) -> list[str]:
    tiers: dict[int, list[str]] = {}
    for tier, text in hints:
        tiers.setdefault(tier, []).append(text)
    return [
        f"<details><summary>{f'Hint {t}: {TIERS[t]}' if t else 'Hint'}</summary>\n\n"
        + "\n\n".join(texts)
        + "\n\n</details>"
        for t, texts in tiers.items()
    ]


def hints_markdown(loose: Hints, blocks: list[Hints]) -> str:
    """The markdown cell that holds a code cell's hints: one collapsed ``<details>`` per tier."""
    parts = ["**Hints**: open one at a time, and the next only when you are still stuck."] + _folded(loose)
    for b, hints in enumerate(blocks):
        if len(blocks) > 1 and hints:
            part = ORDINALS[b] if b < len(ORDINALS) else f"number {b + 1}"
            parts.append(f"*For the {part} `NotImplementedError` in the cell below:*")
        parts += _folded(hints)
    return "\n\n".join(parts)


def student_copy(nb: nbformat.NotebookNode, name: str = "notebook") -> nbformat.NotebookNode:
    nb = nbformat.from_dict(nb)  # deep copy
    kept = []
    for i, cell in enumerate(nb.cells):
        had_key = KEY_BEGIN in cell.source
        if had_key:
            cell.source = strip_answer_keys(cell.source, f"{name} cell {i}")
        loose, blocks = [], []
        if cell.cell_type == "code":
            cell.source, loose, blocks = split_solutions(cell.source, f"{name} cell {i}")
            cell.outputs = []
            cell.execution_count = None
        cell.get("metadata", {}).pop("execution", None)
        if loose or any(blocks):
            md = nbformat.v4.new_markdown_cell(hints_markdown(loose, blocks))
            md.id = f"{cell.get('id', i)}-hints"[-64:]
            kept.append(md)
        if not (had_key and not cell.source.strip()):
            kept.append(cell)
    nb.cells = kept
    nb.metadata.pop("widgets", None)
    return nb


def render(nb: nbformat.NotebookNode) -> str:
    return nbformat.writes(nb, version=4) + "\n"


def plan(root: Path = ROOT) -> dict[Path, str]:
    """{labs/NAME.ipynb: its text} for every solutions/*.ipynb."""
    out = {}
    for src in sorted((root / "solutions").glob("*.ipynb")):
        nb = nbformat.read(src, as_version=4)
        out[root / "labs" / src.name] = render(student_copy(nb, src.name))
    return out


def _kept(node: ast.stmt) -> bool:
    """An import, a function, a class, or names bound to a literal."""
    if isinstance(node, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.ClassDef)):
        return True
    if not isinstance(node, ast.Assign) or not all(isinstance(t, ast.Name) for t in node.targets):
        return False
    try:
        ast.literal_eval(node.value)
    except ValueError:
        return False
    return True


@functools.cache
def solution_namespace(lab: str) -> dict:
    """The imports, literal constants, functions and classes of ``solutions/<lab>.ipynb``, defined from a file
    (so ``inspect.getsource`` works, as in a notebook) in a module named ``__main__``. Nothing else of the
    notebook runs: no training, no check calls."""
    kept = []
    for cell in json.loads((ROOT / "solutions" / f"{lab}.ipynb").read_text())["cells"]:
        src = "".join(cell["source"])
        if cell["cell_type"] != "code" or src.startswith("%%"):
            continue
        src = "\n".join(line for line in src.splitlines() if not line.lstrip().startswith(("%", "!")))
        try:
            tree = ast.parse(src)
        except SyntaxError:
            continue
        for node in filter(_kept, tree.body):
            start = node.decorator_list[0].lineno if getattr(node, "decorator_list", None) else node.lineno
            kept.append("\n".join(src.splitlines()[start - 1 : node.end_lineno]))
    path = Path(tempfile.mkdtemp(prefix=f"{lab}-")) / f"{lab}_answers.py"
    path.write_text("\n\n".join(kept) + "\n")
    ns = {"__name__": "__main__"}
    exec(compile(path.read_text(), str(path), "exec"), ns)
    return ns


def solution_answer(ex: Any, lab: str | None = None) -> tuple:
    """What the solution notebook hands to the check of ``ex`` (a ``utils.checks.engine.Exercise``): the objects
    named in ``ex.answer``, from ``solutions/<lab>.ipynb`` (default: the ``LAB`` of the module that holds the spec)."""
    ns = solution_namespace(lab or sys.modules[ex.module].LAB)  # the spec's module, imported when ex was made
    return tuple(ns[name] for name in ex.answer)


NOT_RELEASED = ("solutions/", "tests/", ".ci/", "CONTRIBUTING.md", "conftest.py")


def release_files(root: Path = ROOT) -> list[str]:
    """The tracked files (``git ls-files``) that go to students, as paths relative to ``root``."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise AuthoringError(f"a release is made from a git checkout ({root} is not one: {e})") from None
    return [f for f in out.decode().split("\0") if f and not f.startswith(NOT_RELEASED)]


def release(dest: Path, root: Path = ROOT) -> int:
    """Write the students' copy to ``dest`` (which must not exist), all at once: into a folder beside
    it, renamed into place when complete. Returns the number of files."""
    dest = Path(dest).resolve()
    if dest.exists():
        raise AuthoringError(f"{dest} exists: name a new folder (a release never writes over one)")
    stale = [p for p, text in plan(root).items() if not p.exists() or p.read_text() != text]
    if stale:
        raise AuthoringError(f"labs/ is out of date ({', '.join(p.name for p in stale)}): run `make labs` and commit")
    files = release_files(root)
    tmp = dest.with_name(f".{dest.name}.partial-{os.getpid()}")
    try:
        for f in files:
            (tmp / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / f, tmp / f)
        tmp.rename(dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return len(files)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m utils.authoring", description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if labs/ is out of date; write nothing")
    ap.add_argument("--root", type=Path, default=ROOT, help="repository root (default: this checkout)")
    ap.add_argument("--release", type=Path, metavar="DEST", help="write the students' copy (no solutions/) to DEST")
    args = ap.parse_args(argv)
    if args.release:
        try:
            n = release(args.release, args.root)
        except AuthoringError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(f"wrote {n} files to {args.release} (no solutions/, no tests/)")
        return 0
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
