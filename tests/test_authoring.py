import ast
import json
import re

import nbformat
import pytest

from utils import authoring

SOLUTION = """def accuracy(logits, labels):
    ### BEGIN SOLUTION
    # HINT: compare logits.argmax(dim=1) with labels
    return (logits.argmax(1) == labels).float().mean().item()
    ### END SOLUTION

print("after")"""


def test_solution_block_becomes_a_placeholder_at_the_same_indent_and_its_hint_moves_out():
    out, loose, blocks = authoring.split_solutions(SOLUTION)
    assert "argmax(1) == labels" not in out and "HINT" not in out
    assert (loose, blocks) == ([], [[(0, "compare logits.argmax(dim=1) with labels")]])
    assert "    raise NotImplementedError(" in out
    assert out.startswith("def accuracy") and out.endswith('print("after")')
    ns = {}
    exec(out, ns)
    with pytest.raises(NotImplementedError):
        ns["accuracy"](None, None)


@pytest.mark.parametrize(
    "bad,msg",
    [
        ("### BEGIN SOLUTION\nx = 1", "without ### END"),
        ("x = 1\n### END SOLUTION", "without ### BEGIN"),
        ("### BEGIN SOLUTION\n### BEGIN SOLUTION", "inside another"),
    ],
)
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
    assert authoring.main(["--root", str(root), "--check"]) == 1  # labs/ missing
    assert authoring.main(["--root", str(root)]) == 0
    lab = json.loads((root / "labs" / "lab9.ipynb").read_text())
    hints, code = lab["cells"][1:3]
    assert hints["cell_type"] == "markdown" and "<details><summary>Hint</summary>" in "".join(hints["source"])
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


# --- hints in tiers, never the answer -------------------------------------------------------

ROOT = authoring.ROOT
LABS = sorted(p.stem for p in (ROOT / "solutions").glob("*.ipynb"))
OWNED_TIERED = [
    "lab0_example",
    "lab1_gd_sgd_batch",
    "lab2_throughput",
    "lab3_ddp",
    "lab4_large_batch",
    "lab5_memory_and_model_parallel",
    "lab6_profiling",
]
TRIVIAL = {"pass", "else:", "try:", "continue", "break", "return", "finally:"}


def _norm(text: str) -> str:
    return "".join(text.split())  # whitespace never distinguishes two lines of code


def _blocks(path):
    """[(answer code lines, hint lines)] for every solution block of a solutions/ notebook."""
    out = []
    for cell in nbformat.read(path, 4).cells:
        if cell.cell_type != "code":
            continue
        block = None
        for line in cell.source.splitlines():
            s = line.strip()
            if s.startswith(authoring.BEGIN):
                block = ([], [])
            elif s.startswith(authoring.END):
                out.append(block)
                block = None
            elif block is not None and s:
                block[1 if authoring.hint_tier(s) is not None else 0].append(s)
    return out


def _substantial(line: str) -> list[str]:
    """The forms of an answer line a hint must not contain: the line, and without a leading
    return/if/elif/while/for or an assignment's left side (so `return EXPR` leaks as EXPR)."""
    if line.startswith("#"):
        return []
    forms = {line.rstrip(":")}
    for kw in ("return ", "if ", "elif ", "while ", "for "):
        if line.startswith(kw):
            forms.add(line[len(kw) :].rstrip(":"))
    lhs, eq, rhs = line.partition("=")
    if eq and not rhs.startswith("=") and lhs and lhs[-1] not in "<>!=+-*/":
        forms.add(rhs)
    return [f for f in map(_norm, forms) if len(f) >= 12 and f not in TRIVIAL]


def leaked_lines(path) -> list[str]:
    blocks = _blocks(path)
    hints = _norm(" ".join(h for _, hs in blocks for h in hs))
    return [line for answer, _ in blocks for line in answer if any(form in hints for form in _substantial(line))]


@pytest.mark.parametrize("lab", LABS)
def test_hints_never_contain_a_line_of_the_answer(lab):
    leaked = leaked_lines(ROOT / "solutions" / f"{lab}.ipynb")
    assert not leaked, f"{lab}: hints give away the answer's code: {leaked}"


def test_leak_detector_catches_a_verbatim_hint(tmp_path):
    src = (
        "def f(a, b):\n    ### BEGIN SOLUTION\n    # HINT 3 (pseudo-code): return (a.argmax(dim=1) == b).float()\n"
        "    return (a.argmax(dim=1) == b).float()\n    ### END SOLUTION\n"
    )
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src)]
    p = tmp_path / "x.ipynb"
    nbformat.write(nb, p)
    assert leaked_lines(p) == ["return (a.argmax(dim=1) == b).float()"]


@pytest.mark.parametrize("lab", OWNED_TIERED)
def test_every_exercise_has_three_tiers_of_hints(lab):
    for answer, hints in _blocks(ROOT / "solutions" / f"{lab}.ipynb"):
        if not answer:
            continue
        tiers = {authoring.hint_tier(h) for h in hints}
        assert {1, 2, 3} <= tiers, f"{lab}: a block's hints lack a tier: {hints}"


def test_tiered_hints_are_folded_one_per_tier_in_order_and_malformed_ones_are_errors():
    ok = (
        "x = 0\n# HINT 1 (the idea): p\n    ### BEGIN SOLUTION\n    # HINT 1 (the idea): a\n    # HINT 2 (look up): b\n"
        "    # HINT 3 (pseudo-code): c\n    # HINT 3 (pseudo-code): d\n    x = 1\n    ### END SOLUTION\n"
        "### BEGIN SOLUTION\n# HINT 1 (the idea): e\ny = 2\n### END SOLUTION"
    )
    out, loose, blocks = authoring.split_solutions(ok)
    assert out.splitlines() == ["x = 0", "    " + authoring.PLACEHOLDER, authoring.PLACEHOLDER]
    assert loose == [(1, "p")] and blocks == [[(1, "a"), (2, "b"), (3, "c"), (3, "d")], [(1, "e")]]
    md = authoring.hints_markdown(loose, blocks)
    summaries = re.findall(r"<details><summary>(.*?)</summary>\n\n(.*?)\n\n</details>", md, re.S)
    assert summaries == [
        ("Hint 1: the idea", "p"),
        ("Hint 1: the idea", "a"),
        ("Hint 2: look up", "b"),
        ("Hint 3: pseudo-code", "c\n\nd"),
        ("Hint 1: the idea", "e"),
    ]
    assert md.index("first `NotImplementedError`") < md.index("\n\na\n\n") < md.index("second `NotImplementedError`")
    for bad in ("# HINT 2 (the idea): a", "# HINT4: a", "# HINTS: a"):
        with pytest.raises(authoring.AuthoringError, match="malformed hint"):
            authoring.strip_solutions(f"### BEGIN SOLUTION\n{bad}\nx = 1\n### END SOLUTION")
    with pytest.raises(authoring.AuthoringError, match="in order"):
        authoring.strip_solutions(
            "### BEGIN SOLUTION\n# HINT 3 (pseudo-code): a\n# HINT 1 (the idea): b\nx = 1\n### END SOLUTION"
        )


@pytest.mark.parametrize("lab", LABS)
def test_in_labs_each_exercise_has_its_tiers_folded_above_it_and_no_hint_left_in_code(lab):
    cells = nbformat.read(ROOT / "labs" / f"{lab}.ipynb", 4).cells
    exercises = [i for i, c in enumerate(cells) if c.cell_type == "code" and authoring.PLACEHOLDER in c.source]
    assert exercises, f"{lab}: no exercise"
    for i in exercises:
        above = cells[i - 1]
        assert above.cell_type == "markdown" and above.source.startswith("**Hints**"), f"{lab} cell {i}: no hints above"
        for part in above.source.split("`NotImplementedError` in the cell below"):  # one part per block
            tiers = re.findall(r"<details><summary>Hint (\d)", part)
            assert tiers == sorted(tiers), f"{lab} cell {i}: tiers out of order: {tiers}"
        assert "<details><summary>Hint 1" in above.source, f"{lab} cell {i}: no first tier"
        assert "<details open" not in above.source, "a tier is folded until the student opens it"
    assert not [c for c in cells if c.cell_type == "code" and "# HINT" in c.source], f"{lab}: a hint left in code"


def test_answer_keys_are_removed_and_empty_cells_dropped():
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_markdown_cell("Q1?\n### BEGIN ANSWER KEY\nsecret 42\n### END ANSWER KEY"),
        nbformat.v4.new_markdown_cell("### BEGIN ANSWER KEY\nall secret\n### END ANSWER KEY"),
        nbformat.v4.new_code_cell(
            "my_prediction = None  # write your number here\n"
            "### BEGIN ANSWER KEY\nmy_prediction = 4.0\n### END ANSWER KEY"
        ),
    ]
    lab = authoring.student_copy(nb)
    assert [c.source for c in lab.cells] == ["Q1?", "my_prediction = None  # write your number here"]
    with pytest.raises(authoring.AuthoringError, match="without"):
        authoring.strip_answer_keys("### BEGIN ANSWER KEY\nx")


@pytest.mark.parametrize("lab", OWNED_TIERED)
def test_each_lab_asks_for_a_prediction_before_measuring(lab):
    sol = (ROOT / "solutions" / f"{lab}.ipynb").read_text()
    student = nbformat.read(ROOT / "labs" / f"{lab}.ipynb", 4)
    text = "\n".join(c.source for c in student.cells)
    assert "= None  # write your number here" in text, f"{lab}: no prediction for the student to write"
    assert "check_prediction(" in text, f"{lab}: the prediction is never compared with a measurement"
    assert authoring.KEY_BEGIN in sol and authoring.KEY_BEGIN not in text


# --- self-check messages never hand over the answer's code ---------------------------------

CHECKS = sorted((ROOT / "utils" / "checks").glob("*.py"))

# CODE, NOT MESSAGES: answer lines that appear in utils/checks/ as code the checks run, not in a
# message: lab 3's serial script (the student's starting point) and the builder of the script
# exercise's variants, which assembles the data-parallel script with one piece changed per named
# mistake. Each entry: (checks file, lab, answer line); each must still be found there.
PENDING: set[tuple[str, str, str]] = {
    ("ddp_script.py", "lab3_ddp", "sampler.set_epoch(epoch)"),
    ("ddp_script.py", "lab3_ddp", "opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)"),
    ("ddp_script.py", "lab3_ddp", "for x, y in loader:"),
    ("ddp_script.py", "lab3_ddp", "opt.zero_grad()"),
    ("ddp_script.py", "lab3_ddp", "F.cross_entropy(model(x), y).backward()"),
    ("ddp_script.py", "lab3_ddp", "dist.destroy_process_group()"),
}


def _string_literals(path) -> list[str]:
    """Every string literal of a Python file but its docstrings (f-string parts included), normalised."""
    tree = ast.parse(path.read_text())
    docs = {
        id(n.body[0].value)
        for n in ast.walk(tree)
        if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and n.body
        and isinstance(n.body[0], ast.Expr)
        and isinstance(n.body[0].value, ast.Constant)
    }
    parts = [
        n.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs
    ]
    return [_norm(part) for part in parts]


def message_leaks(path, literals: list[str]) -> list[str]:
    """The answer lines of a notebook that some string literal contains."""
    return [
        line
        for answer, _ in _blocks(path)
        for line in answer
        if any(form in lit for form in _substantial(line) for lit in literals)
    ]


@pytest.mark.parametrize("lab", LABS)
def test_check_messages_never_contain_a_line_of_the_answer(lab):
    nb = ROOT / "solutions" / f"{lab}.ipynb"
    leaked = [
        (p.name, line)
        for p in CHECKS
        for line in dict.fromkeys(message_leaks(nb, _string_literals(p)))
        if (p.name, lab, line) not in PENDING
    ]
    assert not leaked, f"{lab}: a message in utils/checks/ gives away the answer's code: {leaked}"


def test_message_leak_detector_catches_a_verbatim_message(tmp_path):
    src = "def f(a, b):\n    ### BEGIN SOLUTION\n    return (a.argmax(dim=1) == b).float()\n    ### END SOLUTION\n"
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src)]
    p = tmp_path / "x.ipynb"
    nbformat.write(nb, p)
    chk = tmp_path / "c.py"
    chk.write_text('MSG = f"wrong. Try: return (a.argmax(dim=1) == {1}).float()"\nOK = "compare the argmax"\n')
    assert message_leaks(p, _string_literals(chk)) == []  # an f-string's pieces do not rebuild the line
    chk.write_text('MSG = "wrong. Try: return (a.argmax(dim=1) == b).float()"\n')
    assert message_leaks(p, _string_literals(chk)) == ["return (a.argmax(dim=1) == b).float()"]


def test_pending_entries_are_still_offenders():
    """An entry fixed in its checks file must leave PENDING too."""
    fixed = [
        (name, lab, line)
        for name, lab, line in sorted(PENDING)
        if line
        not in message_leaks(ROOT / "solutions" / f"{lab}.ipynb", _string_literals(ROOT / "utils" / "checks" / name))
    ]
    assert not fixed, f"not leaked: remove from PENDING: {fixed}"


def _answer_lines() -> set:
    """Lines of the answers (code lines of 20+ characters, comments left out): those of the solution
    blocks and answer keys of solutions/*.ipynb that the lab does not also give outside them, and the
    lines the assessment's reference solution adds to the starter students get."""
    import re

    def lines(text):
        return {t for line in text.splitlines() if len(t := line.strip()) >= 20 and not t.startswith("#")}

    root = authoring.ROOT
    out = set()
    for p in sorted((root / "solutions").glob("*.ipynb")):
        srcs = ["".join(c["source"]) for c in json.loads(p.read_text())["cells"]]
        blocks = [b for src in srcs for b in re.findall(r"### BEGIN (?:SOLUTION|ANSWER KEY)\n(.*?)### END", src, re.S)]
        given = "\n".join(re.sub(r"### BEGIN (SOLUTION|ANSWER KEY)\n.*?### END[^\n]*", "", s, flags=re.S) for s in srcs)
        out |= {t for b in blocks for t in lines(b)} - lines(given)
    starter = lines("\n".join(p.read_text() for p in (root / "labs" / "assessment").glob("*.*")))  # and the brief
    return out | (lines("\n".join(p.read_text() for p in (root / "solutions" / "assessment").glob("*.py"))) - starter)


def _stripped_lines(text: str) -> set:
    """Each line stripped; a notebook's lines are those of its cells' sources."""
    try:
        cells = json.loads(text)["cells"]
    except (ValueError, KeyError, TypeError):
        return {line.strip() for line in text.splitlines()}
    return {line.strip() for c in cells for line in "".join(c["source"]).splitlines()}


def test_a_release_holds_no_answer(tmp_path):
    """What students get: labs without answers, the demos and the library, no solutions/ and no
    tests/. The library implements what the labs ask for by hand (their checks refuse it), so an
    answer line it also shows reveals nothing; every other answer line is nowhere in the release."""
    dest = tmp_path / "release"
    n = authoring.release(dest)
    files = [p for p in dest.rglob("*") if p.is_file()]
    assert n == len(files) and not (dest / "solutions").exists() and not (dest / "tests").exists()
    assert (dest / "labs" / "lab3_ddp.ipynb").is_file() and (dest / "labs" / "assessment" / "README.md").is_file()
    texts = {p: p.read_text(errors="ignore") for p in files}
    shown = "\n".join(
        t for p, t in texts.items() if p.relative_to(dest).parts[0] in ("utils", "notebooks", "benchmarks")
    )
    revealing = {line for line in _answer_lines() if line not in shown}
    assert len(revealing) > 100, "the scan has answers to look for"
    leaks = [f"{p.relative_to(dest)}: {line}" for p, t in texts.items() for line in revealing & _stripped_lines(t)]
    assert not leaks, leaks[:10]
    markers = {authoring.BEGIN, authoring.KEY_BEGIN}
    assert not [p for p, t in texts.items() if p.suffix == ".ipynb" and markers & _stripped_lines(t)]
    with pytest.raises(authoring.AuthoringError, match="exists"):
        authoring.release(dest)
