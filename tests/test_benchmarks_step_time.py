"""Smoke test of benchmarks/step_time.py: it runs, and its JSON holds every configuration (no timings asserted)."""
import json

import pytest

from conftest import load_benchmark


@pytest.mark.slow
def test_quick_run_writes_json_and_png(tmp_path, capsys):
    from parallel import ALLREDUCE_ALGORITHMS, DEFAULT_ALGORITHM
    bench = load_benchmark("step_time")
    assert bench.main(["--quick", "--devices", "cpu:2", "--ks", "1,2", "--threads", "1",
                       "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "step_time.json").read_text())
    assert (tmp_path / "step_time.png").read_bytes()[:4] == b"\x89PNG"
    variants = {b["variant"] for b in result["best"]}
    assert variants == ({f"parallel/{a}" for a in ALLREDUCE_ALGORITHMS}
                        | {f"parallel/{DEFAULT_ALGORITHM}/imperative", "textbook", "gluon"})
    assert {b["k"] for b in result["best"]} == {1, 2}
    for b in result["best"]:
        assert b["median_ms"] > 0 and b["threads"] == 1
    for s in result["samples"]:
        assert len(s["ms"]) == 2 and all(ms > 0 for ms in s["ms"])
    assert [e["k"] for e in result["epoch"]] == [1, 2] and all(e["ratio"] > 0 for e in result["epoch"])
    assert all(m["trace"][-1]["step"] == 20 for m in result["memory"])
    assert result["settings"]["threads"] == ["OMP_NUM_THREADS=1"]
    table = capsys.readouterr().out
    assert "| gluon |" in table and "epoch pipeline K=2" in table
