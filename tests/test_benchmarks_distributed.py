"""Smoke test of benchmarks/distributed.py: a --quick run launches its kvstore jobs, writes JSON and PNG with every
size and configuration, and prints the tables (no timings asserted); a failing job fails the benchmark loudly."""
import json
import os
import sys

import pytest

from conftest import load_benchmark


def _positive(value):
    return isinstance(value, (int, float)) and value > 0


def _thread_setting(value):
    return isinstance(value, str) and value.isdigit() and int(value) >= 1


@pytest.mark.slow
def test_quick_run_writes_json_png_and_tables(tmp_path, capsys):
    bench = load_benchmark("distributed")
    assert bench.main(["--quick", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "distributed.json").read_text())
    assert (tmp_path / "distributed.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not [name for name in os.listdir(tmp_path) if name.endswith(".tmp")]   # written atomically

    assert result["settings"]["quick"] and result["settings"]["workers"] == 2
    assert result["settings"]["MXNET_KVSTORE_BIGARRAY_BOUND"] >= 1

    sweep = result["pushpull"]
    assert sweep["workers"] == 2 and sweep["servers"] == 2 and sweep["kvstore"] == "dist_sync"
    assert [s["bytes"] for s in sweep["sizes"]] == bench.QUICK_SIZES == [4096, 1024 ** 2]
    for s in sweep["sizes"]:
        for key in ("pushpull_s", "memcpy_s", "pushpull_gbps", "memcpy_gbps", "fraction_of_memcpy"):
            assert _positive(s[key]), (s["bytes"], key)
        assert s["floats"] * 4 == s["bytes"] and isinstance(s["split_over_servers"], bool)
        assert [r["rank"] for r in s["per_rank"]] == [0, 1]
        assert all(_positive(t) for r in s["per_rank"] for t in r["samples"]["pushpull_s"] + r["samples"]["memcpy_s"])

    reduction = result["lenet_reduction"]
    assert reduction["floats"] == 129068
    for key in ("allreduce_across_ms", "train_batch_ms", "fraction"):
        assert _positive(reduction[key]), key

    images = result["images_per_second"]
    assert set(images["configs"]) == {"a", "b", "c"}
    for name, config in images["configs"].items():
        assert _positive(config["images_per_second"]) and len(config["samples"]) == 1, name
        assert config["params_agree_across_ranks"], name
    assert images["configs"]["c"]["update_on_kvstore"] is True   # MXNet's default for dist_sync
    assert set(images["ratios"]) == {"b/a", "c/a", "b/c"} and all(map(_positive, images["ratios"].values()))
    assert [row["round"] for row in images["per_round"]] == [1]

    # OMP_NUM_THREADS of every process: a alone, and every role of every launched job
    omp = result["omp_num_threads"]
    assert set(omp) == {"pushpull_job", "a", "b", "c"}
    assert result["settings"]["local_threads"] == result["machine"]["cores"]   # a: every core
    assert omp["a"] == {"process": [str(result["machine"]["cores"])]}
    for job in ("pushpull_job", "b", "c"):
        assert sorted(omp[job]) == ["scheduler", "server", "worker"], job
        assert len(omp[job]["worker"]) == 2 and len(omp[job]["server"]) == 2 and len(omp[job]["scheduler"]) == 1
        assert all(_thread_setting(v) for values in omp[job].values() for v in values), omp[job]
    for rank in images["configs"]["b"]["rounds"][0]["per_rank"]:   # the workers' own reports agree
        assert rank["OMP_NUM_THREADS"] == omp["b"]["worker"][0]

    out = capsys.readouterr().out
    assert "| size | floats | split over servers | push+pull ms |" in out
    assert "| 4 KB |" in out and "| 1 MB |" in out
    assert "| allreduce_across ms | train_batch step ms | allreduce / step |" in out
    assert "| configuration | OMP_NUM_THREADS of each process | images/s |" in out
    for config in ("(a)", "(b)", "(c)"):
        assert f"| {config} " in out
    assert "ratios of the medians: b/a = " in out


@pytest.mark.slow
def test_a_failing_job_fails_loudly_with_the_launchers_error_line():
    bench = load_benchmark("distributed")
    with pytest.raises(bench.BenchmarkError, match=r"exited with status 1: error: worker \d .* exited with status 3"):
        bench.launch_job("failing job", [sys.executable, "-c", "raise SystemExit(3)"], 2, stall_timeout=60)


def test_bad_arguments_exit_2(tmp_path, capsys):
    bench = load_benchmark("distributed")
    assert bench.main(["--quick", "--sizes", "4097", "--out", str(tmp_path)]) == 2
    assert "error: --sizes must be multiples of 4 bytes" in capsys.readouterr().err
