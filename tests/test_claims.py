"""utils.claims: silent when every claim holds; otherwise one sentence naming each failed claim in
words, with the figures, in the course's message form ("name: what is wrong. Try: what to do.")."""

import re

import pytest

from utils import claims


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
