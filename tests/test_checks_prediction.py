import pytest

import utils.checks
from utils.checks import CheckFailed


def test_missing_prediction_fails_and_says_what_to_do():
    with pytest.raises(CheckFailed, match=r"not written a prediction yet\. Try: write your number"):
        utils.checks.check_prediction(None, 4.0, "the ratio")


def test_non_number_fails():
    with pytest.raises(CheckFailed, match="not a number"):
        utils.checks.check_prediction("four", 4.0, "the ratio")


def test_close_and_far_predictions_print_and_never_fail(capsys):
    assert utils.checks.check_prediction(4, 4.4, "the ratio") == pytest.approx(1.1)
    assert "\u2714" in capsys.readouterr().out
    assert utils.checks.check_prediction(16, 4.0, "the ratio", if_off="variance, not standard deviation") == 0.25
    out = capsys.readouterr().out
    assert "\u2717" in out and "Likely: variance, not standard deviation" in out
