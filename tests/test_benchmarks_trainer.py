"""Smoke tests of benchmarks/trainer.py and benchmarks/profile_step.py: they run and their JSON holds every
configuration and operator table (no timing asserted)."""
import json

import pytest

from conftest import load_benchmark


def test_trainer_quick_run_measures_every_configuration(tmp_path, capsys):
    bench = load_benchmark("trainer")
    assert bench.main(["--quick", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "trainer.json").read_text())
    got = {(r["network"], r["method"], r["k"]) for r in result["records"]}
    assert got == {("lenet", m, k) for m in ("trainer", "parallel", "parallel/lenet") for k in (1, 2)} | {
        ("resnet18", "trainer", 1), ("resnet18", "parallel", 1), ("resnet18", "trainer", 2),
        ("resnet18", "parallel", 2), ("resnet18", "parallel/syncbn", 2)}
    for r in result["records"]:
        assert len(r["ms"]) == 2 and r["median_ms"] > 0 and r["ratio_to_trainer"] > 0
        if r["method"] == "trainer":
            assert r["ratio_to_trainer"] == 1.0
    assert "OMP_NUM_THREADS=" in capsys.readouterr().out


def test_trainer_rejects_unknown_networks(capsys):
    with pytest.raises(SystemExit) as exit_info:
        load_benchmark("trainer").main(["--networks", "vgg"])
    assert exit_info.value.code == 2 and "--networks takes lenet and/or resnet18" in capsys.readouterr().err


def test_profile_quick_run_times_operators_and_convolution_flops(tmp_path, capsys):
    bench = load_benchmark("profile_step")
    assert bench.main(["--quick", "--out", str(tmp_path)]) == 0
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
    assert "of the measured peak" in capsys.readouterr().out
