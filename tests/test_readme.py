"""The README's shell commands work from a fresh shell (no activated venv).

Every line of every ```bash block in README.md is a command. The convention, in the line's
trailing comment:

* no tag: cheap; this test RUNS it from the repository root, with .venv/bin off PATH and no
  VIRTUAL_ENV, and it must exit 0;
* ``# [slow]`` (minutes, or covered by its own test), ``# [server]`` (starts a server or needs a
  second machine), ``# [gpu]`` (needs a GPU server or conda): not run here, but checked: a
  ``make`` target must exist (``make -n``), a ``.venv/bin/`` program must be installed, a
  ``-m`` module must be importable, and every file or folder it names must exist.

``<...>`` marks a value the reader fills in (a host name, a folder of submissions); such a line
must carry a tag. A bare ``python``, ``torchrun``, ``jupyter`` or ``pytest`` fails from a fresh
shell (`torchrun: not found`, or the system Python without torch), so it is an error unless
the block has activated an environment first (``conda activate``) or the line is tagged
``[gpu]`` (the GPU server's own Python). ``sbatch`` lines need a cluster: they are tagged
``[server]`` and their job script must exist.
"""

import importlib.util
import os
import re
import shlex
import socket
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TAGS = {"slow", "server", "gpu"}
OUTPUT_FLAGS = {"--json", "--csv", "--gradescope", "--out", "-o"}
BARE = {"python", "python3", "torchrun", "jupyter", "pytest", "pip"}


def readme_commands(text: str):
    """(command line, its tags, whether an earlier line of its block ran `conda activate`) for
    every line of every ```bash block."""
    out = []
    for block in re.findall(r"^[ \t]*```bash\n(.*?)^[ \t]*```", text, re.M | re.S):
        activated = False
        for line in block.splitlines():
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            out.append((line, set(re.findall(r"#\s*\[(\w+)\]", line)), activated))
            activated = activated or "conda activate" in line
    return out


COMMANDS = readme_commands((ROOT / "README.md").read_text())


def fresh_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "LAB_PROFILE", "PYTHONPATH")}
    venv_bin = str(ROOT / ".venv" / "bin")
    env["PATH"] = os.pathsep.join(
        p for p in env.get("PATH", "").split(os.pathsep) if p and os.path.realpath(p) != os.path.realpath(venv_bin)
    )
    return env


def _words(line: str) -> list[str]:
    return shlex.split(line, comments=True)


def test_the_readme_has_commands_of_each_kind():
    assert any(not tags for _, tags, _ in COMMANDS), "no command is cheap enough to run"
    assert any("make lab" in line for line, _, _ in COMMANDS) and any("make test" in line for line, _, _ in COMMANDS)
    for tags in (t for _, t, _ in COMMANDS):
        assert tags <= TAGS, f"unknown tag(s) {tags - TAGS}; known: {sorted(TAGS)}"


@pytest.mark.parametrize("line,tags,activated", COMMANDS, ids=[c[0][:60] for c in COMMANDS])
def test_each_command_works_from_a_fresh_shell(line, tags, activated):
    words = _words(line)
    while words and re.match(r"^[A-Z_]+=", words[0]):
        words = words[1:]
    prog = words[0]
    if prog in BARE and not activated and "gpu" not in tags:
        pytest.fail(f"`{prog}` is not on PATH in a fresh shell: use a make target or .venv/bin/{prog}")
    if "<" in line.split("#")[0]:
        assert tags, f"a line with a <placeholder> cannot be run: tag it [slow], [server] or [gpu]: {line}"
    if not tags:
        r = subprocess.run(["bash", "-c", line], cwd=ROOT, env=fresh_env(), capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, f"`{line}` exited {r.returncode}:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
        return
    # Not run here: check that what it names exists.
    if prog == "make":
        targets = [w for w in words[1:] if "=" not in w and not w.startswith("-")]
        assigns = [w for w in words[1:] if "=" in w]
        r = subprocess.run(
            ["make", "-n", *targets, *assigns], cwd=ROOT, env=fresh_env(), capture_output=True, text=True
        )
        assert r.returncode == 0, f"`make -n {' '.join(targets)}`: {r.stderr.strip()}"
        for a in assigns:
            value = a.split("=", 1)[1]
            if "/" in value and not value.startswith("-") and "<" not in value:
                assert (ROOT / value).exists(), f"{a}: {value} does not exist"
        return
    if prog == "sbatch":
        scripts = [w for w in words[1:] if w.endswith(".sbatch")]
        assert scripts and (ROOT / scripts[0]).exists(), f"{line}: no job script in cluster/"
        return
    if prog.startswith(".venv/bin/"):
        assert (ROOT / prog).exists(), f"{prog} is not installed by `make lab`"
    elif prog not in ("conda", "ssh") and not (prog in BARE and (activated or "gpu" in tags)):
        pytest.fail(f"`{prog}`: not a make target or a .venv/bin program")
    for i, w in enumerate(words[1:], 1):
        if words[i - 1] == "-m":
            assert importlib.util.find_spec(w) is not None, f"module {w} not found"
        elif (
            not w.startswith("-")
            and "<" not in w
            and "@" not in w
            and words[i - 1] not in OUTPUT_FLAGS
            and ("/" in w or re.search(r"\.(py|toml|yml|yaml|ipynb)$", w))
            and ":" not in w
        ):
            assert (ROOT / w).exists(), f"{line}: {w} does not exist"


@pytest.mark.slow
def test_the_two_node_example_runs():
    """`make two-node`: two torchrun agents on 127.0.0.1 meet through c10d rendezvous (no
    --node-rank) and train one process group of 2 ranks; short settings keep it to seconds."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = subprocess.run(
        [
            "make",
            "-s",
            "two-node",
            f"TWO_NODE_PORT={port}",
            "TWO_NODE_ARGS=--epochs 1 --n-train 256 --n-val 64 --width 8",
        ],
        cwd=ROOT,
        env=fresh_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert r.returncode == 0, f"make two-node exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    assert re.search(r"rank 0 of 2 \(gloo\): 4 steps from epoch 0", r.stdout), r.stdout
    assert (
        "node-rank" not in subprocess.run(["make", "-n", "two-node"], cwd=ROOT, capture_output=True, text=True).stdout
    )
