"""Gradescope, one submission at a time, as Gradescope runs an autograder
(https://gradescope-autograders.readthedocs.io/en/latest/specs/):

* ``make gradescope`` -> :func:`build_zip`: a zip with ``setup.sh`` and ``run_autograder`` at its
  root, the ``utils`` package, the install files and the instructor's spec (as ``spec.toml``).
  Gradescope unpacks it into /autograder/source and runs setup.sh once, as root.
* ``run_autograder`` -> ``python -m utils.grader gradescope --root /autograder``
  (:func:`run`): grades /autograder/submission/ in the sandbox and writes
  /autograder/results/results.json in Gradescope's schema (score; tests with name, score,
  max_score, status, output, visibility).
"""

from __future__ import annotations

import io
import json
import stat
import zipfile
from pathlib import Path

from ..files import atomic_write
from .spec import ROOT, Spec

SETUP_SH = """#!/usr/bin/env bash
# Gradescope runs this once, as root, when it builds the autograder's image.
set -euo pipefail
apt-get update
apt-get install -y bubblewrap python3 python3-venv python3-pip
python3 -m venv /autograder/venv
/autograder/venv/bin/pip install -q --disable-pip-version-check \\
    --extra-index-url https://download.pytorch.org/whl/cpu -c /autograder/source/constraints.txt \\
    -e /autograder/source
"""

RUN_AUTOGRADER = """#!/usr/bin/env bash
# Gradescope runs this for every submission: grade /autograder/submission in the sandbox and
# write /autograder/results/results.json.
cd /autograder/source
exec /autograder/venv/bin/python -m utils.grader gradescope --root /autograder --spec /autograder/source/spec.toml
"""

# What the autograder needs of the project: the package and its install files. Not the
# solutions, not notebooks, not other specs.
INCLUDE = ["utils", "pyproject.toml", "constraints.txt", "README.md"]


def build_zip(out: str | Path, spec_path: str | Path) -> list[str]:
    """Write the autograder zip to ``out`` (atomically); return the names it holds."""
    out = Path(out)
    spec_text = Path(spec_path).read_text()
    buf = io.BytesIO()
    names = []
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for name, text in (("setup.sh", SETUP_SH), ("run_autograder", RUN_AUTOGRADER)):
            info = zipfile.ZipInfo(name)
            info.external_attr = (stat.S_IFREG | 0o755) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(info, text)
            names.append(name)
        z.writestr("spec.toml", spec_text)
        names.append("spec.toml")
        for top in INCLUDE:
            p = ROOT / top
            files = (
                [p]
                if p.is_file()
                else sorted(
                    f for f in p.rglob("*") if f.is_file() and "__pycache__" not in f.parts and f.suffix != ".pyc"
                )
            )
            for f in files:
                rel = str(f.relative_to(ROOT))
                z.write(f, rel)
                names.append(rel)
    atomic_write(out, buf.getvalue())
    return names


def run(root: str | Path, spec: Spec) -> dict:
    """Grade ``root``/submission/ and write ``root``/results/results.json; return that document."""
    from .batch import gradescope_result, score
    from .core import grade, write_json
    from .sandbox import SandboxUnavailable

    root = Path(root)
    sub = root / "submission"
    out = root / "results" / "results.json"
    try:
        report = grade(sub, spec, student="submission")
    except SandboxUnavailable as e:  # the autograder's machine, not the student
        doc = {
            "score": 0.0,
            "output": f"The autograder could not run safely on this machine: {e} "
            "Tell the instructor; this is not your fault.",
            "tests": [],
            "visibility": "visible",
        }
        write_json(doc, out)
        return doc
    report["score"] = score(report, spec)
    doc = gradescope_result(report, spec)
    write_json(doc, out)
    return doc


def read(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())
