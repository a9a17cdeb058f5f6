"""Grades out of the grader: the gradebook a learning platform imports (Canvas's columns, or a
generic one) and one feedback page per student, written from reports (no process starts here).
Oracles: the rows and cells written by hand; the pages read back with Python's HTML parser."""

from __future__ import annotations

import pytest

from utils.grader.spec import ROOT, load_spec

CI_SPEC = ROOT / "labs" / "assessment" / "spec_ci.toml"


# ----------------------------------------------------------------------------------------
# Grades out: the platform gradebook and the feedback pages, from reports
# ----------------------------------------------------------------------------------------


def _graded(student, status, score, reasons=(), accuracy=0.9, time_s=30.0, ranks=2):
    return {
        "student": student,
        "status": status,
        "score": score,
        "accuracy": accuracy,
        "time_s": time_s,
        "ranks_measured": ranks,
        "reasons": [{"code": c, "message": m} for c, m in reasons],
    }


CLASS = [
    _graded("ada", "passed", 100.0),
    _graded("bob", "failed", 0.0, [("time", "took 130.0 s, over the 120 s budget")], time_s=130.0),
    _graded("<eve>", "error", 0.0, [("crashed", "exit code 1: rank 1: RuntimeError: <boom> & more")], accuracy=None),
]


def test_canvas_gradebook_has_canvas_columns_a_points_row_and_each_score(tmp_path):
    import csv

    from utils.grader import batch

    spec = load_spec(CI_SPEC)
    path = tmp_path / "canvas.csv"
    batch.write_platform_csv(CLASS, path, spec, id_column="SIS User ID", assignment="Assessment")
    rows = list(csv.reader(path.open()))
    assert rows[0] == ["Student", "ID", "SIS User ID", "SIS Login ID", "Section", "Assessment"]
    assert rows[1] == ["Points Possible", "", "", "", "", f"{spec.points:g}"]
    assert rows[2:] == [
        ["ada", "", "ada", "", "", "100"],
        ["bob", "", "bob", "", "", "0"],
        ["<eve>", "", "<eve>", "", "", "0"],
    ]
    with pytest.raises(ValueError, match="SIS Login ID"):
        batch.write_platform_csv(CLASS, path, spec, id_column="email")
    batch.write_platform_csv(CLASS, path, spec, platform="generic", id_column="student_number")
    generic = list(csv.DictReader(path.open()))
    assert [(r["student_number"], r["score"], r["status"]) for r in generic] == [
        ("ada", "100", "passed"),
        ("bob", "0", "failed"),
        ("<eve>", "0", "error"),
    ]


def test_a_feedback_page_per_student_gives_the_reasons_and_what_to_do_next(tmp_path):
    from html.parser import HTMLParser

    from utils.grader import batch

    spec = load_spec(CI_SPEC)
    batch.write_feedback(CLASS, tmp_path, spec)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["<eve>.html", "ada.html", "bob.html"]

    class Text(HTMLParser):
        def __init__(self):
            super().__init__()
            self.text, self.tags = [], []

        def handle_starttag(self, tag, attrs):
            self.tags.append(tag)

        def handle_data(self, data):
            self.text.append(data)

    def read(name):
        t = Text()
        t.feed((tmp_path / name).read_text())
        return " ".join(t.text), t.tags

    text, _ = read("ada.html")
    assert "ada: Passed, 100 of" in text and "Every requirement was met" in text
    text, _ = read("bob.html")
    assert "over the 120 s budget" in text and batch.NEXT_STEP["time"] in text and "Not passed" in text
    text, tags = read("<eve>.html")
    assert "<boom> & more" in text and "script" not in tags and "Not graded" in text  # escaped, not markup
    assert batch.NEXT_STEP["crashed"] in text and "not measured" in text
