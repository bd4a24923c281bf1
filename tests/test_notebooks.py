"""The notebooks in notebooks/ run top to bottom without error, check what they claim, and are committed executed.

Each notebook is executed with nbclient in a fresh kernel of *this* interpreter (a kernelspec written for
``sys.executable``, not whatever ``python3`` kernel Jupyter would find first), with a temporary working
directory so nothing is written into the repo. The conftest's autouse fixture points any download at a closed
port; the kernel inherits that environment, though notebooks use synthetic data and download nothing.

    python -m pytest -q tests/test_notebooks.py
"""
import json
import re
import sys
from pathlib import Path

import pytest

NOTEBOOK_DIR = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))

#: Seconds one cell may run before the test fails.
CELL_TIMEOUT = 600

#: Paths that would read as broken in a stored notebook: a temporary directory or this checkout's location.
_LOCAL_PATH = re.compile(r"/tmp/|/var/folders/|" + re.escape(str(NOTEBOOK_DIR.parent)))

#: Appended to the copy that is executed: reports which interpreter ran the notebook, and where.
_PROBE = "import json, os, sys\nprint(json.dumps({'executable': sys.executable, 'cwd': os.getcwd()}))"


def _read(path):
    """The stored notebook at ``path`` as its JSON (nbformat 4): a dict whose ``cells`` are dicts, each cell's
    ``source`` one string. Read as JSON, not with nbformat, whose import (about 4 s here, with jsonschema) every
    test process would pay at collection for the checks of the fast tier."""
    nb = json.loads(Path(path).read_text())
    for cell in nb["cells"]:
        cell["source"] = "".join(cell["source"])
    return nb


def _code_cells(nb):
    return [cell for cell in nb["cells"] if cell["cell_type"] == "code"]


def _errors(nb):
    """(cell index, 'ename: evalue') for every error output of nb."""
    return [(i, f"{out.get('ename')}: {out.get('evalue')}")
            for i, cell in enumerate(nb["cells"]) if cell["cell_type"] == "code"
            for out in cell.get("outputs", []) if out.get("output_type") == "error"]


def _kernel_manager(kernels_dir):
    """A kernel manager whose only 'python3' kernelspec runs this interpreter (sys.executable), its connection
    file in ``kernels_dir`` rather than a new file of the system's temporary directory."""
    from ipykernel.kernelspec import write_kernel_spec
    from jupyter_client import AsyncKernelManager
    from jupyter_client.kernelspec import KernelSpecManager
    write_kernel_spec(kernels_dir / "python3")
    return AsyncKernelManager(kernel_name="python3", connection_file=str(kernels_dir / "connection.json"),
                              kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(kernels_dir)]))


def _output_text(cell):
    """Everything a code cell shows as text: streams, plain-text results and tracebacks."""
    parts = []
    for out in cell.get("outputs", []):
        parts.append("".join(out.get("text", "")))
        parts.append("".join(out.get("data", {}).get("text/plain", "")))
        parts.extend(out.get("traceback", []))
    return "\n".join(parts)


def test_notebooks_exist():
    assert NOTEBOOKS, f"no notebook found in {NOTEBOOK_DIR}"


def test_notebooks_readme_gives_the_learning_path():
    """notebooks/README.md names every notebook, in the order of their numbers, each with its time."""
    readme = (NOTEBOOK_DIR / "README.md").read_text()
    positions = [readme.find(path.name) for path in NOTEBOOKS]
    missing = [path.name for path, at in zip(NOTEBOOKS, positions) if at < 0]
    assert not missing, f"notebooks/README.md does not mention {missing}"
    assert positions == sorted(positions), "notebooks/README.md lists the notebooks out of order"
    for path in NOTEBOOKS:
        line = next(line for line in readme.splitlines() if path.name in line)
        assert re.search(r"\d+ s\b", line), f"notebooks/README.md gives no time (e.g. '40 s') for {path.name}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_asserts_what_it_claims(path):
    """A lesson checks its claims (an invariant holds, a buggy variant fails, a sum is right) with assert."""
    checks = sum(len(re.findall(r"^\s*assert\b", cell["source"], re.MULTILINE)) for cell in _code_cells(_read(path)))
    assert checks >= 3, f"{path.name} holds {checks} assert statement(s); a lesson asserts what it shows"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_outputs_hold_no_local_paths(path):
    """Stored outputs read well anywhere: no temporary directory or checkout path that would look broken."""
    nb = _read(path)
    found = [(i, m.group(0)) for i, cell in enumerate(nb["cells"]) if cell["cell_type"] == "code"
             for m in [_LOCAL_PATH.search(_output_text(cell))] if m]
    assert not found, f"{path.name} stores outputs with local paths (cell index, match): {found}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_is_stored_executed(path):
    nb = _read(path)
    cells = _code_cells(nb)
    assert cells, f"{path.name} has no code cell"
    assert not _errors(nb), f"{path.name} is stored with error outputs: {_errors(nb)}"
    counts = [cell["execution_count"] for cell in cells]
    assert counts == list(range(1, len(cells) + 1)), (
        f"{path.name} is not stored executed top to bottom in one fresh kernel (execution counts {counts}); "
        "execute it with nbclient and save the outputs")
    assert any(cell["outputs"] for cell in cells), f"{path.name} is stored without outputs"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_executes(path, tmp_path):
    import nbformat
    from nbclient import NotebookClient
    nb = nbformat.read(str(path), as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(_PROBE))
    workdir = tmp_path / "cwd"
    workdir.mkdir()
    km = _kernel_manager(tmp_path / "kernels")
    client = NotebookClient(nb, km=km, timeout=CELL_TIMEOUT,
                            allow_errors=False, resources={"metadata": {"path": str(workdir)}})
    # Raises CellExecutionError, naming the cell, at the first error. nbclient shuts down only a kernel whose
    # manager it made itself unless told: without cleanup_kc the kernel lived until pytest ended, and its
    # connection file stayed behind.
    client.execute(cleanup_kc=True)
    assert not km.has_kernel, "the notebook's kernel is still running after the notebook ran"
    assert not Path(km.connection_file).exists(), "the kernel's connection file was left behind"

    assert not _errors(nb)
    probe = json.loads(nb.cells[-1].outputs[0]["text"])
    assert probe["executable"] == sys.executable, "the notebook ran in another interpreter's kernel"
    assert Path(probe["cwd"]).resolve() == workdir.resolve(), \
        "the notebook must leave its working directory as it found it"
