"""utils.claims: silent when every claim holds; otherwise one sentence naming each failed claim in
words, with the figures, in the course's message form ("name: what is wrong. Try: what to do.")."""

import json
import re
from pathlib import Path

import pytest

from utils import claims

ROOT = Path(__file__).resolve().parents[1]


def test_all_claims_hold_silently(capsys):
    claims.expect({"one is less than two": 1 < 2, "a non-empty list is true": [0]})
    assert capsys.readouterr().out == ""


def test_a_failed_claim_is_named_in_words_with_its_figures():
    with pytest.raises(AssertionError) as e:
        claims.expect(
            {"the big batch took fewer steps": 10 < 5, "steps are positive": True, "the fit is finite": False},
            measured="steps {8: 10, 32: 5}",
        )
    assert isinstance(e.value, claims.ClaimFailed)
    msg = str(e.value)
    assert "the big batch took fewer steps" in msg and "the fit is finite" in msg
    assert "steps are positive" not in msg, "only the claims that failed are named"
    assert "steps {8: 10, 32: 5}" in msg
    assert re.fullmatch(r"claim: [^\n]+\. Try: [^\n]+\.", msg), msg


def test_the_hint_can_say_what_to_change():
    with pytest.raises(claims.ClaimFailed, match=r"Try: raise sgd_max_steps\.$"):
        claims.expect({"the smallest batch reached the target": False}, hint="raise sgd_max_steps")


def test_demo_notebooks_check_their_claims_in_one_call_per_cell():
    """A demo notebook's reader meets the explanation and the result, not the test: a cell's claims
    about its run go through one claims.expect call, and a bare assert only stops the cell when a
    step it ran failed (a process's exit code, with that process's output)."""
    guard = re.compile(r"\s*assert \w+\.returncode == 0, ")
    found = []
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for i, cell in enumerate(json.loads(path.read_text())["cells"]):
            if cell["cell_type"] != "code":
                continue
            lines = "".join(cell["source"]).splitlines()
            found += [
                f"{path.name} cell {i}: {l.strip()}"
                for l in lines
                if re.match(r"\s*assert\b", l) and not guard.match(l)
            ]
            calls = sum(l.lstrip().startswith("claims.expect(") or "utils.claims.expect(" in l for l in lines)
            if calls > 1 and not any(l.startswith(("if ", "else", "for ")) for l in lines):
                found.append(f"{path.name} cell {i}: {calls} claims.expect calls")
    assert found == [], found
