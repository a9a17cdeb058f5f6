"""`make lab` starts JupyterLab on the repository root (as root too), with the news popup off.

Started for real on a free port with --no-browser, polled until the server answers, then stopped.
The oracle is the server's own REST API: /api/contents lists what a student can open."""

import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # starts JupyterLab

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "scaling-labs-test-token"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str):
    req = urllib.request.Request(url, headers={"Authorization": f"token {TOKEN}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.read().decode()


@pytest.fixture(scope="module")
def lab_server(tmp_path_factory):
    if not (ROOT / ".venv" / ".installed-lab").exists():
        pytest.skip("no .venv: `make lab` would install it (minutes); run `make test` first")
    port = _free_port()
    home = tmp_path_factory.mktemp("home")
    env = {**os.environ, "HOME": str(home), "JUPYTER_RUNTIME_DIR": str(home / "runtime")}
    env.pop("JUPYTER_CONFIG_DIR", None)
    args = f"--no-browser --ip 127.0.0.1 --port {port} --IdentityProvider.token={TOKEN}"
    proc = subprocess.Popen(
        ["make", "-s", "lab", f"LAB_ARGS={args}"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 150
    try:
        while True:
            try:
                _get(f"{base}/api/status")
                break
            except (urllib.error.URLError, ConnectionError, OSError):
                if proc.poll() is not None:
                    pytest.fail(f"`make lab` exited with {proc.returncode}:\n{proc.stdout.read()[-3000:]}")
                if time.monotonic() > deadline:
                    pytest.fail("`make lab` did not answer on its port within 150 s")
                time.sleep(0.5)
        yield base, home
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        proc.stdout.close()


def test_make_lab_serves_the_repository_root(lab_server):
    base, _ = lab_server
    root = {item["name"] for item in json.loads(_get(f"{base}/api/contents"))["content"]}
    assert {"notebooks", "labs", "solutions"} <= root, f"the server's root lists {sorted(root)}"
    for folder in ("notebooks", "labs", "solutions"):
        names = {item["name"] for item in json.loads(_get(f"{base}/api/contents/{folder}"))["content"]}
        want = {p.name for p in (ROOT / folder).glob("*.ipynb")}
        assert want and want <= names, f"{folder}/: the server lists {sorted(names)}, the checkout has {sorted(want)}"


def test_make_lab_turns_the_news_popup_off(lab_server):
    base, home = lab_server
    page = _get(f"{base}/lab")
    config = json.loads(
        re.search(r'<script id="jupyter-config-data" type="application/json">(.*?)</script>', page, re.S).group(1)
    )
    assert "@jupyterlab/apputils-extension:announcements" in config.get("disabledExtensions", []), (
        f"the announcements plugin is enabled: disabledExtensions = {config.get('disabledExtensions')}"
    )
    assert not (home / ".jupyter").exists(), "make lab wrote to the user's ~/.jupyter"


def test_make_lab_passes_allow_root_only_as_root():
    out = subprocess.run(["make", "-n", "lab"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    line = next(l for l in out.splitlines() if "jupyter lab" in l and "labextension" not in l)
    assert ("--allow-root" in line) == (os.geteuid() == 0), line
    assert "--ServerApp.root_dir=." in line and line.rstrip().endswith("notebooks/00_environment.ipynb"), line
