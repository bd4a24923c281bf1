"""Smoke test of benchmarks/threads.py: a --quick run writes every setting; structure only, no timings."""
import json

import mxnet as mx
import pytest

from parallel.threads import recommended_omp_threads

from conftest import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("threads")


@pytest.mark.slow
def test_quick_run_writes_every_setting(bench, tmp_path, capsys):
    assert bench.main(["--quick", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "threads.json").read_text())
    threads = recommended_omp_threads()
    assert result["command"] == bench.harness.portable(f"python benchmarks/threads.py --quick --out {tmp_path}")
    assert result["machine"]["mxnet"] == mx.__version__ and result["machine"]["nproc"] >= 1
    settings = result["settings"]
    assert settings["threads"] == threads and settings["quick"] is True
    assert (settings["batch_size"], settings["steps_per_sample"], settings["warmup"], settings["repeats"]) == (32, 2, 1, 1)

    results = {r["setting"]: r for r in result["results"]}
    assert list(results) == list(bench.SETTINGS) == ["unset", "env", "api"]
    for setting, r in results.items():
        assert len(r["ms"]) == 1 and r["ms"][0] > 0 and r["median_ms"] == r["ms"][0]
        assert r["ratio_to_unset"] == pytest.approx(r["median_ms"] / results["unset"]["median_ms"])
        assert r["ratio_to_env"] == pytest.approx(r["median_ms"] / results["env"]["median_ms"])
        assert r["label"] == bench.LABELS[setting].format(n=threads)
    # the settings really differ: env sets the variable, the API sets the worker thread itself
    assert results["env"]["OMP_NUM_THREADS"] == str(threads)
    assert all(results[s]["OMP_NUM_THREADS"] == "unset" for s in ("unset", "api"))
    assert all(results[s]["worker_omp_threads"] == [threads] for s in ("env", "api"))

    out = capsys.readouterr().out
    assert "| setting | worker threads | median ms/step | x unset | x env |" in out
    assert f"| unset + set_omp_threads({threads}) after import, before the first step |" in out
    assert "unset / env = " in out and "api / env = " in out


@pytest.mark.parametrize("argv, message", [
    (["--repeats", "0"], "--repeats must be >= 1, got 0"),
    (["--threads", "0"], "--threads must be >= 1, got 0"),
    (["--threads", "100000"], "--threads 100000 is more than the"),
    (["--warmup", "-1"], "--warmup must be >= 0, got -1"),
])
def test_bad_arguments_exit_2_and_write_nothing(bench, tmp_path, capsys, argv, message):
    assert bench.main(argv + ["--out", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "threads.json").exists()


def test_out_that_is_a_file_exits_2(bench, tmp_path, capsys):
    target = tmp_path / "taken"
    target.write_text("x")
    assert bench.main(["--quick", "--out", str(target)]) == 2
    assert "error:" in capsys.readouterr().err
