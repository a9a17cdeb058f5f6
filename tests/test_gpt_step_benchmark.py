"""benchmarks/gpt_step.py: its fit loop trains the GPT exactly as the plain hand loop does (the
oracle: zero_grad, the GPT's own loss, backward, AdamW step), and its main() prints its figures."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import gpt_step  # noqa: E402
from utils import data, gpt  # noqa: E402

TINY = gpt.GPTConfig(context=16, width=32, layers=2, heads=2)


@pytest.mark.parametrize("amp_dtype", [None, torch.bfloat16], ids=["fp32", "bf16 autocast"])
def test_fit_takes_the_same_steps_as_the_hand_loop(amp_dtype):
    tokens = data.load_tokens("stdlib", 20_000).train
    init = gpt.GPT(TINY, seed=0)
    out = {}
    for name, loop in (("hand", gpt_step.hand_loop), ("fit", gpt_step.fit_loop)):
        model = gpt.GPT(TINY, seed=0)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
        batches = data.TokenBatches(tokens, 4, TINY.context, seed=0)
        out[name] = loop(model, batches, opt, 5, amp_dtype), model
    (hand_losses, hand), (fit_losses, fitted) = out["hand"], out["fit"]
    assert hand_losses.shape == (5,)
    torch.testing.assert_close(fit_losses, hand_losses)
    for (name, p), q, p0 in zip(fitted.named_parameters(), hand.parameters(), init.parameters()):
        torch.testing.assert_close(p, q, msg=lambda m, name=name: f"{name}: {m}")
        assert not torch.equal(p, p0), f"{name} never moved: the loops took no step"


def test_main_prints_tokens_per_second_mfu_and_the_ratio(capsys):
    threads = torch.get_num_threads()
    try:
        gpt_step.main(["--steps", "2", "--repeats", "2", "--batch", "2", "--threads", "1", "--clock", "cpu"])
    finally:
        torch.set_num_threads(threads)
    lines = capsys.readouterr().out.strip().splitlines()
    assert re.fullmatch(r"ratio \d+\.\d{3}", lines[-1]), lines[-1]
    assert any(line.startswith("hand loop (again) / hand loop") for line in lines), "the control's line is missing"
    rows = [line for line in lines if "tokens/s" in line]  # bf16 and compile are off on a CPU unless asked
    assert [r.split("  ")[0] for r in rows] == ["hand loop", "hand loop (again)", "fit"], rows
    mfus = [float(re.search(r"MFU ([\d.]+)%", r).group(1)) / 100 for r in rows]
    assert all(0 < m < 1 for m in mfus), mfus


COMPILED = """
import sys, torch
sys.path.insert(0, sys.argv[1])
from benchmarks import gpt_step
from utils import data, gpt
TINY = gpt.GPTConfig(context=16, width=32, layers=2, heads=2)
tokens = data.load_tokens("stdlib", 20_000).train
losses = {}
for name, loop, wrap in (
    ("eager hand loop", gpt_step.hand_loop, lambda m: m),
    ("compiled hand loop", gpt_step.hand_loop, torch.compile),
    ("compiled fit", gpt_step.fit_loop, torch.compile),
):
    model = gpt.GPT(TINY, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    losses[name] = loop(wrap(model), data.TokenBatches(tokens, 4, TINY.context, seed=0), opt, 4)
for name in ("compiled hand loop", "compiled fit"):
    torch.testing.assert_close(losses[name], losses["eager hand loop"], msg=name)
print("compiled losses agree")
"""


@pytest.mark.extended  # compiling on a CPU takes a minute or more
@pytest.mark.slow
def test_compiled_loops_take_the_eager_hand_loops_steps():
    """``--compile``: fit and the hand loop on torch.compile(model) against the eager hand loop.
    Compiled kernels sum in another order, so the losses agree to float32's tolerance, not to the bit.
    In a fresh interpreter: inductor's C++ build imports setuptools, which refuses to run once another
    test in the same process has imported the standard library's distutils."""
    r = subprocess.run([sys.executable, "-c", COMPILED, str(ROOT)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "compiled losses agree" in r.stdout, r.stderr[-3000:]


@pytest.mark.parametrize("flag", ["--steps", "--repeats", "--batch", "--threads"])
def test_a_count_below_one_is_refused_with_what_to_do(flag, capsys):
    with pytest.raises(SystemExit) as exit_:
        gpt_step.main([flag, "0"])
    assert exit_.value.code == 2
    assert f"{flag} must be at least 1, got 0. Try:" in capsys.readouterr().err
