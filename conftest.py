"""nbval, stricter: a notebook cell that writes to stderr fails.

In JupyterLab anything on stderr (a warning, a library's log line, a plain-text progress bar)
is shown on a red background, so a clean run of a notebook must print nothing there. nbval
already executes every notebook once under `make test`; this hook checks each cell's collected
outputs after nbval ran it, so nothing is executed twice.

A cell that is meant to write to stderr (a demonstration of an error message) says so with a
line `# stderr expected: <why>`; then its stderr is allowed.
"""

from pathlib import Path

import pytest

STDERR_OK = "# stderr expected:"


# The test tiers are markers (pyproject.toml). A test file sets its own (`pytestmark`, or a decorator
# on one test; tests/test_tiers.py fails when a test that starts processes has none). A notebook has
# no Python file to carry them, so every cell collected from one is marked here: notebook and slow.
def pytest_collection_modifyitems(config, items):
    for item in items:
        if Path(str(item.fspath)).suffix == ".ipynb":
            item.add_marker(pytest.mark.notebook)
            item.add_marker(pytest.mark.slow)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    result = yield  # nbval ran the cell (a failing cell raises here already)
    outputs = getattr(item, "test_outputs", None)
    if outputs is None or not hasattr(item, "cell") or STDERR_OK in item.cell.source:
        return result
    err = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream" and o.get("name") == "stderr")
    if err.strip():
        item.raise_cell_error(
            "The cell wrote to stderr (JupyterLab shows this in red). Fix its cause, or mark the cell "
            f"with `{STDERR_OK} <why>` if the output is the point of the cell",
            "\n" + err[-3000:],
        )
    return result
