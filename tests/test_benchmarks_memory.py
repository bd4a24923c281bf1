"""benchmarks/memory.py on a short run: with and without recomputation, and at every ZeRO stage, the runs train the
same model (the same losses); recomputation keeps fewer activations by its own count, ZeRO-3 fewer bytes."""
import json

import pytest

from conftest import load_benchmark


@pytest.mark.slow
def test_recompute_benchmark_runs_both_ways_and_trains_the_same(tmp_path):
    bench = load_benchmark("memory")
    out = tmp_path / "memory.json"
    assert bench.main(["--part", "recompute", "--models", "lenet", "--rounds", "1", "--steps", "1", "--out",
                       str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["model"], r["recompute"]) for r in rows] == [("lenet", False), ("lenet", True)]
    off, on = rows
    assert off["losses"] == on["losses"]   # bitwise the same steps
    assert 0 < on["activation_bytes"] < off["activation_bytes"]
    assert off["time_ratio"] == 1.0 and on["time_ratio"] > 0 and on["peak_rss"] > 0


def test_counted_activations_of_resnet18_shrink_with_recomputation():
    whole, kept = load_benchmark("memory").counted_activations("resnet18", 4)
    assert 0 < kept < whole / 2


@pytest.mark.slow
def test_zero_benchmark_runs_every_stage_and_trains_the_same(tmp_path):
    bench = load_benchmark("memory")
    out = tmp_path / "memory.json"
    assert bench.main(["--part", "zero", "--zero-devices", "2", "--rounds", "1", "--steps", "1", "--out",
                       str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["zero"], r["prefetch"]) for r in rows] == [(0, False), (1, False), (2, False), (3, True), (3, False)]
    assert len({tuple(r["losses"]) for r in rows}) == 1   # every stage trains the same steps, bitwise
    held = [r["bytes_a_parameter"] for r in rows]
    assert held[0] == 16 and held[3] == held[4] < held[2] <= held[1] < held[0]   # zero 2: whole gradient buffers
    assert rows[3]["bytes_moved"] is not None and rows[0]["bytes_moved"] is None
