"""The course site (utils/site.py, `make site`), opened in a real headless browser.

The browser tests build a small site themselves (`--profile smoke --only 00_`: one demo executed, its
kept GPU run and its lab), or, with SITE_DIR set (`make site-check`), test the site already built
there, which must be the whole course. Chromium is driven by selenium through Debian's chromedriver
(`/usr/bin/chromedriver`, so selenium never fetches a driver), with every host name but 127.0.0.1
made unresolvable: a page that needed the internet would show it as a failed load. The oracles
come from outside the HTML: the executed notebooks' own outputs (how many images, how many stderr
outputs, their kernels' timestamps), the folders of notebooks and labs, and each notebook's first heading.
"""

from __future__ import annotations

import datetime as dt
import functools
import http.server
import importlib.util
import json
import os
import re
import subprocess
import sys
import threading
import time
from html.parser import HTMLParser
from pathlib import Path

import nbformat
import pytest

from utils import device, site

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
SMOKE_ONLY = "00_"  # the demos the self-built site executes: about 30-60 s on 2 busy cores

pytestmark = pytest.mark.site


def _browser_missing() -> str:
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.exists()]
    if importlib.util.find_spec("selenium") is None:
        missing.append("the selenium package (pip install -e '.[test]')")
    if not missing:
        return ""
    return f"needs a headless browser: {', '.join(missing)} missing (apt-get install chromium chromium-driver)"


needs_browser = pytest.mark.skipif(bool(_browser_missing()), reason=_browser_missing() or "-")


def first_heading(path: Path) -> str:
    """The notebook's first markdown heading, read here without utils.site."""
    for cell in json.loads(path.read_text())["cells"]:
        if cell["cell_type"] == "markdown":
            for line in "".join(cell["source"]).splitlines():
                if line.startswith("#"):
                    return re.sub(r"[*_`]", "", line.lstrip("#").strip())
    return ""


def cells_span_s(nb) -> float:
    """First code cell's start to the last one's reply, from the kernel's own timestamps."""
    ex = [c["metadata"]["execution"] for c in nb["cells"] if c["cell_type"] == "code" and "execution" in c["metadata"]]
    t = [
        dt.datetime.strptime(s[:26].rstrip("Z"), "%Y-%m-%dT%H:%M:%S.%f")
        for s in (ex[0]["iopub.status.busy"], ex[-1]["shell.execute_reply"])
    ]
    return (t[1] - t[0]).total_seconds()


def shown_seconds(text: str) -> int:
    """The seconds of the first "N min SS s" or "N s" in text."""
    m = re.search(r"(?:(\d+) min (\d+)|(\d+)) s\b", text)
    assert m, f"no time in {text!r}"
    return int(m.group(1)) * 60 + int(m.group(2)) if m.group(1) else int(m.group(3))


def outputs_of(nb, kind: str) -> int:
    """Image outputs (what nbconvert draws as <img>) or stderr/error outputs of an executed notebook."""
    n = 0
    for cell in nb["cells"]:
        for o in cell.get("outputs", []):
            if kind == "image":
                n += o["output_type"] in ("display_data", "execute_result") and bool(
                    {"image/png", "image/jpeg"} & set(o["data"])
                )
            else:
                n += o["output_type"] == "error" or (o["output_type"] == "stream" and o["name"] == "stderr")
    return n


FORMULA = re.compile(r"\$\$(.+?)\$\$|(?<![$\\])\$(.+?)(?<![$\\])\$", re.S)


CODE = re.compile(r"```.*?```|`[^`]*`", re.S)  # a `$` in code is a shell's, not a formula


def formulas_of(nb) -> int:
    """How many $...$ and $$...$$ formulas the notebook's markdown cells hold outside code."""
    return sum(
        len(FORMULA.findall(CODE.sub("", "".join(c["source"])))) for c in nb["cells"] if c["cell_type"] == "markdown"
    )


def newest_gpu_run() -> Path | None:
    runs = [p for p in sorted((ROOT / "docs" / "gpu-runs").glob("*/")) if list(p.glob("*.ipynb"))]
    return runs[-1] if runs else None


class Links(HTMLParser):
    def __init__(self):
        super().__init__()
        self.hrefs, self.rows, self._row = [], [], None

    def handle_starttag(self, tag, attrs):
        if tag == "a" and dict(attrs).get("href"):
            self.hrefs.append(dict(attrs)["href"])
            if self._row is not None:
                self._row["hrefs"].append(dict(attrs)["href"])
        if tag == "tr":
            self._row = {"hrefs": [], "text": ""}

    def handle_endtag(self, tag):
        if tag == "tr" and self._row is not None:
            self.rows.append(self._row)
            self._row = None

    def handle_data(self, data):
        if self._row is not None:
            self._row["text"] += data + " "


def parse_links(text: str) -> Links:
    p = Links()
    p.feed(text)
    return p


# --- the front page as a function: every demo and lab listed (fast, nothing executed) ---


def test_the_front_page_lists_every_demo_and_its_lab_and_each_gpu_run():
    demos = sorted((ROOT / "notebooks").glob("*.ipynb"))
    labs = sorted((ROOT / "labs").glob("*.ipynb"))
    gpu = {p.name for p in (newest_gpu_run() or ROOT).glob("*.ipynb")}
    pages, course = [], []
    for i, d in enumerate(demos):
        lab = site.lab_of(d)
        course.append((d.stem, lab.stem if lab else None))
        pages.append(site.Page("cpu", d.stem, f"title {i}", f"cpu/{d.stem}.html", "", "cpu label", 60.0 * i + 5, 0))
        if d.name in gpu:
            pages.append(site.Page("gpu", d.stem, f"title {i}", f"gpu/{d.stem}.html", "", "gpu label", 7.0, 0))
        if lab:
            pages.append(site.Page("lab", lab.stem, f"lab title {i}", f"labs/{lab.stem}.html", "", "lab", None, 0))
    links = parse_links(site.front_page(pages, course))

    assert len(links.rows) == len(demos) + 1  # the header, then one row per demo, in order
    for i, (d, row) in enumerate(zip(demos, links.rows[1:])):
        n = int(d.name[:2])
        want = [f"cpu/{d.stem}.html"] + ([f"gpu/{d.stem}.html"] if d.name in gpu else [])
        want += [f"labs/{p.stem}.html" for p in labs if p.name.startswith(f"lab{n}_")]
        assert row["hrefs"] == want, f"row of {d.name}"
        assert f"title {i}" in row["text"] and shown_seconds(row["text"]) == 60 * i + 5
    linked_labs = {h for h in links.hrefs if h.startswith("labs/")}
    assert linked_labs == {f"labs/{p.stem}.html" for p in labs}, "every lab of labs/ is on the front page"


def test_a_widget_is_drawn_from_its_saved_state():
    state = {
        "a": {"model_name": "HBoxModel", "state": {"children": ["IPY_MODEL_b", "IPY_MODEL_c", "IPY_MODEL_d"]}},
        "b": {"model_name": "HTMLModel", "state": {"value": "B=8: 100%", "description": ""}},
        "c": {"model_name": "FloatProgressModel", "state": {"value": 350.0, "min": 0.0, "max": 350.0}},
        "d": {
            "model_name": "SelectionSliderModel",
            "state": {"_options_labels": ["1", "2", "4"], "index": 2, "description": "batch size"},
        },
    }
    view = {"model_id": "a", "version_major": 2, "version_minor": 0}
    nb = nbformat.v4.new_notebook(metadata={"widgets": {site.WIDGET_STATE: {"state": state}}})
    nb.cells.append(
        nbformat.v4.new_code_cell(
            outputs=[nbformat.v4.new_output("display_data", data={site.WIDGET_VIEW: view, "text/plain": "HBox()"})]
        )
    )
    site.static_widgets(nb)
    data = nb.cells[0].outputs[0].data
    assert site.WIDGET_VIEW not in data and "widgets" not in nb.metadata
    assert "B=8: 100%" in data["text/html"] and '<progress value="350.0" max="350.0">' in data["text/html"]
    assert "batch size: 4" in data["text/html"]


def test_the_gpu_label_reads_what_the_run_printed():
    info = {
        "cpu": "Test CPU",
        "cpu_cores": 16,
        "torch_threads": 3,
        "python": "3.12.3",
        "torch": "9.9.9+cu999",
        "cuda": "99.0",
        "cudnn": 1,
        "gpus": [
            {"index": 0, "name": "Test GPU 9000", "memory_gib": 80.0, "capability": "9.0", "multiprocessors": 132}
        ],
        "driver": "1.2.3",
    }
    printed = "profile: gpu  (set LAB_PROFILE ...)\n" + device.hardware_summary(info) + "\n"
    nb = nbformat.v4.new_notebook()
    nb.cells.append(nbformat.v4.new_code_cell(outputs=[nbformat.v4.new_output("stream", name="stdout", text=printed)]))
    nb.cells[0].metadata["execution"] = {
        "iopub.status.busy": "2026-01-02T03:04:05.000000Z",
        "shell.execute_reply": "2026-01-02T03:05:15.500000Z",
    }
    label = site.gpu_label(nb, Path("2026-01-02-test"))
    for want in ("Test GPU 9000", "Test CPU", "torch 9.9.9+cu999", "profile gpu", "2026-01-02"):
        assert want in label
    assert shown_seconds(label.split("wall time")[1]) == 70


# --- a build that fails leaves nothing, and names the notebook and the cell ---


def _notebook(folder: Path, name: str, *sources: str) -> Path:
    nb = nbformat.v4.new_notebook(
        cells=[nbformat.v4.new_markdown_cell(f"# {name}")] + [nbformat.v4.new_code_cell(s) for s in sources]
    )
    path = folder / name
    nbformat.write(nb, str(path))
    return path


@pytest.mark.slow
@pytest.mark.parametrize(
    "cell, want",
    [
        ("1 / 0", "cell 2 raised ZeroDivisionError"),
        ("import sys; print('disk almost full', file=sys.stderr)", "cell 2 wrote to stderr: disk almost full"),
    ],
)
def test_a_failing_cell_stops_the_build_with_one_line_and_the_old_site_stays(tmp_path, capsys, cell, want):
    demos, nothing = tmp_path / "demos", tmp_path / "nothing"
    demos.mkdir(), nothing.mkdir()
    _notebook(demos, "00_first.ipynb", "x = 1")
    _notebook(demos, "01_broken.ipynb", "y = 2", cell)
    out = tmp_path / "out" / "site"
    out.mkdir(parents=True)
    (out / "index.html").write_text("the previous site")
    args = [
        "build",
        "--out",
        str(out),
        "--profile",
        "smoke",
        "--notebooks",
        str(demos),
        "--labs",
        str(nothing),
        "--gpu-run",
        str(nothing),
    ]
    assert site.main(args) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("site: ") and "01_broken.ipynb" in err[-1] and want in err[-1], err
    assert "Try: " in err[-1] and sum("01_broken.ipynb cell" in line for line in err) == 1
    assert (out / "index.html").read_text() == "the previous site"
    assert sorted(p.name for p in out.parent.iterdir()) == ["site"], "no half-built folder is left beside it"


def kernels_in(folder: Path) -> list[int]:
    """Pids of the Jupyter kernels running in ``folder`` (each runs in its notebook's folder)."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if (
                b"ipykernel_launcher" in (proc / "cmdline").read_bytes()
                and (proc / "cwd").resolve() == folder.resolve()
            ):
                found.append(int(proc.name))
        except OSError:
            pass  # gone meanwhile, or not ours to read
    return found


@pytest.mark.slow
def test_a_cell_marked_stderr_expected_may_write_there_and_no_kernel_is_left(tmp_path):
    demos, nothing = tmp_path / "demos", tmp_path / "nothing"
    demos.mkdir(), nothing.mkdir()
    _notebook(
        demos,
        "00_warns.ipynb",
        "# stderr expected: the page shows a warning\nimport sys; print('careful', file=sys.stderr)",
    )
    _notebook(demos, "01_quiet.ipynb", "z = 3")
    pages = site.build(tmp_path / "site", profile="smoke", notebooks=demos, labs=nothing, gpu_run=None)
    assert [p.kind for p in pages] == ["cpu", "cpu"]
    assert "careful" in (tmp_path / "site" / "cpu" / "00_warns.html").read_text()
    assert kernels_in(demos) == [], "every notebook's kernel is stopped when it has run"


def test_a_gpu_run_folder_that_does_not_exist_is_refused_with_what_to_do(tmp_path, capsys):
    assert site.main(["build", "--out", str(tmp_path / "site"), "--gpu-run", str(tmp_path / "typo")]) == 2
    assert "is not a folder. Try: --gpu-run docs/gpu-runs/" in capsys.readouterr().err
    assert not (tmp_path / "site").exists()


@pytest.mark.slow
def test_a_killed_build_leaves_the_old_site_and_the_next_build_clears_its_folder(tmp_path):
    demos, nothing = tmp_path / "demos", tmp_path / "nothing"
    demos.mkdir(), nothing.mkdir()
    long = _notebook(demos, "00_long.ipynb", "import time; time.sleep(120)")
    out = tmp_path / "out" / "site"
    out.mkdir(parents=True)
    (out / "index.html").write_text("the previous site")
    cmd = [sys.executable, "-m", "utils.site", "build", "--out", str(out), "--profile", "smoke"]
    cmd += ["--notebooks", str(demos), "--labs", str(nothing), "--gpu-run", str(nothing)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    build = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not kernels_in(demos) and time.monotonic() < deadline and build.poll() is None:
            time.sleep(0.5)
        assert kernels_in(demos), "the notebook's kernel started"
    finally:
        build.kill()  # as a CI timeout would: no clean-up runs
        build.wait()
    deadline = time.monotonic() + 20
    while kernels_in(demos) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert kernels_in(demos) == [], "the kernel stops when the build that started it is gone"
    assert (out / "index.html").read_text() == "the previous site"
    assert [p.name for p in out.parent.iterdir() if p.name.startswith(".site-")], "the killed build's folder"

    long.unlink()
    _notebook(demos, "00_short.ipynb", "x = 1")
    assert site.main(cmd[3:]) == 0
    assert sorted(p.name for p in out.parent.iterdir()) == ["site"], "the next build cleared what was left"
    assert (out / "cpu" / "00_short.html").exists()


# --- the built site, in a browser ---


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(site folder, the demos it must hold): SITE_DIR's (the whole course), else a smoke build of SMOKE_ONLY."""
    if os.environ.get("SITE_DIR"):
        folder = Path(os.environ["SITE_DIR"])
        if not (folder / "index.html").exists():
            pytest.fail(f"SITE_DIR={folder} holds no site. Try: make site")
        return folder, sorted((ROOT / "notebooks").glob("*.ipynb"))
    folder = tmp_path_factory.mktemp("site") / "site"
    cmd = [
        sys.executable,
        "-m",
        "utils.site",
        "build",
        "--out",
        str(folder),
        "--profile",
        "smoke",
        "--only",
        SMOKE_ONLY,
    ]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return folder, sorted((ROOT / "notebooks").glob(f"{SMOKE_ONLY}*.ipynb"))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_front_page_links_every_page_and_each_link_resolves(built):
    folder, demos = built
    index = (folder / "index.html").read_text()
    links = parse_links(index)
    gpu = newest_gpu_run()
    for d in demos:
        nb = json.loads((folder / "cpu" / d.name).read_text())
        row = next(r for r in links.rows if f"cpu/{d.stem}.html" in r["hrefs"])
        assert first_heading(d) in row["text"], f"{d.name}'s title is on its row"
        assert abs(shown_seconds(row["text"]) - cells_span_s(nb)) <= 1, f"{d.name}'s time is its cells' wall time"
        assert (f"gpu/{d.stem}.html" in row["hrefs"]) == (gpu is not None and (gpu / d.name).exists())
        labs = [f"labs/{p.stem}.html" for p in (ROOT / "labs").glob(f"lab{int(d.name[:2])}_*.ipynb")]
        assert all(h in row["hrefs"] for h in labs)
    assert len(links.rows) == len(demos) + 1
    missing = [h for h in links.hrefs if not (folder / h).is_file()]
    assert not missing, f"the front page links files that are not there: {missing}"
    assert site.check(folder) == []


@pytest.fixture(scope="module")
def served(built):
    folder = built[0]

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(folder)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = str(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1200,900"):
        opts.add_argument(arg)
    opts.add_argument("--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1")  # offline: nothing else resolves
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=opts)
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


IMAGES = "return Array.from(document.images).map(i => [i.complete, i.naturalWidth])"
RESOURCES = "return performance.getEntriesByType('resource').map(e => e.name)"
MATH = "return Array.from(document.querySelectorAll('math')).map(m => m.getBoundingClientRect().width)"
STDERR = '.jp-RenderedText[data-mime-type="application/vnd.jupyter.stderr"]'


@needs_browser
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_page_loads_in_chromium_with_its_figures_and_no_error(built, served, browser):
    from selenium.webdriver.common.by import By

    folder, demos = built
    pages = {p["html"]: p for p in json.loads((folder / "site.json").read_text())["pages"]}
    want_kinds = {"cpu"} | ({"gpu"} if newest_gpu_run() else set()) | {"lab"}
    assert {p["kind"] for p in pages.values()} == want_kinds
    assert {p["stem"] for p in pages.values() if p["kind"] == "cpu"} == {d.stem for d in demos}
    problems = []
    for path in sorted(folder.rglob("*.html")):
        rel = path.relative_to(folder).as_posix()
        browser.get(served + rel)
        if not browser.title.strip() or browser.title == "Error response":
            problems.append(f"{rel}: no title ({browser.title!r})")
        severe = [e["message"] for e in browser.get_log("browser") if e["level"] == "SEVERE"]
        problems += [f"{rel}: console error {m}" for m in severe]
        outside = [
            u for u in browser.execute_script(RESOURCES) if not u.startswith(served) and not u.startswith("data:")
        ]
        problems += [f"{rel}: loads {u}" for u in outside]
        images = browser.execute_script(IMAGES)
        problems += [
            f"{rel}: image {i} not drawn" for i, (done, width) in enumerate(images) if not (done and width > 0)
        ]
        text = browser.find_element(By.TAG_NAME, "body").text
        if "HBox(" in text or "FloatProgress(" in text:
            problems.append(f"{rel}: a widget shown as its Python repr")
        page = pages.get(rel)
        if page is None:
            continue
        nb = json.loads((folder / page["ipynb"]).read_text())
        source = ROOT / ("labs" if page["kind"] == "lab" else "notebooks") / f"{page['stem']}.ipynb"
        if first_heading(source) not in browser.title:
            problems.append(f"{rel}: title {browser.title!r} is not {first_heading(source)!r}")
        if len(images) != outputs_of(nb, "image"):
            problems.append(f"{rel}: {len(images)} images shown, the executed notebook has {outputs_of(nb, 'image')}")
        widths = browser.execute_script(MATH)
        if len(widths) != formulas_of(nb) or not all(w > 0 for w in widths):
            problems.append(
                f"{rel}: {len(widths)} formulas drawn ({sum(w > 0 for w in widths)} with a width), the notebook has {formulas_of(nb)}"
            )
        # What this build executed may not write to stderr; a kept GPU run shows what it wrote.
        want_stderr = outputs_of(nb, "stderr") if page["kind"] == "gpu" else 0
        shown = len(browser.find_elements(By.CSS_SELECTOR, STDERR))
        if shown != want_stderr:  # nbconvert's lab template shows error outputs (tracebacks) as stderr too
            problems.append(f"{rel}: {shown} stderr/error outputs shown, expected {want_stderr}")
        label = browser.find_element(By.CSS_SELECTOR, ".site-label").text
        if page["kind"] in ("cpu", "gpu"):
            if "torch" not in label or "profile" not in label:
                problems.append(f"{rel}: the label does not say the hardware and profile: {label!r}")
            elif abs(shown_seconds(label.split("wall time")[-1]) - cells_span_s(nb)) > 1:
                problems.append(f"{rel}: the label's wall time is not the cells' {cells_span_s(nb):.0f} s: {label!r}")
        if page["kind"] == "cpu" and f"{os.cpu_count()} cores" not in label and not os.environ.get("SITE_DIR"):
            problems.append(f"{rel}: the label does not give this machine's {os.cpu_count()} cores: {label!r}")
    assert not problems, "\n".join(problems)


def test_a_formula_becomes_mathml_and_an_unknown_command_names_itself():
    page = site.markdown_page(ROOT / "README.md")  # the README has no formula: nothing is turned
    assert "<math" not in page
    drawn = site.mathml(r"\frac{a}{b} \le \sqrt{x}", display=False)
    assert drawn.startswith("<math") and "<mfrac>" in drawn and "<msqrt>" in drawn and 'display="inline"' in drawn
    assert 'display="block"' in site.mathml("x^2", display=True)
    from nbconvert.filters.markdown_mistune import MarkdownWithMath

    heading = MarkdownWithMath(renderer=site.math_renderer()(escape=False)).render("## Cost: $6N$\n")
    assert "<h2" in heading and "<math " in heading and "ns0:" not in heading  # a browser draws only <math>
    with pytest.raises(site.SiteError, match=r"uses \\foo, which cannot be drawn"):
        site.mathml(r"a + \foo{x}", display=False)
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell(r"# T\n\nCost $\foo{x}$.")])
    with pytest.raises(site.SiteError, match=r"^Page T: the formula .* uses \\foo"):
        site.render(nb, "Page T", "lab", "label")
