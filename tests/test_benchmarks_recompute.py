"""benchmarks/recompute.py on a short run: with and without recomputation the runs train the same model (the same
losses), and recomputation keeps fewer activations by its own count."""
import json

import pytest

from conftest import load_benchmark


@pytest.mark.slow
def test_recompute_benchmark_runs_both_ways_and_trains_the_same(tmp_path):
    bench = load_benchmark("recompute")
    out = tmp_path / "recompute.json"
    assert bench.main(["--models", "lenet", "--rounds", "1", "--steps", "1", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["model"], r["recompute"]) for r in rows] == [("lenet", False), ("lenet", True)]
    off, on = rows
    assert off["losses"] == on["losses"]   # bitwise the same steps
    assert 0 < on["activation_bytes"] < off["activation_bytes"]
    assert off["time_ratio"] == 1.0 and on["time_ratio"] > 0 and on["peak_rss"] > 0


def test_counted_activations_of_resnet18_shrink_with_recomputation():
    whole, kept = load_benchmark("recompute").counted_activations("resnet18", 4)
    assert 0 < kept < whole / 2
