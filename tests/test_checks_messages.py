"""What a Jupyter kernel shows for a failed check: the student's own cell, then the one-line
diagnosis, no frames from utils.checks and no chained traceback. (Each named mistake's message is
tested per lab on tests/exercise_harness.py.)"""

import os
import re
from pathlib import Path


def _kernel_tracebacks(cells: list[str]) -> list[list[str]]:
    """What a Jupyter kernel sends the browser for each cell: the error's traceback lines."""
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3", cwd=os.path.dirname(os.path.dirname(__file__)))
    out = []
    try:
        for code in cells:
            msg_id, lines = kc.execute(code), []
            while True:
                msg = kc.get_iopub_msg(timeout=120)
                if msg["parent_header"].get("msg_id") != msg_id:
                    continue
                if msg["msg_type"] == "error":
                    lines = [
                        re.sub(r"\x1b\[[0-9;]*m", "", line)
                        for line in "\n".join(msg["content"]["traceback"]).splitlines()
                    ]
                if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                    break
            out.append(lines)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    return out


def _lab_cells(name: str, defines: str):
    """The untouched exercise cell of labs/NAME that defines `defines`, and the check cell after it."""
    import json

    cells = json.loads((Path(__file__).resolve().parents[1] / "labs" / name).read_text())["cells"]
    i = next(i for i, c in enumerate(cells) if f"def {defines}(" in "".join(c["source"]))
    return "".join(cells[i]["source"]), "".join(cells[i + 1]["source"])


def test_a_kernel_shows_a_failed_check_as_the_cell_and_one_line():
    exercise, check = _lab_cells("lab1_gd_sgd_batch.ipynb", "gd_step")
    assert "NotImplementedError" in exercise and "check_gd_step" in check
    placeholder_cell = exercise + "\n" + check
    wrong_cell = (
        "def gd_step(x, y, w, b, lr):\n"
        "    r = w * x - y\n"
        "    return float(w - lr * 2 * (r * x).mean()), float(b - lr * 2 * r.mean())\n"
        "utils.checks.check_gd_step(gd_step)"
    )
    _, first, second = _kernel_tracebacks(["import utils.checks", placeholder_cell, wrong_cell])
    for cell, lines, last in (
        (placeholder_cell, first, r"CheckFailed: gd_step: it is not implemented yet\. Try: replace the"),
        (wrong_cell, second, r"CheckFailed: gd_step: the residual leaves out b\. Try: "),
    ):
        text = "\n".join(lines)
        assert lines, "the check did not fail in the kernel"
        assert re.match(last, lines[-1]), text
        # one frame (the student's cell), none from utils.checks, no chained exception
        assert sum(line.startswith(("Cell In[", "File ")) for line in lines) == 1, text
        assert "utils/checks" not in text and "During handling" not in text and "direct cause" not in text, text
        assert len(lines) <= cell.count("\n") + 1 + 5, text
