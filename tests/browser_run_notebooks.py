"""Manual check (not part of `make test`): run notebooks in JupyterLab in headless Chromium,
as a student would, and report any red output.

    apt-get install -y chromium chromium-driver      # Debian; the driver must match the browser
    python3 -m venv /tmp/browser && /tmp/browser/bin/pip install selenium
    LAB_PROFILE=smoke /tmp/browser/bin/python tests/browser_run_notebooks.py [notebooks/NN.ipynb ...]

It copies the checkout to a temporary folder (JupyterLab autosaves: the notebooks in the repository
must stay without outputs), starts `make lab` there on a free port (--no-browser, a token), opens each notebook in a fresh
browser tab, runs Run > Run All Cells, waits until every code cell has an execution count, then
counts what JupyterLab shows in red: stderr outputs, error outputs, and progress bars in the
danger style. Exit status 1 when any notebook shows one. A screenshot per notebook goes to
$OUT (default /tmp/browser-notebooks).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "browser-check"
DEFAULT = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "notebooks").glob("*.ipynb"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_lab(port: int, where: Path) -> subprocess.Popen:
    # JupyterLab 4 renders only the cells in view ("windowing"): turn it off so that every cell's
    # prompt and output are in the page, through a settings override of this server only.
    settings = where.parent / "settings"
    settings.mkdir(exist_ok=True)
    (settings / "overrides.json").write_text(
        json.dumps({"@jupyterlab/notebook-extension:tracker": {"windowingMode": "none"}})
    )
    args = (
        f"--no-browser --ip 127.0.0.1 --port {port} --IdentityProvider.token={TOKEN} "
        f"--LabApp.app_settings_dir={settings} --LabApp.workspaces_dir={where.parent / 'workspaces'}"
    )
    proc = subprocess.Popen(
        ["make", "-s", "lab", f"LAB_ARGS={args}", f"VENV={ROOT / '.venv'}"],
        cwd=where,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    for _ in range(180):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status?token={TOKEN}", timeout=5)
            return proc
        except OSError:
            time.sleep(0.5)
    raise SystemExit("JupyterLab did not start")


def browser() -> webdriver.Chrome:
    opts = webdriver.ChromeOptions()
    opts.binary_location = "/usr/bin/chromium"
    for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        opts.add_argument(a)
    return webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=opts)


PANEL = "document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden)')"
COUNT_JS = (
    """
const panel = """
    + PANEL
    + """;
if (!panel) return {cells: 0, done: 0, running: 0, stderr: [], red_bars: 0};
const cells = [...panel.querySelectorAll('.jp-CodeCell')];
const prompts = cells.map(c => (c.querySelector('.jp-InputPrompt') || {}).textContent || '');
return {
  cells: cells.length,
  done: prompts.filter(p => /\\[\\d+\\]/.test(p)).length,
  running: prompts.filter(p => p.includes('*')).length,
  stderr: [...panel.querySelectorAll('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]')]
            .map(e => e.textContent.slice(0, 400)),
  red_bars: panel.querySelectorAll('.progress-bar-danger, .jupyter-widget-progress-bar.progress-bar-danger, '
            + '.widget-progress .progress-bar-danger').length,
};
"""
)


def run_notebook(drv, port: int, path: str, timeout_s: float) -> dict:
    drv.get(f"http://127.0.0.1:{port}/lab/tree/{path}?reset&token={TOKEN}")  # reset: only this notebook open
    deadline = time.monotonic() + 120
    while not drv.execute_script(f"const p = {PANEL}; return p ? p.querySelectorAll('.jp-CodeCell').length : 0"):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{path}: the notebook did not open")
        time.sleep(1)
    time.sleep(3)  # the kernel starts
    drv.find_element(By.XPATH, "//div[contains(@class,'lm-MenuBar-itemLabel') and text()='Run']").click()
    drv.find_element(By.XPATH, "//div[contains(@class,'lm-Menu-itemLabel') and text()='Run All Cells']").click()
    t0 = time.monotonic()
    while True:
        time.sleep(3)
        state = drv.execute_script(COUNT_JS)
        errors = drv.execute_script(
            f"return [...{PANEL}.querySelectorAll('.jp-OutputArea-output[data-mime-type=\"application/vnd.jupyter.error\"]')]"
            ".map(e => e.textContent.slice(-400))"
        )
        if errors or (state["done"] == state["cells"] and not state["running"]):
            break
        if time.monotonic() - t0 > timeout_s:
            state["timeout"] = True
            break
    state["errors"] = errors
    state["seconds"] = round(time.monotonic() - t0, 1)
    return state


def main(paths: list[str]) -> int:
    out = Path(os.environ.get("OUT", "/tmp/browser-notebooks"))
    out.mkdir(parents=True, exist_ok=True)
    import shutil
    import tempfile

    copy = Path(tempfile.mkdtemp(prefix="browser-lab-")) / "repo"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns(".venv", ".git", "__pycache__"))
    port = free_port()
    lab = start_lab(port, copy)
    bad = 0
    try:
        for path in paths:
            drv = browser()
            try:
                res = run_notebook(drv, port, path, timeout_s=float(os.environ.get("NB_TIMEOUT_S", 1200)))
                drv.save_screenshot(str(out / (Path(path).stem + ".png")))
            finally:
                drv.quit()
            red = bool(res["stderr"] or res["errors"] or res["red_bars"] or res.get("timeout"))
            bad += red
            print(json.dumps({"notebook": path, **res}), flush=True)
    finally:
        os.killpg(lab.pid, signal.SIGTERM)
        lab.wait(timeout=30)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or DEFAULT))
