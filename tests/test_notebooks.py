"""The notebooks in notebooks/ run top to bottom without error, and are committed executed.

Each notebook is executed with nbclient in a fresh kernel of *this* interpreter (a kernelspec written for
``sys.executable``, not whatever ``python3`` kernel Jupyter would find first), with a temporary working
directory so nothing is written into the repo. The conftest's autouse fixture points any download at a closed
port; the kernel inherits that environment, though notebooks use synthetic data and download nothing.

    python -m pytest -q tests/test_notebooks.py
"""
import json
import sys
from pathlib import Path

import nbformat
import pytest
from ipykernel.kernelspec import write_kernel_spec
from jupyter_client import AsyncKernelManager
from jupyter_client.kernelspec import KernelSpecManager
from nbclient import NotebookClient

NOTEBOOK_DIR = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))

#: Seconds one cell may run before the test fails.
CELL_TIMEOUT = 600

#: Appended to the copy that is executed: reports which interpreter ran the notebook, and where.
_PROBE = "import json, os, sys\nprint(json.dumps({'executable': sys.executable, 'cwd': os.getcwd()}))"


def _code_cells(nb):
    return [cell for cell in nb.cells if cell.cell_type == "code"]


def _errors(nb):
    """(cell index, 'ename: evalue') for every error output of nb."""
    return [(i, f"{out.get('ename')}: {out.get('evalue')}")
            for i, cell in enumerate(nb.cells) if cell.cell_type == "code"
            for out in cell.get("outputs", []) if out.get("output_type") == "error"]


def _kernel_manager(kernels_dir):
    """A kernel manager whose only 'python3' kernelspec runs this interpreter (sys.executable)."""
    write_kernel_spec(kernels_dir / "python3")
    return AsyncKernelManager(kernel_name="python3",
                              kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(kernels_dir)]))


def test_notebooks_exist():
    assert NOTEBOOKS, f"no notebook found in {NOTEBOOK_DIR}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_is_stored_executed(path):
    nb = nbformat.read(str(path), as_version=4)
    cells = _code_cells(nb)
    assert cells, f"{path.name} has no code cell"
    assert not _errors(nb), f"{path.name} is stored with error outputs: {_errors(nb)}"
    counts = [cell.execution_count for cell in cells]
    assert counts == list(range(1, len(cells) + 1)), (
        f"{path.name} is not stored executed top to bottom in one fresh kernel (execution counts {counts}); "
        "execute it with nbclient and save the outputs")
    assert any(cell.outputs for cell in cells), f"{path.name} is stored without outputs"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_executes(path, tmp_path):
    nb = nbformat.read(str(path), as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(_PROBE))
    workdir = tmp_path / "cwd"
    workdir.mkdir()
    client = NotebookClient(nb, km=_kernel_manager(tmp_path / "kernels"), timeout=CELL_TIMEOUT,
                            allow_errors=False, resources={"metadata": {"path": str(workdir)}})
    client.execute()   # raises CellExecutionError, naming the cell, at the first error

    assert not _errors(nb)
    probe = json.loads(nb.cells[-1].outputs[0]["text"])
    assert probe["executable"] == sys.executable, "the notebook ran in another interpreter's kernel"
    assert Path(probe["cwd"]).resolve() == workdir.resolve()
