"""A notebook's claims about its own run, checked in one call.

A demo cell prints what it measured; the text around it says what that shows. The check that the
run bears the text out is one call at the end of the cell, each claim a sentence with its test::

    claims.expect(
        {
            "every batch size saw the same number of images": images[b_big] <= 1.1 * images[b_small],
            "the largest batch ended less accurate": acc[b_big] < max(acc.values()) - 0.05,
        },
        measured=f"accuracy {acc}",
    )

A claim that does not hold raises :class:`ClaimFailed` (an ``AssertionError``, so nbval and pytest
report it) whose message names every failed claim in words, with the figures behind them.
"""

from __future__ import annotations

from collections.abc import Mapping

RERUN = (
    "run the cell again; if it fails again, compare the figures printed above with the text and tell your instructor"
)


class ClaimFailed(AssertionError):
    """A notebook's run does not show what its text says it shows."""


def expect(claims: Mapping[str, object], *, measured: str = "", hint: str = RERUN) -> None:
    """Check each claim (a sentence -> whether this run bears it out). Silent when all hold; otherwise
    one message in the form "claim: this run does not show that <claims> (measured: ...). Try: <hint>."."""
    failed = [sentence for sentence, holds in claims.items() if not holds]
    if failed:
        figures = f" (measured: {measured})" if measured else ""
        raise ClaimFailed(f"claim: this run does not show that {'; nor that '.join(failed)}{figures}. Try: {hint}.")
