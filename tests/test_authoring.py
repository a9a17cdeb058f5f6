import json

import nbformat
import pytest

from utils import authoring


SOLUTION = """def accuracy(logits, labels):
    ### BEGIN SOLUTION
    # HINT: compare logits.argmax(dim=1) with labels
    return (logits.argmax(1) == labels).float().mean().item()
    ### END SOLUTION

print("after")"""


def test_solution_block_becomes_hint_and_placeholder_at_same_indent():
    out = authoring.strip_solutions(SOLUTION)
    assert "argmax(1) == labels" not in out
    assert "    # HINT: compare logits.argmax(dim=1) with labels" in out
    assert "    raise NotImplementedError(" in out
    assert out.startswith("def accuracy") and out.endswith('print("after")')
    ns = {}
    exec(out, ns)
    with pytest.raises(NotImplementedError):
        ns["accuracy"](None, None)


@pytest.mark.parametrize("bad,msg", [("### BEGIN SOLUTION\nx = 1", "without ### END"),
                                     ("x = 1\n### END SOLUTION", "without ### BEGIN"),
                                     ("### BEGIN SOLUTION\n### BEGIN SOLUTION", "inside another")])
def test_unbalanced_markers_are_errors(bad, msg):
    with pytest.raises(authoring.AuthoringError, match=msg):
        authoring.strip_solutions(bad)


def _repo(tmp_path):
    (tmp_path / "solutions").mkdir()
    (tmp_path / "labs").mkdir()
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell(SOLUTION)
    cell.outputs = [nbformat.v4.new_output("stream", text="after\n")]
    cell.execution_count = 3
    nb.cells = [nbformat.v4.new_markdown_cell("# Lab"), cell]
    nbformat.write(nb, tmp_path / "solutions" / "lab9.ipynb")
    return tmp_path


def test_generate_then_check_then_detect_drift(tmp_path, capsys):
    root = _repo(tmp_path)
    assert authoring.main(["--root", str(root), "--check"]) == 1      # labs/ missing
    assert authoring.main(["--root", str(root)]) == 0
    lab = json.loads((root / "labs" / "lab9.ipynb").read_text())
    code = lab["cells"][1]
    assert code["outputs"] == [] and code["execution_count"] is None
    assert "NotImplementedError" in "".join(code["source"])
    assert authoring.main(["--root", str(root), "--check"]) == 0
    # an edit to the solution makes labs/ stale
    nb = nbformat.read(root / "solutions" / "lab9.ipynb", 4)
    nb.cells[0].source = "# Lab, edited"
    nbformat.write(nb, root / "solutions" / "lab9.ipynb")
    assert authoring.main(["--root", str(root), "--check"]) == 1
    # a lab without a source is reported and removed
    (root / "labs" / "orphan.ipynb").write_text("{}")
    assert authoring.main(["--root", str(root)]) == 0
    assert not (root / "labs" / "orphan.ipynb").exists()
    assert "out of date" in capsys.readouterr().out
