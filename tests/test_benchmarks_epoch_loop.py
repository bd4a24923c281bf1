"""Smoke test of benchmarks/epoch_loop.py: it runs both loops for every K and writes its JSON (no timings asserted)."""
import json

import pytest

from conftest import load_benchmark


@pytest.mark.slow
def test_quick_run_writes_json(tmp_path, capsys):
    bench = load_benchmark("epoch_loop")
    import importlib
    loop = importlib.import_module("parallel.fit")
    assert bench.main(["--quick", "--json", str(tmp_path / "e.json")]) == 0
    result = json.loads((tmp_path / "e.json").read_text())
    assert [row["k"] for row in result["rows"]] == [1, 2]
    for row in result["rows"]:
        assert row["bounded_s"] > 0 and row["whole_epoch_s"] > 0
        assert [len(v) for v in row["samples"].values()] == [1, 1]
    assert loop.IN_FLIGHT == result["in_flight"] == 2   # the benchmark puts the setting back
    assert "threads: OMP_NUM_THREADS=" in capsys.readouterr().out
