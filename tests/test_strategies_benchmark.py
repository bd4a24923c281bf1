"""benchmarks/pipeline.py runs end to end in --quick mode and writes a well-formed JSON (no timing asserts)."""
import json
import math

import pytest

from conftest import load_benchmark


@pytest.fixture(scope="module")
def benchmark():
    return load_benchmark("pipeline")


@pytest.mark.slow
def test_quick_run_writes_json_and_png(benchmark, tmp_path, capsys):
    json_path, png_path = tmp_path / "pipeline.json", tmp_path / "pipeline.png"
    assert benchmark.main(["--quick", "--devices", "cpu:4", "--batch-size", "32",
                           "--json", str(json_path), "--plot", str(png_path)]) == 0
    report = json.loads(json_path.read_text())
    assert report["batch_size"] == 32 and report["repeats"] == 1 and report["quick"] is True
    assert set(report["threads"]) == {"OMP_NUM_THREADS", "MXNET_CPU_WORKER_NTHREADS", "num_gpus", "cpu_count"}
    rows = {(r["strategy"], r.get("schedule"), r["stages"], r["micro_batches"]): r for r in report["results"]}
    expected = {("data", None, 1, None)} | {("model", None, k, None) for k in (2, 4)} | \
               {("pipeline", "gpipe", k, m) for k in (1, 2, 4) for m in (1, 2, 4, 8)} | \
               {("pipeline", "1f1b", k, m) for k in (2, 4) for m in (1, 2, 4, 8)}   # K=1: the control
    assert set(rows) == expected and len(report["results"]) == len(expected)
    for (strategy, schedule, k, m), row in rows.items():
        if schedule == "1f1b":   # 1F1B holds at most K - s micro-batches on stage s; GPipe all M
            assert row["stashed_peak"] == [min(k - s, m) for s in range(k)]
        elif schedule == "gpipe" and k > 1:
            assert row["stashed_peak"] == [m] * k
        assert math.isfinite(row["ms_per_step"]) and row["ms_per_step"] > 0
        assert row["ms_per_step_rounds"] == [row["ms_per_step"]]
        if strategy != "data":   # K=1 has no bubble: (1-1)/(M+0) = 0
            assert row["bubble_fraction"] == pytest.approx((k - 1) / ((m or 1) + k - 1))
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert "OMP_NUM_THREADS=" in out and "mx.context.num_gpus()=" in out and "1f1b, K=4 M=8" in out


def test_too_few_contexts_is_one_error_line(benchmark, tmp_path, capsys):
    assert benchmark.main(["--quick", "--devices", "cpu:1", "--json", str(tmp_path / "p.json"),
                           "--plot", str(tmp_path / "p.png")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: a pipeline of 2 stages needs 2 contexts") and len(err.splitlines()) == 1
    assert not (tmp_path / "p.json").exists()
