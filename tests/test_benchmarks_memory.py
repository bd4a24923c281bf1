"""benchmarks/memory.py on a short run: with and without recomputation, and at every ZeRO stage, the runs train the
same model (the same losses); recomputation keeps fewer activations by its own count, ZeRO-3 fewer bytes."""
import json
from pathlib import Path

import pytest

from conftest import load_benchmark


def _rows(tmp_path, *args):
    """The rows ``benchmarks/memory.py`` writes for ``args``, on one round of one timed step."""
    out = tmp_path / "memory.json"
    assert load_benchmark("memory").main([*args, "--rounds", "1", "--steps", "1", "--out", str(out)]) == 0
    return json.loads(out.read_text())["rows"]


@pytest.mark.slow
def test_recompute_benchmark_runs_both_ways_and_trains_the_same(tmp_path):
    rows = _rows(tmp_path, "--part", "recompute", "--models", "lenet")
    assert [(r["model"], r["recompute"]) for r in rows] == [("lenet", False), ("lenet", True)]
    off, on = rows
    assert off["losses"] == on["losses"]   # bitwise the same steps
    assert 0 < on["activation_bytes"] < off["activation_bytes"]
    assert off["time_ratio"] == 1.0 and on["time_ratio"] > 0 and on["peak_rss"] > 0


def test_the_parameters_counted_are_each_models():
    assert [load_benchmark("memory").parameters(model) for model in ("resnet18", "vit")] == [11175818, 139018]


def test_counted_activations_of_resnet18_shrink_with_recomputation():
    whole, kept = load_benchmark("memory").counted_activations("resnet18", 4)
    assert 0 < kept < whole / 2


@pytest.mark.slow
def test_zero_benchmark_runs_every_stage_and_trains_the_same(tmp_path):
    rows = _rows(tmp_path, "--part", "zero", "--zero-devices", "2", "--zero-model", "vit")
    assert [(r["zero"], r["prefetch"]) for r in rows] == [(0, False), (1, False), (2, False), (3, True), (3, False)]
    assert len({tuple(r["losses"]) for r in rows}) == 1   # every stage trains the same steps, bitwise
    held = [r["bytes_a_parameter"] for r in rows]
    assert held[0] == 16 and held[3] == held[4] < held[2] <= held[1] < held[0]   # zero 2: whole gradient buffers
    assert rows[3]["bytes_moved"] is not None and rows[0]["bytes_moved"] is None


@pytest.mark.slow
def test_job_benchmark_runs_every_stage_under_the_launcher_and_trains_the_same(tmp_path):
    """2 workers of 1 context each: every stage the same losses (ZeRO-3 bitwise zero 0 in a job), ZeRO-3 keeps
    half of zero 0's bytes a parameter on each worker and pushes 3 Psi - Psi_last a step."""
    rows = _rows(tmp_path, "--part", "job", "--job-devices", "1", "--zero-model", "vit")
    assert [(r["workers"], r["zero"], r["prefetch"]) for r in rows] == [
        (2, 0, False), (2, 1, False), (2, 2, False), (2, 3, True), (2, 3, False)]
    assert len({tuple(r["losses"]) for r in rows}) == 1
    assert rows[0]["bytes_a_parameter"] == 16 and rows[3]["bytes_a_parameter"] == rows[4]["bytes_a_parameter"] == 8
    psi = 4 * load_benchmark("memory").parameters("vit")
    assert 2 * psi < rows[3]["pushed"] < 3 * psi and rows[0]["pushed"] == psi


#: Each results file of the memory benchmark, and how its table's header begins in the docs.
_TABLES = {"memory.json": "| model (batch", "memory_zero.json": "| contexts | `--zero` |",
           "memory_job.json": "| workers x contexts | `--zero` |"}


@pytest.mark.parametrize("results", sorted(_TABLES))
def test_the_docs_tables_are_the_results_files_rows(results):
    """The tables of recomputation and ZeRO in benchmarks/README.md and docs/memory.md are the committed runs':
    each table's rows are exactly those ``table_rows`` renders from its results file, in order."""
    root = Path(__file__).resolve().parent.parent
    rows = json.loads((root / "benchmarks" / "results" / results).read_text())["rows"]
    for doc in ("benchmarks/README.md", "docs/memory.md"):
        lines = (root / doc).read_text().splitlines()
        (at,) = [i for i, line in enumerate(lines) if line.startswith(_TABLES[results])]
        end = next(i for i in range(at, len(lines) + 1) if i == len(lines) or not lines[i].startswith("|"))
        assert lines[at + 2:end] == load_benchmark("memory").table_rows(rows), doc
