"""The course as a static site: every demo executed, rendered with the labs as students get them.

``python -m utils.site build --out build/site`` (``make site``):

* executes each notebook of ``notebooks/`` top to bottom with nbclient, a fresh kernel per notebook
  (this interpreter's), in the ``cpu`` profile on the stand-in datasets (``--profile smoke`` for a
  quick build); an error or anything written to stderr stops the build with one line naming the
  notebook and the cell (a cell marked ``# stderr expected: <why>`` may write to stderr, as under nbval);
* adds the newest GPU run kept in ``docs/gpu-runs/<run>/`` (executed notebooks, not run again here);
* renders those and ``labs/*.ipynb`` (not executed: no outputs, no answers) to HTML with nbconvert's
  ``lab`` template, each page labelled at its top with the hardware, profile and wall time of its run;
* writes ``index.html``, the course map, and ``site.json``, what each page is;
* builds into a temporary folder beside ``--out`` and renames it into place, so a failed build leaves
  the previous site (or none), never half of one.

The pages need nothing from the internet: the template's CSS is inlined by nbconvert, and the blocks
that load require.js, MathJax, mermaid and the widget manager from a CDN are left out; formulas are turned
into MathML when the page is built (latex2mathml), which the browser draws itself; a widget's output is drawn from its saved state as plain HTML (a progress bar
as ``<progress>``, a slider at its value), since the widget manager's JavaScript is not available offline.

``python -m utils.site check build/site``: every relative link of every page leads to a file of the site,
each page carries its label, and no page loads anything from outside the site (links to the web are fine).

A page's relative link to a file of the repository (``../docs/REFERENCES.md``) is kept working: the file
is put at the same place in the site, a Markdown file rendered as an HTML page.
"""

from __future__ import annotations

import argparse
import datetime as dt
import html
import json
import os
import re
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
LABS = ROOT / "labs"
GPU_RUNS = ROOT / "docs" / "gpu-runs"  # one folder of executed notebooks per GPU run; the newest is published
STDERR_OK = "# stderr expected:"  # the same escape as nbval's stderr rule (conftest.py)
CELL_TIMEOUT_S = 1800
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
IMAGE_MIMES = ("image/png", "image/jpeg")  # what nbconvert renders as an <img>

# nbconvert's lab template without what it loads from a CDN (require.js, MathJax, mermaid, the widget
# manager), with the page's label first in the body.
TEMPLATE = """{%- extends 'index.html.j2' -%}
{%- block html_head_js -%}{%- endblock html_head_js -%}
{%- block jupyter_widgets -%}{%- endblock jupyter_widgets -%}
{%- block html_head_js_mathjax -%}{%- endblock html_head_js_mathjax -%}
{%- block html_head_js_mermaidjs -%}{%- endblock html_head_js_mermaidjs -%}
{%- block extra_css -%}<link rel="icon" href="data:,"><style>
.site-label { font: 14px/1.5 sans-serif; background: #eef3f8; border-bottom: 1px solid #c8d4e0; padding: 0.6em 1em; }
.site-widget { display: flex; gap: 0.5em; align-items: center; font: 13px monospace; }
</style>{%- endblock extra_css -%}
{%- block body_header -%}{{ super() }}
<header class="site-label" data-kind="{{ resources.site_kind }}"><a href="../index.html">Scaling Labs</a> &middot;
{{ resources.site_label }}</header>
{%- endblock body_header -%}
"""


class SiteError(Exception):
    """A notebook that cannot be published; the message is one line naming it and the cell."""


@dataclass
class Page:
    kind: str  # "cpu" (executed here), "gpu" (a kept GPU run) or "lab" (as students get it)
    stem: str  # the notebook's file name without .ipynb
    title: str  # its first markdown heading
    html: str  # the page, relative to the site's root
    ipynb: str  # the notebook the page was rendered from, copied beside it
    label: str  # the line at the page's top, plain text
    wall_s: float | None  # from the first cell's start to the last cell's end; None for a lab
    stderr_outputs: int  # stderr outputs the page shows (a kept GPU run's; 0 for what the build executes)


def title_of(nb: Any) -> str:
    """The text of the notebook's first markdown heading, else its file's stem is up to the caller."""
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                if m := re.match(r"\s{0,3}#{1,6}\s+(.+?)\s*#*\s*$", line):
                    return re.sub(r"[*_`]", "", m.group(1))
    return ""


def lab_of(notebook: Path, labs: Path = LABS) -> Path | None:
    """The lab that goes with a demo: notebooks/0N_* -> labs/labN_*."""
    m = re.match(r"(\d+)_", notebook.name)
    found = sorted(labs.glob(f"lab{int(m.group(1))}_*.ipynb")) if m else []
    return found[0] if found else None


def newest_gpu_run(runs: Path = GPU_RUNS) -> Path | None:
    """The last folder of ``runs`` (by name: they start with their date) that holds notebooks."""
    folders = [p for p in sorted(runs.glob("*/")) if any(p.glob("*.ipynb"))] if runs.is_dir() else []
    return folders[-1] if folders else None


def selected(notebooks: Path, only: list[str] | None) -> list[Path]:
    paths = sorted(notebooks.glob("*.ipynb"))
    if only:
        paths = [p for p in paths if any(p.name.startswith(prefix) for prefix in only)]
    return paths


def wall_seconds(nb: Any) -> float | None:
    """From the first code cell's start to the last one's reply, as the kernel stamped them."""
    stamps = [c.metadata.get("execution", {}) for c in nb.cells if c.cell_type == "code"]
    stamps = [s for s in stamps if "iopub.status.busy" in s and "shell.execute_reply" in s]
    if not stamps:
        return None
    start = dt.datetime.fromisoformat(stamps[0]["iopub.status.busy"].replace("Z", "+00:00"))
    end = dt.datetime.fromisoformat(stamps[-1]["shell.execute_reply"].replace("Z", "+00:00"))
    return (end - start).total_seconds()


def format_seconds(s: float | None) -> str:
    if s is None:
        return "-"
    m, sec = divmod(round(s), 60)
    return f"{m} min {sec:02d} s" if m else f"{sec} s"


def _outputs(nb: Any, kind: str):
    for i, cell in enumerate(nb.cells):
        for out in cell.get("outputs", []):
            if kind == "error" and out.output_type == "error":
                yield i, cell, out
            elif kind == "stderr" and out.output_type == "stream" and out.name == "stderr":
                yield i, cell, out


def image_outputs(nb: Any) -> int:
    """How many outputs of the notebook nbconvert draws as an image."""
    return sum(
        1
        for c in nb.cells
        for o in c.get("outputs", [])
        if o.get("output_type") in ("display_data", "execute_result")
        and any(m in o.get("data", {}) for m in IMAGE_MIMES)
    )


def refuse_errors(nb: Any, name: str, hint: str, allow_stderr: bool = False) -> None:
    """SiteError naming the first cell (counted from 0, markdown cells included) with an error output, or
    with stderr unless the cell says it is expected."""
    for i, _cell, out in _outputs(nb, "error"):
        what = out.evalue.splitlines()[0][:200] if out.evalue else ""
        raise SiteError(f"site: {name} cell {i} raised {out.ename}: {what}. Try: {hint}")
    if not allow_stderr:
        for i, cell, out in _outputs(nb, "stderr"):
            if STDERR_OK not in cell.source:
                first = next((line for line in out.text.splitlines() if line.strip()), "")
                raise SiteError(
                    f"site: {name} cell {i} wrote to stderr: {first[:200]}. Try: fix its cause, or mark the "
                    f"cell `{STDERR_OK} <why>`"
                )


# A cell run after the notebook's last, in its kernel, then removed: what the run itself ran on.
PROBE = (
    "import json as _j, utils.config as _c, utils.data as _d, utils.device as _h\n"
    "print(_j.dumps({**_h.describe_hardware(), 'profile': _c.profile().name, 'standin': _d.use_standins()}))"
)


def execute(path: Path, profile: str, name: str) -> tuple[object, dict]:
    """Run the notebook at ``path`` in a fresh kernel of this interpreter; return it with its outputs
    and what it ran on. SiteError names the cell on an error or unexpected stderr."""
    import nbclient
    import nbformat
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager

    nb = nbformat.read(str(path), as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(PROBE))
    env = dict(os.environ, LAB_PROFILE=profile, LAB_DATA="standin")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.pop("MPLBACKEND", None)  # the kernel's own inline backend, so figures are outputs
    # No kernel folders: "python3" is then ipykernel's own spec, this interpreter (sys.executable).
    km = KernelManager(kernel_name="python3", kernel_spec_manager=KernelSpecManager(kernel_dirs=[]))
    client = nbclient.NotebookClient(
        nb,
        km=km,
        timeout=CELL_TIMEOUT_S,
        resources={"metadata": {"path": str(path.parent)}},
        extra_arguments=["--IPKernelApp.log_level=ERROR"],  # no notice about TCP on stderr
    )
    try:
        client.execute(env=env)
    except nbclient.exceptions.CellExecutionError:
        pass  # the error output is in the notebook; refuse_errors names its cell
    finally:
        if km.has_kernel:  # nbclient stops only the kernels of managers it made itself
            km.shutdown_kernel(now=True)
    refuse_errors(nb, name, f"run it in JupyterLab with LAB_PROFILE={profile} LAB_DATA=standin to see the traceback")
    probe = nb.cells.pop()
    text = "".join(o.get("text", "") for o in probe.get("outputs", []) if o.get("output_type") == "stream")
    return nb, json.loads(text.strip().splitlines()[-1])


def cpu_label(info: dict, nb: Any) -> str:
    data = ", stand-in datasets" if info.get("standin") else ""
    start = next((c.metadata["execution"]["iopub.status.busy"][:10] for c in nb.cells if "execution" in c.metadata), "")
    gpus = "; ".join(g["name"] for g in info.get("gpus", [])) or "no GPU"
    return (
        f"Executed by make site on {start}: {info['cpu']} ({info['cpu_cores']} cores), {gpus}, torch {info['torch']}, "
        f"Python {info['python']}; profile {info['profile']}{data}; wall time {format_seconds(wall_seconds(nb))}"
    )


HARDWARE_LINE = re.compile(r"^(CPU {4}|torch  |GPU \d+  )(.+)$")


def gpu_label(nb: Any, run: Path) -> str:
    """The kept run's hardware as the notebook printed it (``device.hardware_summary``), else the first
    paragraph of the run's notes (``<run>.md``)."""
    text = "".join(
        o.get("text", "") for c in nb.cells for o in c.get("outputs", []) if o.get("output_type") == "stream"
    )
    seen = {}
    for line in text.splitlines():
        if (m := HARDWARE_LINE.match(line)) and m.group(1).split()[0] not in seen:
            seen[m.group(1).split()[0]] = " ".join(line.split())
    hardware = "; ".join(seen[k] for k in ("GPU", "CPU", "torch") if k in seen)
    if not hardware:
        notes = run.with_suffix(".md")
        paragraphs = notes.read_text().split("\n\n") if notes.exists() else []
        hardware = " ".join(paragraphs[1].split()) if len(paragraphs) > 1 else "hardware not recorded"
    profile = m.group(1) if (m := re.search(r"^profile: (\w+)", text, re.M)) else "not recorded"
    start = next((c.metadata["execution"]["iopub.status.busy"][:10] for c in nb.cells if "execution" in c.metadata), "")
    stderr = sum(1 for _ in _outputs(nb, "stderr"))
    note = f"; this run wrote to stderr {stderr} time(s), shown in red" if stderr else ""
    return (
        f"Kept GPU run {run.name} ({start}), not executed by make site: {hardware}; profile {profile}; "
        f"wall time {format_seconds(wall_seconds(nb))}{note}"
    )


def static_widgets(nb: Any) -> None:
    """Replace each widget view in the outputs by plain HTML drawn from the saved widget state, and drop
    the state: the pages load no widget manager."""
    state = nb.metadata.pop("widgets", {}).get(WIDGET_STATE, {}).get("state", {})

    def draw(ref: str) -> str:
        model = state.get(ref.removeprefix("IPY_MODEL_"))
        if model is None:
            return ""
        kind, s = model["model_name"].removesuffix("Model"), model["state"]
        desc = html.escape(s.get("description", ""))
        if "children" in s:
            direction = "column" if kind == "VBox" else "row"
            inner = "".join(draw(c) for c in s["children"])
            return f'<div class="site-widget" style="flex-direction:{direction}">{inner}</div>'
        if kind in ("HTML", "HTMLMath"):
            return f"<span>{desc} {s.get('value', '')}</span>"  # HTML the widget itself shows
        if kind.endswith("Progress"):
            return f'{desc}<progress value="{s["value"] - s["min"]}" max="{s["max"] - s["min"]}"></progress>'
        if "_options_labels" in s:
            value = s["_options_labels"][s["index"]] if s.get("index") is not None else ""
        else:
            value = s.get("value", "")
        return f'<span title="interactive in JupyterLab">{desc}: {html.escape(str(value))}</span>'

    for cell in nb.cells:
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if WIDGET_VIEW in data:
                drawn = draw(data.pop(WIDGET_VIEW)["model_id"])
                if drawn:
                    data["text/html"] = drawn


def mathml(tex: str, display: bool) -> str:
    """One formula as MathML, which the browser draws itself (no script, nothing from the internet)."""
    try:
        from latex2mathml.converter import convert
    except ImportError:
        raise SiteError("the site draws formulas with latex2mathml, which is not installed. Try: make site (it installs "
                        "the test extra), or pip install -e '.[test]'") from None  # fmt: skip
    try:
        drawn = convert(tex, display="block" if display else "inline")
    except Exception as exc:  # latex2mathml's own errors: unbalanced braces and the like
        raise SiteError(f"the formula ${tex}$ cannot be drawn ({type(exc).__name__}: {exc}). Try: plain LaTeX") from exc
    # HTML needs no namespace on <math>, and with one the heading anchors (ElementTree) rename it ns0:math
    drawn = drawn.replace(' xmlns="http://www.w3.org/1998/Math/MathML"', "", 1)
    unknown = re.search(r">(\\[A-Za-z]+)<", drawn)  # a command latex2mathml does not know is kept as text
    if unknown:
        raise SiteError(
            f"the formula ${tex}$ uses {unknown.group(1)}, which cannot be drawn as MathML. Try: plain LaTeX"
        )
    return drawn


def math_renderer() -> type:
    """nbconvert's Markdown renderer with formulas as MathML instead of ``$...$`` left for MathJax."""
    from nbconvert.filters.markdown_mistune import IPythonRenderer

    class MathMLRenderer(IPythonRenderer):
        def inline_math(self, body: str) -> str:
            return mathml(body, display=False)

        def block_math(self, body: str) -> str:
            return mathml(body, display=True)

    return MathMLRenderer


def exporter_class() -> type:
    """nbconvert's HTML exporter whose Markdown cells draw their formulas as MathML."""
    from jinja2 import pass_context
    from nbconvert import HTMLExporter
    from nbconvert.filters.markdown_mistune import MarkdownWithMath

    class MathMLExporter(HTMLExporter):
        @pass_context  # jinja hands the filter the cell and resources it renders, as nbconvert's own does
        def markdown2html(self, context: dict, source: str) -> str:
            cell = context.get("cell", {})
            renderer = math_renderer()(
                escape=False,
                attachments=cell.get("attachments", {}),
                embed_images=self.embed_images,
                path=context.get("resources", {}).get("metadata", {}).get("path", ""),
                anchor_link_text=self.anchor_link_text,
                exclude_anchor_links=self.exclude_anchor_links,
            )
            return MarkdownWithMath(renderer=renderer).render(source)

    return MathMLExporter


def render(nb: Any, title: str, kind: str, label: str) -> str:
    """The notebook as one HTML page: nbconvert's lab template, its CSS inlined, formulas as MathML, nothing
    from a CDN."""
    import jinja2

    static_widgets(nb)
    nb.metadata["title"] = title
    exporter = exporter_class()(
        template_name="lab", extra_loaders=[jinja2.DictLoader({"site.html.j2": TEMPLATE})], template_file="site.html.j2"
    )
    try:
        body, _ = exporter.from_notebook_node(nb, resources={"site_kind": kind, "site_label": html.escape(label)})
    except SiteError as e:  # a formula that cannot be drawn: say which page
        raise SiteError(f"{title}: {e}") from None
    return body


def front_page(pages: list[Page], course: list[tuple[str, str | None]]) -> str:
    """The course map: each demo in order with its CPU page, GPU page and lab, and their wall times."""
    by = {(p.kind, p.stem): p for p in pages}

    def link(page: Page | None, text: str) -> str:
        return f'<a href="{html.escape(page.html)}">{html.escape(text)}</a>' if page else "-"

    rows = []
    for stem, lab in course:
        cpu, gpu, lab_page = by.get(("cpu", stem)), by.get(("gpu", stem)), by.get(("lab", lab or ""))
        rows.append(
            "<tr>"
            f"<td>{html.escape(cpu.title if cpu else stem)}</td>"
            f"<td>{link(cpu, 'CPU run')}</td><td>{format_seconds(cpu.wall_s) if cpu else '-'}</td>"
            f"<td>{link(gpu, 'GPU run')}</td><td>{format_seconds(gpu.wall_s) if gpu else '-'}</td>"
            f"<td>{link(lab_page, lab_page.title if lab_page else '')}</td>"
            "</tr>"
        )
    kinds = {p.kind: p.label for p in pages}
    notes = "".join(
        f"<li><b>{name}</b>: {html.escape(kinds[k].split(';')[0])}</li>"
        for k, name in (("cpu", "CPU pages"), ("gpu", "GPU pages"), ("lab", "Labs"))
        if k in kinds
    )
    total = sum(p.wall_s or 0 for p in pages if p.kind == "cpu")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>Scaling Labs: the course, executed</title><link rel="icon" href="data:,">
<style>
body {{ font: 15px/1.5 sans-serif; max-width: 70em; margin: 2em auto; padding: 0 1em; }}
table {{ border-collapse: collapse; }} td, th {{ border-bottom: 1px solid #ddd; padding: 0.3em 0.8em; text-align: left; }}
</style></head>
<body><h1>Scaling Labs: the course, executed</h1>
<p>Each lesson's demo as it ran, with its figures and outputs, and its lab as students get it (exercises
without answers, not executed). Times are each notebook's wall time, first cell to last.</p>
<ul>{notes}</ul>
<table><thead><tr><th>lesson</th><th>CPU</th><th>time</th><th>GPU</th><th>time</th><th>lab</th></tr></thead>
<tbody>{"".join(rows)}</tbody></table>
<p>All CPU pages: {format_seconds(total)}.</p>
</body></html>
"""


RELATIVE_HREF = re.compile(r'href="(?![a-zA-Z][a-zA-Z0-9+.-]*:|#|/)([^"#?]+)')


def markdown_page(path: Path) -> str:
    """A Markdown file of the repository as a plain HTML page."""
    from nbconvert.filters.markdown_mistune import MarkdownWithMath

    text = MarkdownWithMath(renderer=math_renderer()(escape=False)).render(path.read_text())
    name = html.escape(str(path.relative_to(ROOT)))
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{name}</title><link rel="icon" href="data:,">'
        "<style>body { font: 15px/1.5 sans-serif; max-width: 60em; margin: 2em auto; padding: 0 1em; }</style></head>\n"
        f'<body><header class="site-label"><a href="../index.html">Scaling Labs</a> &middot; {name}, as in the repository</header>\n'
        f"{text}\n</body></html>\n"
    )


def add_linked_files(page: str, source: Path, page_dir: Path, site: Path) -> str:
    """Put the repository files that ``page`` links by a relative path (from its notebook's folder, ``source``)
    where the same path leads from ``page_dir`` in the site; a Markdown file becomes an HTML page, and the
    link names it. A link to no file is left as it is (``check`` reports it)."""

    def place(m: re.Match) -> str:
        href = html.unescape(m.group(1))
        target, dest = (source / href).resolve(), (page_dir / href).resolve()
        if not target.is_file() or not target.is_relative_to(ROOT) or not dest.is_relative_to(site):
            return m.group(0)
        dest.parent.mkdir(parents=True, exist_ok=True)
        if target.suffix == ".md":
            dest = dest.with_suffix(".html")
            if not dest.exists():
                dest.write_text(markdown_page(target))
            return f'href="{html.escape(href.removesuffix(".md"))}.html'
        if not dest.exists():
            shutil.copyfile(target, dest)
        return m.group(0)

    return RELATIVE_HREF.sub(place, page)


def _copy_as_lab(src: Path, dest: Path):
    import nbformat

    nb = nbformat.read(str(src), as_version=4)
    nbformat.write(nb, str(dest))
    return nb


def build(
    out: Path,
    *,
    profile: str = "cpu",
    only: list[str] | None = None,
    notebooks: Path = NOTEBOOKS,
    labs: Path = LABS,
    gpu_run: Path | None = None,
) -> list[Page]:
    """Build the site into a temporary folder beside ``out``, then rename it to ``out``. On an error the
    folder is removed; a build killed outright leaves it, hidden (``.site-*``), and the next build removes
    it, so two builds into one ``out`` at once are not supported."""
    import nbformat
    from tqdm.auto import tqdm

    out = Path(out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    for stale in out.parent.glob(f".{out.name}-*"):  # what a killed build left (its kernels stop with it)
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp's is 0700; a web server running as another user reads the site
    pages: list[Page] = []
    course = []
    try:
        for sub in ("cpu", "gpu", "labs"):
            (tmp / sub).mkdir()
        paths = selected(notebooks, only)
        if not paths:
            raise SiteError(f"site: no notebook in {notebooks} starts with {only}. Try: --only 00_,01_")
        bar = tqdm(paths, desc="site", unit="notebook")
        for path in bar:
            bar.set_postfix_str(path.stem)
            name = f"{path.parent.name}/{path.name}"
            nb, info = execute(path, profile, name)
            title = title_of(nb) or path.stem
            nbformat.write(nb, str(tmp / "cpu" / path.name))
            label = cpu_label(info, nb)
            page = render(nb, f"{title} (CPU run)", "cpu", label)
            (tmp / "cpu" / f"{path.stem}.html").write_text(add_linked_files(page, path.parent, tmp / "cpu", tmp))
            pages.append(
                Page("cpu", path.stem, title, f"cpu/{path.stem}.html", f"cpu/{path.name}", label, wall_seconds(nb), 0)
            )
            lab = lab_of(path, labs)
            course.append((path.stem, lab.stem if lab else None))

            if gpu_run is not None and (kept := gpu_run / path.name).exists():
                gnb = nbformat.read(str(kept), as_version=4)
                hint = "publish a GPU run whose notebooks ran to their end (--gpu-run)"
                refuse_errors(gnb, f"{gpu_run.name}/{kept.name}", hint, allow_stderr=True)
                nbformat.write(gnb, str(tmp / "gpu" / path.name))
                label = gpu_label(gnb, gpu_run)
                stderr = sum(1 for _ in _outputs(gnb, "stderr"))
                page = render(gnb, f"{title} (GPU run)", "gpu", label)
                (tmp / "gpu" / f"{path.stem}.html").write_text(add_linked_files(page, path.parent, tmp / "gpu", tmp))
                pages.append(
                    Page(
                        "gpu",
                        path.stem,
                        title,
                        f"gpu/{path.stem}.html",
                        f"gpu/{path.name}",
                        label,
                        wall_seconds(gnb),
                        stderr,
                    )
                )
            if lab is not None:
                lnb = _copy_as_lab(lab, tmp / "labs" / lab.name)
                lab_title = title_of(lnb) or lab.stem
                label = "The lab as students get it: exercises without answers, not executed"
                page = render(lnb, lab_title, "lab", label)
                (tmp / "labs" / f"{lab.stem}.html").write_text(add_linked_files(page, lab.parent, tmp / "labs", tmp))
                pages.append(
                    Page("lab", lab.stem, lab_title, f"labs/{lab.stem}.html", f"labs/{lab.name}", label, None, 0)
                )
        (tmp / "index.html").write_text(front_page(pages, course))
        (tmp / "site.json").write_text(json.dumps({"profile": profile, "pages": [asdict(p) for p in pages]}, indent=1))
        old = None
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}-old-", dir=out.parent))
            out.rename(old / "site")
        tmp.rename(out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return pages


EXTERNAL = re.compile(
    r"""<(?:script|link|img|iframe|source|video|audio)\b[^>]*\b(?:src|href)\s*=\s*["']?(?:https?:)?//""", re.I
)
RELATIVE = re.compile(r'(?:href|src)="(?![a-zA-Z][a-zA-Z0-9+.-]*:|#|/)([^"#?]+)')


def check(site: Path) -> list[str]:
    """What is wrong with a built site: relative links to files that are not there, pages without
    their label, and anything a page would load from outside the site."""
    site = Path(site)
    index = site / "index.html"
    if not index.exists():
        return [f"{index} is missing"]
    problems = []
    for page in sorted(site.rglob("*.html")):
        text = page.read_text()
        for href in RELATIVE.findall(text):
            if not (page.parent / html.unescape(href)).is_file():
                problems.append(f"{page.relative_to(site)} links {href}, which does not exist")
        if page != index and 'class="site-label"' not in text:
            problems.append(f"{page.relative_to(site)} has no label")
        if EXTERNAL.search(text):
            problems.append(f"{page.relative_to(site)} loads {EXTERNAL.search(text).group(0)}...")
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m utils.site", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="execute the notebooks and write the site")
    b.add_argument("--out", type=Path, default=ROOT / "build" / "site")
    b.add_argument(
        "--profile", choices=("cpu", "smoke"), default="cpu", help="cpu (default) or smoke, for a quick build"
    )
    b.add_argument("--only", default="", help="comma-separated prefixes of the notebooks to build, e.g. 00_,01_")
    b.add_argument("--notebooks", type=Path, default=NOTEBOOKS, help="the demos to execute (default: notebooks/)")
    b.add_argument("--labs", type=Path, default=LABS, help="the labs to render (default: labs/)")
    b.add_argument(
        "--gpu-run",
        type=Path,
        default=None,
        help="a folder of executed GPU notebooks (default: the newest under docs/gpu-runs/)",
    )
    c = sub.add_parser("check", help="check a built site's links, labels and that it loads nothing from outside")
    c.add_argument("site", type=Path)
    args = ap.parse_args(argv)
    if args.command == "check":
        problems = check(args.site)
        print(
            "\n".join(problems)
            or f"{args.site}: every link resolves, every page is labelled, nothing loads from outside"
        )
        return 1 if problems else 0
    start = time.perf_counter()
    if args.gpu_run is not None and not args.gpu_run.is_dir():
        print(
            f"site: {args.gpu_run} is not a folder. Try: --gpu-run docs/gpu-runs/<run> (an empty folder: no GPU pages)",
            file=sys.stderr,
        )
        return 2
    gpu_run = args.gpu_run or newest_gpu_run()
    try:
        only = [p for p in args.only.split(",") if p] or None
        pages = build(
            args.out, profile=args.profile, only=only, notebooks=args.notebooks, labs=args.labs, gpu_run=gpu_run
        )
    except SiteError as e:
        print(e, file=sys.stderr)
        return 1
    size = sum(f.stat().st_size for f in Path(args.out).rglob("*") if f.is_file())
    print(
        f"site: {len(pages)} pages in {args.out} ({size / 2**20:.1f} MiB) in {format_seconds(time.perf_counter() - start)}; "
        f"GPU pages from {gpu_run.name if gpu_run else 'no GPU run'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
