"""Smoke test of benchmarks/allreduce.py: structure of its output, never its timings."""
import json
import os

import mxnet as mx
import pytest

from parallel import ALLREDUCE_ALGORITHMS
from parallel.comm import bytes_moved

from conftest import ROOT, load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("allreduce")


@pytest.mark.slow
def test_quick_run_writes_every_configuration(bench, tmp_path, capsys):
    assert bench.main(["--quick", "--devices", "cpu:4", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "allreduce.json").read_text())
    assert (tmp_path / "allreduce.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    settings = result["settings"]
    assert settings["ks"] == [2, 4] and settings["repeats"] == 2 and settings["quick"] is True
    sizes = settings["sizes"]
    assert sizes == bench.QUICK_SIZES and len(sizes) >= 2
    assert settings["mxnet"] == mx.__version__ and settings["nproc"] >= 1
    for name in ("OMP_NUM_THREADS", "MXNET_CPU_WORKER_NTHREADS"):
        assert isinstance(settings[name], str) and settings[name]
    methods = list(ALLREDUCE_ALGORITHMS) + ["kvstore"]
    assert settings["methods"] == methods

    records = {(r["k"], r["nbytes"], r["method"]): r for r in result["allreduce"]}
    assert set(records) == {(k, n, m) for k in (2, 4) for n in sizes for m in methods}
    assert len(records) == len(result["allreduce"])
    for (k, nbytes, method), r in records.items():
        assert r["median_s"] > 0 and len(r["times_s"]) == 2 and min(r["times_s"]) > 0
        if method == "kvstore":
            assert r["bound_s"] is None and r["fraction_of_bound"] is None
        else:
            moved = bytes_moved(method, nbytes, k)
            assert (r["bytes_total"], r["bytes_per_context_max"]) == tuple(moved)
            assert r["bound_s"] > 0 and r["fraction_of_bound"] == pytest.approx(r["bound_s"] / r["median_s"])

    # the fraction of the bound for every K, algorithm and size, as in the records
    fractions = result["fraction_of_bound"]
    assert set(fractions) == {"2", "4"}
    for k in (2, 4):
        assert set(fractions[str(k)]) == set(ALLREDUCE_ALGORITHMS)
        for method, by_size in fractions[str(k)].items():
            assert by_size == {str(n): records[k, n, method]["fraction_of_bound"] for n in sizes}

    # the receive buffers were reused: the warm-up allocated them, nothing was dropped for the bound
    buffers = result["buffers"]
    assert set(buffers) == {"entries", "nbytes", "limit", "allocations", "evictions"}
    assert buffers["evictions"] == 0 and buffers["entries"] == buffers["allocations"] > 0
    assert 0 < buffers["nbytes"] <= buffers["limit"]

    memcpy = result["memcpy"]
    assert memcpy["nbytes"] == max(sizes)
    assert memcpy["mxnet_bytes_per_s"] > 0 and memcpy["numpy_bytes_per_s"] > 0

    lenet = {(r["k"], r["method"]): r for r in result["lenet"]}
    flat = [f"flat {m}" for m in methods]
    assert set(lenet) == {(k, m) for k in (2, 4) for m in ["per-tensor naive"] + flat}
    for (k, method), r in lenet.items():
        assert r["median_s"] > 0 and r["speedup_vs_per_tensor_naive"] > 0
    assert all(lenet[k, "per-tensor naive"]["speedup_vs_per_tensor_naive"] == 1 for k in (2, 4))
    assert set(result["fastest_lenet_flat"]) == {"2", "4"}
    assert set(result["fastest_lenet_flat"].values()) <= set(ALLREDUCE_ALGORITHMS)

    out = capsys.readouterr().out
    assert "LeNet gradient allreduce, K=4" in out and "fraction of the memcpy bound" in out
    assert "fraction of the memcpy bound at 1 MB: K=2: naive" in out and "receive buffers:" in out
    assert " 1 KB " in out
    assert f"MXNET_CPU_WORKER_NTHREADS={settings['MXNET_CPU_WORKER_NTHREADS']}" in out


def test_sizes_go_from_1_kb_to_64_mb(bench):
    """Issue 10: the fraction of the bound for 1 KB .. 64 MB (the quick run starts at 1 KB too)."""
    assert bench.SIZES[0] == bench.QUICK_SIZES[0] == 1024 and bench.SIZES[-1] == 64 * 1024 ** 2
    assert bench.SIZES == sorted(bench.SIZES) and set(bench.QUICK_SIZES) <= set(bench.SIZES)


def test_thread_settings_come_from_the_environment(bench, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("MXNET_CPU_WORKER_NTHREADS", raising=False)
    settings = bench.thread_settings()
    assert settings["OMP_NUM_THREADS"] == "1"
    assert settings["MXNET_CPU_WORKER_NTHREADS"] == "unset (MXNet default)"


def test_measure_interleaves_configurations(bench):
    """Each repeat visits every configuration once (after one warm-up call each)."""
    calls = []
    cases = {key: (lambda key=key: calls.append(key)) for key in "abcd"}
    times = bench.measure(cases, repeats=3)
    assert {key: len(t) for key, t in times.items()} == dict.fromkeys("abcd", 3)
    assert len(calls) == 16
    for r in range(4):
        assert sorted(calls[4 * r:4 * r + 4]) == list("abcd")


@pytest.mark.parametrize("argv, message", [
    (["--devices", "cpu:1"], "allreduce needs at least 2"),
    (["--devices", "tpu"], "unknown device spec 'tpu'"),
    (["--repeats", "0"], "--repeats 0 is too small"),
])
def test_bad_arguments_exit_2_and_write_nothing(bench, tmp_path, capsys, argv, message):
    assert bench.main(argv + ["--quick", "--out", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "allreduce.json").exists()


def test_out_that_is_a_file_exits_2(bench, tmp_path, capsys):
    target = tmp_path / "taken"
    target.write_text("x")
    assert bench.main(["--quick", "--out", str(target)]) == 2
    assert "error:" in capsys.readouterr().err


def test_the_benchmarks_readme_quotes_issue_47_s_allreduce_run_as_its_results_file_holds_it():
    """benchmarks/README.md's fractions of the copy bound at 64 MB, measured again for issue 47, from
    ``benchmarks/results/issue47/allreduce/allreduce.json``."""
    with open(os.path.join(ROOT, "benchmarks", "results", "issue47", "allreduce", "allreduce.json")) as f:
        result = json.load(f)
    with open(os.path.join(ROOT, "benchmarks", "README.md")) as f:
        readme = f.read()
    fractions, size = result["fraction_of_bound"], str(64 * 2 ** 20)
    for k in ("2", "4"):
        row = f"| {k} | " + " | ".join(f"{fractions[k][m][size]:.2f}" for m in ALLREDUCE_ALGORITHMS) + " |"
        assert row in readme, row
    assert f"cpu(0)->cpu(1) {result['memcpy']['mxnet_bytes_per_s'] / 1e9:.2f} GB/s" in readme
