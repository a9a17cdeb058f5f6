"""The docs stay true to the tree.

* docs/DESIGN.md's module table has exactly one row per module under utils/: every ``.py`` file,
  recursively, except ``__init__.py`` and ``__main__.py`` (they only re-export or dispatch).
  ``utils/grader/_probe/sitecustomize.py`` and ``utils/parallel/_rank_done/sitecustomize.py`` count:
  they are loaded from a folder put on the PYTHONPATH of a graded job or of torchrun's ranks, but
  they are code the course owns (the probe a trust boundary of the grader), so each has a row like
  any other file.
* Every relative link target in README.md, CONTRIBUTING.md and docs/*.md exists.

A row of the table is a line that starts with ``| `utils/.../name.py` |``.
"""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DESIGN = ROOT / "docs" / "DESIGN.md"
NOT_MODULES = {"__init__.py", "__main__.py"}
ROW = re.compile(r"^\|\s*`(utils/[^`]+\.py)`\s*\|")


def utils_modules() -> set[str]:
    return {
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / "utils").rglob("*.py")
        if p.name not in NOT_MODULES and "__pycache__" not in p.parts
    }


def design_rows() -> list[str]:
    return [m.group(1) for line in DESIGN.read_text().splitlines() if (m := ROW.match(line.strip()))]


def test_design_table_is_parsed():
    rows = design_rows()
    assert len(rows) >= 10, (
        f"found only {len(rows)} module rows in {DESIGN}: is the table still `| `utils/x.py` | ... |`?"
    )


def test_every_module_has_a_row_in_design():
    missing = sorted(utils_modules() - set(design_rows()))
    assert not missing, (
        f"modules with no row in docs/DESIGN.md's module table: {missing}. "
        "Add a row `| `utils/....py` | what it owns |`"
    )


def test_design_names_no_module_that_is_gone():
    gone = sorted(set(design_rows()) - utils_modules())
    assert not gone, f"docs/DESIGN.md's module table names files that do not exist: {gone}. Remove or rename their rows"


def test_design_has_one_row_per_module():
    rows = design_rows()
    twice = sorted({r for r in rows if rows.count(r) > 1})
    assert not twice, f"docs/DESIGN.md lists these modules more than once: {twice}"


FENCE = re.compile(r"^[ \t]*(```|~~~).*?^[ \t]*\1", re.M | re.S)
CODE_SPAN = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def doc_files() -> list[Path]:
    return [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]


def relative_links(path: Path) -> list[str]:
    """Targets of markdown links ``[text](target)`` outside code, that are paths in this
    repository: not a URL (``scheme:``), not a bare ``#anchor``; any ``#anchor`` is dropped."""
    text = CODE_SPAN.sub("", FENCE.sub("", path.read_text()))
    out = []
    for target in LINK.findall(text):
        if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:", target) or target.startswith("#"):
            continue
        out.append(target.split("#", 1)[0].split("?", 1)[0])
    return out


def test_the_doc_files_exist():
    missing = [p.relative_to(ROOT).as_posix() for p in doc_files() if not p.exists()]
    assert not missing, f"missing: {missing}"
    assert (ROOT / "docs" / "DESIGN.md").exists() and (ROOT / "docs" / "REFERENCES.md").exists()


def test_relative_links_point_at_files_that_exist():
    broken = []
    for doc in doc_files():
        for target in relative_links(doc):
            if not (doc.parent / target).exists():
                broken.append(f"{doc.relative_to(ROOT).as_posix()}: ({target})")
    assert not broken, "links to paths that do not exist (relative to the file that links):\n" + "\n".join(broken)


def test_link_parser_sees_links_and_skips_code(tmp_path):
    md = tmp_path / "x.md"
    md.write_text(
        '[a](docs/A.md) [b](https://x.org) [c](#top) ![i](img/p.png "t") [d](B.md#sec)\n'
        "`[e](inline.md)`\n```\n[f](fenced.md)\n```\n"
    )
    assert relative_links(md) == ["docs/A.md", "img/p.png", "B.md"]
