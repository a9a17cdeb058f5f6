import pytest

from utils import checks


def test_check_accuracy_passes_on_the_solution(capsys):
    checks.check_accuracy(lambda lo, la: (lo.argmax(dim=1) == la).float().mean().item())
    assert "correct" in capsys.readouterr().out


@pytest.mark.parametrize(
    "wrong,msg",
    [
        (lambda lo, la: (_ for _ in ()).throw(NotImplementedError()), "not implemented yet"),
        (lambda lo, la: (lo.argmax(dim=1) == la).sum().item(), "number of correct predictions"),
        (lambda lo, la: (lo.argmax(dim=0)[: len(la)] == la).float().mean().item(), "expected 0.5|batch dimension"),
        (lambda lo, la: lo.argmax(dim=1) == la, "tensor of shape"),
        (lambda lo, la: 1 / 0, "ZeroDivisionError"),
    ],
)
def test_check_accuracy_explains_typical_mistakes(wrong, msg):
    with pytest.raises(checks.CheckFailed, match=msg):
        checks.check_accuracy(wrong)
