"""Smoke tests of benchmarks/trainer.py and benchmarks/profile_step.py: they run and their JSON holds every
configuration and operator table (no timing asserted)."""
import json
import os
import sys

import pytest

from conftest import ROOT, load_benchmark, run_process


@pytest.mark.slow
def test_trainer_quick_run_measures_every_configuration(tmp_path, capsys):
    bench = load_benchmark("trainer")
    assert bench.main(["--quick", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "trainer.json").read_text())
    got = {(r["network"], r["method"], r["k"]) for r in result["records"]}
    everywhere = ("trainer", "parallel", "trainer/reduce+update", "parallel/reduce+update")
    overlap = ("parallel/buckets=1", "parallel/buckets=8")
    assert got == ({("lenet", m, k) for m in everywhere + ("parallel/lenet",) for k in (1, 2)}
                   | {("resnet18", m, k) for m in everywhere for k in (1, 2)}
                   | {(network, m, 2) for network in ("lenet", "resnet18") for m in overlap}
                   | {("resnet18", "parallel/syncbn", 2)})
    for r in result["records"]:
        assert len(r["ms"]) == 2 and r["median_ms"] > 0 and r["ratio"] > 0
        want = ("trainer/reduce+update" if r["method"].endswith("reduce+update")
                else "parallel/buckets=1" if r["method"].startswith("parallel/buckets") else "trainer")
        assert r["reference"] == want
        if r["method"] == want:
            assert r["ratio"] == 1.0
    assert "OMP_NUM_THREADS=" in capsys.readouterr().out


@pytest.mark.slow
def test_kvstore_quick_run_compares_the_packages_kvstore_with_device(tmp_path, capsys):
    bench = load_benchmark("trainer")
    # LeNet alone: the quick run above runs ResNet-18 through the same benchmark, test_trainer_kvstore.py the
    # package's kvstore with many buckets
    assert bench.main(["--quick", "--networks", "lenet", "--kvstores", "fused,ring", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "trainer_kvstore.json").read_text())
    methods = ("trainer", "trainer/kv=fused", "trainer/kv=ring", "trainer/reduce+update",
               "trainer/kv=fused/reduce+update", "trainer/kv=ring/reduce+update")
    assert {(r["network"], r["method"], r["k"]) for r in result["records"]} == {
        ("lenet", m, k) for m in methods for k in (1, 2)}
    for r in result["records"]:
        assert r["reference"] == ("trainer/reduce+update" if r["method"].endswith("reduce+update") else "trainer")
    assert not (tmp_path / "trainer.json").exists()
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--kvstores", "butterfly"])
    assert exit_info.value.code == 2 and "--kvstores takes" in capsys.readouterr().err


def test_the_overlap_rows_reducer_trains_what_one_buffer_trains():
    """The overlap measurement's Reducer changes where gradients live, not the step: its 1 and 3 buckets (at most
    --buckets) give the parameters of the package's own train_step on the same block (per-context BatchNorm)."""
    import mxnet as mx
    import numpy as np
    from mxnet.gluon import nn

    import parallel

    bench = load_benchmark("trainer")
    ctx_list = [mx.cpu(0), mx.cpu(1)]
    X = mx.nd.array(np.random.RandomState(0).rand(6, 1, 8, 8))
    y = mx.nd.array([0, 1, 2, 3, 1, 0])

    def block():
        mx.random.seed(0)
        net = nn.HybridSequential()
        net.add(nn.Conv2D(4, 3), nn.Activation("relu"), nn.Dense(16), nn.Dense(4))
        net.initialize(mx.init.Xavier())
        net(X[:1])
        return net

    results = []
    for num_buckets in (None, 1, 3):
        net = block()
        reducer = None
        if num_buckets is None:
            device_params = [parallel.get_params(net, ctx) for ctx in ctx_list]
        else:
            reducer, device_params = bench.bucketed_replicas(net, ctx_list, num_buckets)
            assert len(device_params[0].buckets) == num_buckets
            assert (reducer.bucket_mb is None) == (num_buckets == 1)
        for _ in range(3):
            parallel.train_step(X, y, device_params, ctx_list, 0.1, net=parallel.GluonNet(net, sync_batchnorm=False),
                                reducer=reducer)
        results.append([p.asnumpy() for p in device_params[1]])
    for got in results[1:]:
        for a, b in zip(got, results[0]):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * np.abs(b).max())


def test_bucket_mb_for_gives_at_most_the_buckets_asked_for():
    """The smallest bound in bytes that gives no more than the buckets asked for (the largest array alone
    can ask for no smaller one)."""
    import numpy as np
    from parallel import LENET_SHAPES
    from parallel.comm.replica import bucket_ranges
    bench = load_benchmark("trainer")
    sizes = [int(np.prod(shape)) for shape in LENET_SHAPES]
    assert bench.bucket_mb_for(sizes, 1) is None
    for num_buckets in range(2, 9):
        bound = int(bench.bucket_mb_for(sizes, num_buckets) * 2 ** 20)
        assert len(bucket_ranges(sizes, 4, bound)) <= num_buckets
        assert bound == 4 * max(sizes) or len(bucket_ranges(sizes, 4, bound - 1)) > num_buckets


def test_trainer_rejects_unknown_networks(capsys):
    with pytest.raises(SystemExit) as exit_info:
        load_benchmark("trainer").main(["--networks", "vgg"])
    assert exit_info.value.code == 2 and "--networks takes lenet and/or resnet18" in capsys.readouterr().err


@pytest.mark.slow
def test_profile_quick_run_times_operators_and_convolution_flops(tmp_path):
    """... and leaves nothing in the temporary directory: MXNet's profiler writes its file again at the
    process's teardown unless it was dumped."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    run = run_process([sys.executable, os.path.join(ROOT, "benchmarks", "profile_step.py"), "--quick",
                       "--out", str(tmp_path)], timeout=600, env=dict(os.environ, TMPDIR=str(scratch)))
    assert run.returncode == 0, run.stderr[-2000:]
    assert list(scratch.iterdir()) == []
    result = json.loads((tmp_path / "profile_step.json").read_text())
    assert set(result["peak_gflops"]) == {"numpy", "mxnet"}
    assert [r["network"] for r in result["results"]] == ["lenet", "resnet18"]
    for r in result["results"]:
        names = {op["operator"] for op in r["operators"]}
        assert {"Convolution", "_backward_Convolution", "sgd_update"} <= names
        assert sum(op["fraction"] for op in r["operators"]) == pytest.approx(1.0)
        assert 0 < r["conv_fraction"] < 1 and r["conv_gflops"] > 0
    lenet, resnet = result["results"]
    # the arithmetic of the graphs: LeNet's two convolutions, 0.91 GFLOP per 28x28 image for ResNet-18
    assert lenet["conv_forward_gflop"] == pytest.approx(256 * 2 * (20 * 26 * 26 * 9 + 50 * 9 * 9 * 20 * 25) / 1e9)
    assert resnet["conv_forward_gflop"] / resnet["batch_size"] == pytest.approx(0.91, rel=0.01)
    assert "of the measured peak" in run.stdout


def test_the_benchmarks_readme_quotes_issue_47_s_step_run_as_its_results_file_holds_it():
    """benchmarks/README.md's table of the step against gluon's Trainer, measured again for issue 47, row for row
    from ``benchmarks/results/issue47/trainer/trainer.json``."""
    with open(os.path.join(ROOT, "benchmarks", "results", "issue47", "trainer", "trainer.json")) as f:
        records = {(r["network"], r["method"], r["k"]): r for r in json.load(f)["records"]}
    with open(os.path.join(ROOT, "benchmarks", "README.md")) as f:
        readme = f.read()
    for network, name in (("lenet", "LeNet"), ("resnet18", "ResNet-18")):
        for k in (1, 2, 4):
            trainer, ours = records[network, "trainer", k], records[network, "parallel", k]
            lenet = records.get((network, "parallel/lenet", k))
            row = (f"| {name} | {k} | {trainer['median_ms']:.1f} | {ours['median_ms']:.1f} ({ours['ratio']:.2f}) | "
                   + (f"{lenet['median_ms']:.1f} ({lenet['ratio']:.2f})" if lenet else "") + " |")
            assert row in readme, row
