"""The set-up files agree with each other, and labs/ is generated from solutions/."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONDA_NAMES = {"torch": "pytorch"}  # pip name -> conda-forge name
# conda-forge packages with no pip name: the hub's proxy is an npm package (make hub-proxy under pip)
CONDA_ONLY = {"configurable-http-proxy"}


def _name(req: str) -> str:
    return re.split(r"[\s<>=!~;\[]", req.strip(), maxsplit=1)[0].lower()


def _pyproject():
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _environment_names():
    names, in_deps = set(), False
    for line in (ROOT / "environment.yml").read_text().splitlines():
        if line.startswith("dependencies:"):
            in_deps = True
            continue
        m = re.match(r"^  - ([A-Za-z0-9_.\-]+)", line)
        if in_deps and m and not line.strip().startswith("- pip:"):
            names.add(_name(m.group(1)))
    return names


def test_environment_yml_names_the_same_dependencies_as_pyproject():
    proj = _pyproject()["project"]
    wanted = {CONDA_NAMES.get(_name(r), _name(r)) for r in proj["dependencies"]}
    wanted |= {_name(r) for extra in ("test", "hub") for r in proj["optional-dependencies"][extra]}
    have = _environment_names() - {"python", "pip"} - CONDA_ONLY
    assert wanted == have, (
        f"environment.yml and pyproject.toml disagree: only in pyproject {wanted - have}, "
        f"only in environment.yml {have - wanted}"
    )


def test_cpu_constraint_pins_torch():
    lines = [
        l.strip() for l in (ROOT / "constraints.txt").read_text().splitlines() if l.strip() and not l.startswith("#")
    ]
    assert "torch==2.13.0" in lines


def test_the_torch_range_claimed_is_the_range_tested():
    """The README's range runs from the lowest torch a recorded GPU run used (docs/gpu-runs) to the
    one CPU installs pin and CI tests; pyproject.toml and environment.yml ask for the same floor."""
    low, high = re.search(r"tested on torch (\d+\.\d+) through (\d+\.\d+)", (ROOT / "README.md").read_text()).groups()
    pinned = re.search(r"^torch==(\d+\.\d+)\.\d+", (ROOT / "constraints.txt").read_text(), re.M).group(1)
    runs = " ".join(p.read_text() for p in (ROOT / "docs" / "gpu-runs").glob("*.md"))
    ran_on_gpu = {m for m in re.findall(r"torch (\d+\.\d+)\.\d+", runs)}
    assert high == pinned and low == min(ran_on_gpu, key=lambda v: tuple(map(int, v.split(".")))), (
        low,
        high,
        ran_on_gpu,
    )
    assert f'"torch>={low}"' in (ROOT / "pyproject.toml").read_text()
    assert f"pytorch>={low}" in (ROOT / "environment.yml").read_text()


def test_ci_runs_the_readme_command():
    assert "make test" in (ROOT / ".ci" / "run").read_text()
    assert "make test" in (ROOT / "README.md").read_text()


def test_labs_are_up_to_date_with_solutions():
    r = subprocess.run([sys.executable, "-m", "utils.authoring", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, f"labs/ is stale: run `make labs` and commit labs/\n{r.stdout}{r.stderr}"


def test_notebooks_are_small_and_labs_clean():
    import json

    for p in (
        list(ROOT.glob("notebooks/*.ipynb")) + list(ROOT.glob("solutions/*.ipynb")) + list(ROOT.glob("labs/*.ipynb"))
    ):
        assert p.stat().st_size < 2 * 2**20, f"{p} is over 2 MB: clear heavy outputs"
    for p in ROOT.glob("labs/*.ipynb"):
        nb = json.loads(p.read_text())
        for c in nb["cells"]:
            assert not c.get("outputs") and not c.get("execution_count"), f"{p} carries outputs"
            assert "### BEGIN SOLUTION" not in "".join(c["source"]), f"{p} leaks a solution"
