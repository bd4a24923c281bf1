"""Smoke test of benchmarks/optimizers.py: it runs, its JSON holds every configuration, and the memory it reports
is what ZeRO promises (bytes, not timings: none is asserted)."""
import json
import os

import pytest

from conftest import ROOT, easy_dataset, load_benchmark, write_idx_files


@pytest.mark.slow
def test_optimizers_quick_run_measures_every_configuration(tmp_path, capsys):
    bench = load_benchmark("optimizers")
    assert bench.main(["--quick", "--out", str(tmp_path)]) == 0
    records = json.loads((tmp_path / "optimizers.json").read_text())["records"]
    memory = {(r["optimizer"], r["k"], r["zero"]): r for r in records if r["part"] == "memory"}
    assert set(memory) == {(o, k, z) for o in ("momentum", "adam") for k in (1, 2) for z in (0, 1, 2)}
    for (optimizer, k, zero), r in memory.items():
        state = 4 if optimizer == "momentum" else 8   # float32 bytes of state per parameter, replicated
        shard = state if zero == 0 else state / k      # sharded: the busiest context holds one shard (+ rounding)
        assert r["state_bytes_per_parameter"] == pytest.approx(shard, rel=1e-4)
        assert r["bytes_per_parameter"] == pytest.approx(8 + shard, rel=1e-4)
    updates = {(r["method"], r["optimizer"], r["k"]) for r in records if r["part"] == "update"}
    assert updates == {(m, o, k) for m in bench.UPDATE_METHODS for o in bench.UPDATE_OPTIMIZERS for k in (1, 2)}
    steps = {(r["optimizer"], r["zero"], r["k"]) for r in records if r["part"] == "step"}
    assert steps == {(o, z, k) for o in ("momentum", "adam") for z in (0, 1, 2) for k in (1, 2)}
    for r in records:
        if r["part"] != "memory":
            assert len(r["ms"]) == 2 and r["median_ms"] > 0 and r["ratio"] > 0
    assert "bytes per parameter" in capsys.readouterr().out


def test_optimizers_rejects_unknown_parts(capsys):
    with pytest.raises(SystemExit) as exit_info:
        load_benchmark("optimizers").main(["--parts", "speed"])
    assert exit_info.value.code == 2 and "--parts takes memory, update and/or step" in capsys.readouterr().err


@pytest.mark.slow
def test_optimizer_accuracy_quick_run_trains_a_configuration_of_each_model(tmp_path, capsys):
    from conftest import easy_dataset, write_idx_files
    (tmp_path / "data").mkdir()
    data_dir = write_idx_files(tmp_path / "data", easy_dataset(num_train=64, num_test=32, seed=2))
    bench = load_benchmark("optimizer_accuracy")
    # a configuration of each model: the others of a model differ from it in the CLI's flags alone
    chosen = ["resnet18/momentum", "lenet/nesterov", "vit-moe/adamw"]
    assert set(chosen) <= set(bench.CONFIGURATIONS)
    assert bench.main(["--data-dir", str(data_dir), "--quick", "--configurations", ",".join(chosen), "--out",
                       str(tmp_path)]) == 0
    records = json.loads((tmp_path / "optimizer_accuracy.json").read_text())["records"]
    assert [r["configuration"] for r in records] == chosen
    for r in records:
        assert len(r["test_acc"]) == 2 and all(0 <= a <= 1 for a in r["test_acc"]) and min(r["seconds"]) > 0
    assert "test acc after each epoch" in capsys.readouterr().out


def test_optimizer_accuracy_runs_the_seeds_it_is_given(tmp_path, monkeypatch, capsys):
    """``--seeds N``: seeds 0 .. N-1 of each configuration chosen, in that order (the runs themselves stubbed: the
    quick run above trains); ``--seeds 0`` is refused with exit status 2."""
    bench = load_benchmark("optimizer_accuracy")
    ran = []
    monkeypatch.setattr(bench, "run_one", lambda model, epochs, seed, flags, data_dir, timeout: (
        ran.append((model, seed)) or [{"test_acc": 0.5, "seconds": 1.0}] * epochs))
    digits = str(write_idx_files(tmp_path, easy_dataset(num_train=20, num_test=5)))
    assert bench.main(["--data-dir", digits, "--configurations", "vit/adamw,lenet/sgd", "--seeds", "3",
                       "--out", str(tmp_path)]) == 0
    assert ran == [("vit", 0), ("vit", 1), ("vit", 2), ("lenet", 0), ("lenet", 1), ("lenet", 2)]
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--data-dir", digits, "--seeds", "0"])
    assert exit_info.value.code == 2 and "--seeds must be at least 1, got 0" in capsys.readouterr().err


def test_the_experts_doc_quotes_issue_46_s_accuracy_runs_as_their_results_files_hold_them():
    """docs/experts.md's tables of the dense and the mixture-of-experts ViT on 2 contexts are the committed runs', on
    each CPU, seeds 0-9 each."""
    with open(os.path.join(ROOT, "docs", "experts.md")) as f:
        doc = f.read()
    rows = {"vit/adamw": "dense", "vit-moe/adamw": "4 experts, `--expert-parallel 2`",
            "vit-moe-gates-x4/adamw": "4 experts, `--expert-parallel 2 --gate-scale 4`"}
    for name, configurations in (("optimizer_accuracy.json", list(rows)),
                                 ("optimizer_accuracy_another_cpu.json", ["vit/adamw", "vit-moe/adamw"])):
        with open(os.path.join(ROOT, "benchmarks", "results", "issue46", name)) as f:
            records = json.load(f)["records"]
        assert sorted({r["configuration"] for r in records}) == sorted(configurations), name
        for configuration in configurations:
            final = [r["test_acc"][-1] for r in records if r["configuration"] == configuration]
            assert [r["seed"] for r in records if r["configuration"] == configuration] == list(range(10))
            cells = " ".join(f"{a:.3f}" for a in final)
            assert f"| {rows[configuration]} | {cells} | {sum(final) / len(final):.3f} |" in doc, (name, configuration)
