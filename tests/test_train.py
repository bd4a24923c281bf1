"""The CLI end to end on small IDX files, and every error path (exit 2, one line, no traceback)."""
import json
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import mxnet as mx

from parallel import RunConfig, init_model, make_strategy, read_idx, write_idx
from parallel.data import FILES
from parallel.cli import UsageError
from parallel.train import SCOPES, main
from parallel.fit import IN_FLIGHT, NonFiniteLossError, fit
from conftest import assert_refused, easy_dataset, run_process, start_process, write_idx_files

KEYS = {"epoch", "train_loss", "train_acc", "test_acc", "seconds", "images_per_second", "workers"}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """A small learnable MNIST-format dataset, written as IDX files (gzipped and raw)."""
    directory = tmp_path_factory.mktemp("idx")
    ds = easy_dataset(num_train=2000, num_test=300, seed=1)
    write_idx(directory / (FILES["train_images"] + ".gz"), ds.train_images)
    write_idx(directory / (FILES["train_labels"] + ".gz"), ds.train_labels)
    write_idx(directory / FILES["test_images"], ds.test_images)
    write_idx(directory / FILES["test_labels"], ds.test_labels)
    return directory


def run_cli(*args):
    """Run ``python -m parallel.train`` in a subprocess (for exit status and stderr as a user sees them)."""
    return run_process([sys.executable, "-m", "parallel.train", "--no-progress", *args],
                          timeout=300)


@pytest.mark.parametrize("epochs, data", [(2, "easy_dir"),   # 2 epochs of 256 examples: the outputs, quickly
                                          pytest.param(6, "data_dir", marks=pytest.mark.slow)])   # 6 of 2000: it learns
def test_trains_above_chance_and_writes_outputs(epochs, data, tmp_path, capsys, request):
    metrics_path, plot_path = tmp_path / "m.json", tmp_path / "curves.png"
    status = main(["--devices", "cpu:2", "--epochs", str(epochs), "--batch-size", "32", "--lr", "0.5",
                   "--data-dir", str(request.getfixturevalue(data)), "--metrics-json", str(metrics_path),
                   "--plot", str(plot_path), "--no-progress"])
    assert status == 0
    out = capsys.readouterr().out
    lines = [l for l in out.splitlines() if l.startswith("epoch ")]
    assert len(lines) == epochs
    assert lines[0].startswith("epoch 1, loss ") and lines[0].endswith("on [cpu(0), cpu(1)]")
    assert "train acc" in lines[0] and "sec/epoch" in lines[0] and "examples/sec" in lines[0]
    history = json.loads(metrics_path.read_text())
    assert [m["epoch"] for m in history] == list(range(1, epochs + 1))
    for m in history:
        assert set(m) == KEYS | {"memory"}
        assert m["workers"] == 1   # one process: --metrics-json records each epoch's number of workers
        assert all(isinstance(m[k], (int, float)) and math.isfinite(m[k]) for k in KEYS)
        assert [row["context"] for row in m["memory"]] == ["cpu(0)", "cpu(1)"]
        for row in m["memory"]:   # LeNet's 129068 float32 parameters, their gradient; plain SGD keeps no state
            assert (row["parameters"], row["gradients"], row["optimizer_state"], row["gathered_peak"]) == (
                4 * 129068, 4 * 129068, 0, 0)
        # the fused allreduce receives cpu(1)'s gradient into one buffer on cpu(0)
        assert [row["temporary_buffers"] for row in m["memory"]] == [4 * 129068, 0]
    assert ("memory for training: 1.48 MiB on the busiest context, cpu(0) (parameters 0.49, gradients 0.49, "
            "optimizer state 0.00, temporary buffers 0.49 MiB)") in out
    if epochs == 6:   # LeNet's sigmoids leave the plateau at chance (0.1) after a few epochs
        assert history[-1]["test_acc"] > 0.5
        assert history[-1]["train_loss"] < history[0]["train_loss"]
    assert plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def _memory_line(out):
    """The run's ``memory for training:`` line (one)."""
    [line] = [line for line in out.splitlines() if line.startswith("memory for training: ")]
    return line


def _total_mib(line):
    return float(line.split()[3])


@pytest.mark.parametrize("args", [["--zero", "0"], ["--zero", "3"], ["--model", "vit", "--tensor", "2"]])
def test_the_memory_line_is_the_metrics_memory_and_counts_the_buffers_a_layout_allocates(args, tmp_path, capsys):
    """One definition (docs/memory.md): the line after the first step and --metrics-json's "memory" are one
    measurement, and its temporary buffers are what the run's reductions keep (``buffer_bytes``, still this run's
    after main returns) plus ZeRO-3's unit gradient (the size of its gather buffer). The line was computed before
    the first step: it left out the allreduce's receive buffers (--zero 0) and tensor ranks' f and g ones."""
    from parallel.comm import buffer_bytes
    from parallel.report import format_memory
    data_dir = write_idx_files(tmp_path, easy_dataset(num_train=256, num_test=64, seed=2))
    path = tmp_path / "m.json"
    assert main(["--data-dir", str(data_dir), "--devices", "cpu:2", "--epochs", "1", "--batch-size", "64",
                 "--no-progress", "--metrics-json", str(path), *args]) == 0
    memory = json.loads(path.read_text())[0]["memory"]
    assert _memory_line(capsys.readouterr().out) == format_memory(memory)
    received = {str(ctx): nbytes for ctx, nbytes in buffer_bytes().items()}
    assert received.get("cpu(0)")   # the fused allreduce (of gradients, or of f's and g's activations)
    for row in memory:
        assert row["temporary_buffers"] == received.get(row["context"], 0) + row["gathered_peak"], row


@pytest.mark.slow   # seconds the fast tier's 150 s budget cannot spare (docs/testing.md)
def test_zero3_holds_less_than_zero0_where_its_largest_unit_is_a_small_part_of_the_model(tmp_path, capsys):
    """The orders docs/memory.md gives: on 2 contexts ZeRO-3 holds Psi + 3 U against 3 Psi, so it saves on the ViT
    (largest unit 24% of it) and not on LeNet (79%), where it saves from 3 contexts on."""
    data_dir = write_idx_files(tmp_path, easy_dataset(num_train=128, num_test=32, seed=2))
    total = {}
    for model, devices in (("vit", "cpu:2"), ("lenet", "cpu:2"), ("lenet", "cpu:3")):
        for zero in ("0", "3"):
            assert main(["--data-dir", str(data_dir), "--devices", devices, "--epochs", "1", "--batch-size", "64",
                         "--no-progress", "--model", model, "--zero", zero]) == 0
            total[model, devices, zero] = _total_mib(_memory_line(capsys.readouterr().out))
    assert total["vit", "cpu:2", "3"] < 0.6 * total["vit", "cpu:2", "0"], total
    assert total["lenet", "cpu:2", "3"] > total["lenet", "cpu:2", "0"], total
    assert total["lenet", "cpu:3", "3"] < total["lenet", "cpu:3", "0"], total


@pytest.mark.parametrize("devices, zero", [("cpu:1", "1"), ("cpu:1", "3"), ("cpu:2", "3")])
def test_zero_with_one_replica_says_it_shards_nothing(devices, zero, tmp_path, capsys):
    """--zero 1 and 3 on one context printed 'sharded over the contexts' (and 'keeps 1/1'), where nothing is
    sharded and ZeRO-3 holds more than --zero 0: the header says nothing is sharded, and a warning what it costs."""
    data_dir = write_idx_files(tmp_path, easy_dataset(num_train=128, num_test=32, seed=2))
    assert main(["--data-dir", str(data_dir), "--devices", devices, "--epochs", "1", "--batch-size", "64",
                 "--no-progress", "--zero", zero]) == 0
    out, err = capsys.readouterr()
    if devices == "cpu:2":   # two replicas: sharded, and no warning
        assert "sharded over the contexts" in out and "each context keeps 1/2" in out and not err, (out, err)
        return
    assert "sharded over the contexts" not in out and "keeps 1/1" not in out, out
    assert f"optimizer sgd (lr 0.2), ZeRO-{zero} with one replica: nothing to shard" in out, out
    [warning] = err.splitlines()
    assert warning.startswith(f"warning: --zero {zero} shards nothing here: one replica of the model"), warning
    if zero == "3":
        assert "ZeRO-3 with one replica: nothing to shard; each of the 4 blocks still gathered" in out, out
        assert "holds more than --zero 0" in warning


def test_the_help_names_every_model_and_parallel_style():
    """--help said 'Train LeNet, ResNet-18 or a small ViT with data parallelism': it trains every model of MODELS
    (the Transformer too) with every style; the module's first paragraph, --stages, --recompute and their rows in the
    README's flag table name every model too."""
    import parallel.train as train
    from parallel.models import MODELS
    description, summary = train.build_parser().description, train.__doc__.split("\n\n")[0]
    helps = {action.dest: action.help for action in train.build_parser().options}
    from pathlib import Path
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    rows = [line for line in readme.splitlines() if line.startswith(("| `--stages N`", "| `--recompute`"))]
    for entry in MODELS.values():   # the ViT's 6 and the Transformer's 4 layers too
        assert entry.title in description and entry.title in summary, entry.title
        assert entry.title in helps["stages"] and entry.title in helps["recompute"], entry.title
        assert len(rows) == 2 and all(entry.title in row for row in rows), (entry.title, rows)
    assert all(style in description for style in ("data", "pipeline", "tensor")), description


@pytest.mark.slow   # seconds the fast tier's 150 s budget cannot spare (docs/testing.md)
@pytest.mark.parametrize("algorithm", ["naive", "fused"])
def test_same_seed_same_curve_different_devices(data_dir, tmp_path, algorithm):
    curves = []
    for devices in ("cpu:1", "cpu:3"):
        path = tmp_path / f"{devices.replace(':', '')}.json"
        assert main(["--devices", devices, "--epochs", "1", "--batch-size", "100", "--seed", "3",
                     "--allreduce", algorithm,
                     "--data-dir", str(data_dir), "--metrics-json", str(path), "--no-progress"]) == 0
        curves.append(json.loads(path.read_text()))
    for a, b in zip(*curves):
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-4)
        assert a["test_acc"] == pytest.approx(b["test_acc"], abs=1 / 300 + 1e-9)


@pytest.mark.slow   # that each layout trains the one-context model is test_layouts.py's; here the CLI's four presets
def test_same_seed_same_curve_under_every_strategy(data_dir, tmp_path, capsys):
    """Every strategy runs the same SGD step on the same batches. Batch 57 leaves a last batch of 5
    examples, fewer than the pipeline's 6 micro-batches: it runs in 5."""
    runs = {"data": ([], "on [cpu(0), cpu(1), cpu(2), cpu(3)]"),
            "model": (["--boundaries", "2"], "model parallel on [cpu(0), cpu(1)]"),
            "pipeline": (["--stages", "2", "--micro-batches", "6"], "pipeline parallel on [cpu(0), cpu(1)]"),
            "hybrid": (["--stages", "2"], "hybrid parallel on [cpu(0), cpu(1), cpu(2), cpu(3)]")}
    curves = {}
    for strategy, (extra, where) in runs.items():
        path = tmp_path / f"{strategy}.json"
        assert main(["--devices", "cpu:4", "--strategy", strategy, *extra, "--epochs", "1", "--batch-size", "57",
                     "--lr", "0.5", "--seed", "3", "--data-dir", str(data_dir), "--metrics-json", str(path),
                     "--no-progress"]) == 0
        out = capsys.readouterr().out
        epoch_lines = [l for l in out.splitlines() if l.startswith("epoch 1, loss")]
        assert len(epoch_lines) == 1 and epoch_lines[0].endswith(where), out
        assert f"strategy {strategy}: " in out
        curves[strategy] = json.loads(path.read_text())
    for strategy in ("model", "pipeline", "hybrid"):
        for a, b in zip(curves["data"], curves[strategy]):
            assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-4)
            assert b["train_acc"] == pytest.approx(a["train_acc"], abs=1 / 2000 + 1e-9)
            assert b["test_acc"] == pytest.approx(a["test_acc"], abs=1 / 300 + 1e-9)


@pytest.mark.slow
def test_subprocess_entry_point_runs_with_every_core_per_operator(data_dir, monkeypatch):
    from parallel import recommended_omp_threads
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    result = run_cli("--devices", "cpu:2", "--epochs", "1", "--batch-size", "128",
                     "--data-dir", str(data_dir))
    assert result.returncode == 0, result.stderr
    assert "epoch 1, loss" in result.stdout
    assert f"OMP_NUM_THREADS={recommended_omp_threads()}" in result.stdout   # set, then re-executed


@pytest.mark.slow
def test_subprocess_keeps_the_users_thread_setting(data_dir, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    result = run_cli("--devices", "cpu:1", "--epochs", "1", "--batch-size", "256",
                     "--data-dir", str(data_dir))
    assert result.returncode == 0, result.stderr
    assert "operator threads: OMP_NUM_THREADS=1\n" in result.stdout


_SCIPY_STATS_UNUSED = """
import sys
from parallel.train import main
assert main(["--data-dir", sys.argv[1], "--epochs", "1", "--batch-size", "64", "--no-progress"]) == 0
import mxnet
print("imported for the run:", "scipy.stats" in sys.modules, mxnet.contrib.quantization.stats)
from scipy.stats import norm
print("then:", norm.cdf(0.0))
"""


def test_a_run_of_the_cli_never_imports_scipy_stats(easy_dir):
    """MXNet imports scipy.stats at start-up (0.3 s of a core a process) for nothing a run does: the CLI imports
    MXNet without it (``parallel.mxnet_compat.import_mxnet_without_scipy_stats``), and scipy.stats imports as
    ever afterwards. In this process MXNet came first: it has its scipy.stats, and the call changes nothing."""
    pytest.importorskip("scipy")
    from parallel.mxnet_compat import import_mxnet_without_scipy_stats
    assert import_mxnet_without_scipy_stats() is mx and mx.contrib.quantization.stats is sys.modules["scipy.stats"]
    result = run_process([sys.executable, "-c", _SCIPY_STATS_UNUSED, str(easy_dir)], timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-2:] == ["imported for the run: False None", "then: 0.5"], result.stdout


def test_loss_becoming_nan_stops_with_epoch_and_batch(data_dir, capsys):
    # lr 1e10 overflows the weights; the first NaN loss is the third batch's (1e30 would only kill every
    # ReLU and leave a huge but finite loss)
    status = main(["--devices", "cpu:2", "--epochs", "2", "--batch-size", "64", "--lr", "1e10",
                   "--data-dir", str(data_dir), "--no-progress", "--seed", "1"])
    assert status == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --lr is too large: the loss became nan at epoch 1, batch 3 (training diverged)")
    assert len(err.splitlines()) == 1


@pytest.mark.parametrize("output", [[], ["--export", "model"], ["--checkpoint-dir", "ckpt", "--checkpoint-every", "2"]])
def test_weights_becoming_infinite_under_a_finite_loss_stop_with_one_line(output, capsys, tmp_path, monkeypatch):
    """--lr 1e30 (within float32) makes LeNet's weights infinite while its loss stays finite (its sigmoids
    saturate): with or without an output file, one line and status 2, and nothing written."""
    data = write_idx_files(tmp_path, easy_dataset(num_train=60, num_test=10))
    monkeypatch.chdir(tmp_path)
    status = main(["--devices", "cpu:2", "--epochs", "2", "--batch-size", "10", "--lr", "1e30",
                   "--data-dir", str(data), "--no-progress", *output])
    err = capsys.readouterr().err.strip()
    assert status == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("error: --lr is too large: the parameters became NaN or infinite by epoch 1, batch "), err
    assert not list(tmp_path.glob("model*")) and not list(tmp_path.glob("ckpt/*.params"))


@pytest.mark.parametrize("args, blamed", [
    (["--wd", "1e30"], "error: --wd 1e+30 is likely too large (set away from its default): the loss became nan"),
    pytest.param(["--optimizer", "adamw", "--wd", "1e38"],
                 "error: --wd 1e+38 is likely too large (set away from its default)", marks=pytest.mark.slow),
    pytest.param(["--lr", "1e10", "--wd", "1e30"], "the likely causes are the settings away from their defaults, "
                                                   "--lr 1e+10 or --wd 1e+30: lower them", marks=pytest.mark.slow),
])
def test_divergence_names_the_flags_set_away_from_their_defaults(args, blamed, easy_dir, capsys):
    """A loss that becomes NaN under a huge --wd blames --wd, not the default --lr."""
    status = main(["--data-dir", str(easy_dir), "--devices", "cpu:1", "--epochs", "1", "--batch-size", "64",
                   "--no-progress", *args])
    err = capsys.readouterr().err.strip()
    assert status == 2 and len(err.splitlines()) == 1, err
    assert blamed in err and "(training diverged)" in err, err
    assert "--lr is too large" not in err


@pytest.fixture
def broken_dirs(tmp_path, data_dir):
    """Directories each holding one broken IDX file among three good ones."""
    good = tmp_path / "good"
    good.mkdir()
    for f in FILES.values():
        path = data_dir / (f + ".gz")
        if not path.exists():
            path = data_dir / f
        write_idx(good / (f + ".gz"), read_idx(path))
    raw = (data_dir / FILES["test_images"]).read_bytes()
    cases = {
        "missing": None,   # no t10k-images file at all
        "truncated": raw[:-100],
        "corrupt-magic": b"\x00\x00\x09\x99" + raw[4:],
        "inconsistent": None,
    }
    dirs = {}
    for case, data in cases.items():
        d = tmp_path / case
        d.mkdir()
        for f in FILES.values():
            (d / (f + ".gz")).write_bytes((good / (f + ".gz")).read_bytes())
        (d / (FILES["test_images"] + ".gz")).unlink()
        if case == "inconsistent":   # a valid file with 10 images where the labels say 400
            write_idx(d / FILES["test_images"], np.zeros((10, 28, 28), np.uint8))
        elif data is not None:
            (d / FILES["test_images"]).write_bytes(data)
        dirs[case] = d
    return dirs


@pytest.mark.parametrize("case, message", [
    ("missing", "t10k-images-idx3-ubyte"),
    ("truncated", "t10k-images-idx3-ubyte"),
    ("corrupt-magic", "magic"),
    ("inconsistent", "10 images"),
])
def test_broken_data_exits_2(broken_dirs, case, message, capsys):
    status = main(["--devices", "cpu:1", "--epochs", "1", "--data-dir", str(broken_dirs[case]),
                   "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert status == 2
    assert err.startswith("error: ") and message in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("args, message", [
    (["--devices", "tpu:3"], "unknown --devices"),
    (["--devices", "gpu:0"], "GPU"),
    (["--batch-size", "0"], "--batch-size must be >= 1"),
    (["--epochs", "0"], "--epochs must be >= 1"),
    (["--epochs", "-2"], "--epochs must be >= 1"),
    (["--lr", "0"], "--lr must be a finite number > 0"),
    (["--lr", "-0.1"], "--lr must be a finite number > 0"),
    (["--lr", "nan"], "--lr must be a finite number > 0, got nan"),
    (["--lr", "inf"], "--lr must be a finite number > 0, got inf"),
    (["--lr", "fast"], "--lr must be a finite number > 0, got 'fast'"),
    (["--batch-size", "x"], "invalid int value"),
    (["--dataset", "cifar"], "invalid choice"),
    (["--metrics-json", "/nonexistent-dir/m.json"], "does not exist"),
    (["--plot", "/nonexistent-dir/p.png"], "does not exist"),
    (["--frobnicate"], "unrecognized arguments"),
    (["--allreduce", "carrier-pigeon"], "invalid choice"),
    # the other parallel styles: more stages than contexts, or than LeNet's layers
    (["--strategy", "model", "--devices", "cpu:2", "--stages", "3"], "3 stages need 3 contexts, got 2"),
    (["--strategy", "pipeline", "--devices", "cpu:1"], "2 stages need 2 contexts, got 1"),
    (["--strategy", "model", "--devices", "cpu:2", "--boundaries", "1,2,3"], "4 stages need 4 contexts, got 2"),
    (["--strategy", "model", "--devices", "cpu:5", "--stages", "5"], "--stages 5 cannot split LeNet's 4 layers"),
    (["--strategy", "hybrid", "--devices", "cpu:2", "--stages", "0"], "--stages 0 cannot split"),
    # more micro-batches than examples in a batch
    (["--strategy", "pipeline", "--devices", "cpu:2", "--micro-batches", "300"],
     "--micro-batches 300 cannot split batches of 256 examples; use at most 256 micro-batches"),
    (["--strategy", "pipeline", "--devices", "cpu:2", "--batch-size", "3", "--micro-batches", "4"],
     "--micro-batches 4 cannot split batches of 3 examples"),
    (["--strategy", "pipeline", "--devices", "cpu:2", "--micro-batches", "0"], "--micro-batches must be >= 1, got 0"),
    # contexts that cannot be divided into equal replica groups
    (["--strategy", "hybrid", "--devices", "cpu:4", "--stages", "3"],
     "4 contexts in --devices cannot form equal groups of 3 --stages; use a multiple of 3 contexts"),
    (["--strategy", "hybrid", "--devices", "cpu:3"], "3 contexts in --devices cannot form equal groups of 2 --stages"),
    # a stage boundary outside the model, unsorted or repeated
    (["--strategy", "model", "--devices", "cpu:2", "--boundaries", "4"], "--boundaries 4 is outside LeNet's 4 layers"),
    (["--strategy", "hybrid", "--devices", "cpu:2", "--boundaries", "0"], "--boundaries 0 is outside"),
    (["--strategy", "model", "--devices", "cpu:3", "--boundaries", "2,1"], "must be strictly increasing"),
    (["--strategy", "pipeline", "--devices", "cpu:3", "--boundaries", "2,2"], "without repeats"),
    (["--strategy", "model", "--devices", "cpu:2", "--boundaries", "conv"], "not a comma-separated list"),
    # options that do not apply to the chosen strategy
    (["--stages", "2"], "--stages and --boundaries cut the model into pipeline stages; the data strategy keeps it "
                        "whole, not the data --strategy's (stages = 1); drop them, or use the hybrid --strategy"),
    (["--boundaries", "2"], "use the hybrid --strategy"),
    (["--strategy", "model", "--devices", "cpu:2", "--micro-batches", "2"],
     "--micro-batches feed a pipeline, not the model --strategy's (micro_batches = 1); use --accumulate for "
     "micro-batches of a whole model"),
    (["--strategy", "model", "--devices", "cpu:2", "--stages", "2", "--boundaries", "2"],
     "--stages and --boundaries both say where to cut; give one of them"),
    (["--strategy", "diagonal"], "invalid choice"),
    # found in a newcomer's trial: each was accepted, or crashed after training had started
    (["--seed", "-1"], "--seed must be between 0 and 4294967295, got -1"),
    (["--seed", "4294967296"], "--seed must be between 0 and 4294967295"),
    (["--lr", "1e-40"], "--lr must be between 1.18e-38 and 3.40e+38"),
    (["--lr", "1e-300"], "--lr must be between"),
    (["--lr", "1e39"], "--lr must be between"),
    (["--devices", "cpu:"], "cpu:"),
    (["--metrics-json", ""], "--metrics-json needs a path"),
    (["--plot", ""], "--plot needs a path"),
    (["--metrics-json", "/dev/full"], "is a character device, not a regular file"),
    (["--epoch", "1"], "unrecognized arguments: --epoch"),
    (["--plot", "curves"], "end the file name with a format matplotlib writes"),
    (["--plot", "curves.xyz"], "end the file name with a format matplotlib writes"),
    (["--metrics-json", "out.png", "--plot", "./out.png"], "--metrics-json and --plot both name"),
    # the optimizer's flags
    (["--optimizer", "adam", "--momentum", "0.9"], "--momentum applies to --optimizer sgd, not adam"),
    (["--nesterov"], "--nesterov needs a --momentum > 0"),
    # not the advice to add --momentum, which adam refuses in turn
    (["--optimizer", "adam", "--nesterov"], "--nesterov applies to --optimizer sgd with a --momentum > 0, not to adam; "
                                            "drop --nesterov"),
    (["--optimizer", "adamw", "--momentum", "0.5"], "--momentum applies to --optimizer sgd, not adamw"),
    (["--momentum", "1"], "--momentum must be in [0, 1), got 1.0"),
    (["--wd", "-0.1"], "--wd must be >= 0"),
    (["--clip-norm", "-1"], "--clip-norm must be a finite number > 0"),
    (["--accumulate", "0"], "--accumulate must be between 1 and 256, got 0"),
    (["--batch-size", "8", "--accumulate", "9"], "--accumulate must be between 1 and 8, got 9"),
    (["--zero", "4"], "invalid choice: 4"),
    (["--optimizer", "lamb"], "invalid choice: 'lamb'"),
    (["--lr-schedule", "linear"], "invalid choice: 'linear'"),
    (["--lr-decay", "0.5"], "--lr-decay-epochs and --lr-decay apply to --lr-schedule step"),
    (["--lr-schedule", "step", "--lr-decay", "1.5"], "--lr-decay must be in (0, 1]"),
    (["--lr-schedule", "step", "--epochs", "3", "--lr-decay-epochs", "3"], "epochs in 1..2"),
    (["--lr-schedule", "step", "--epochs", "1", "--lr-decay-epochs", "1"], "epochs before the last, and --epochs 1 has none"),
    (["--lr-schedule", "step", "--lr-decay-epochs", "a,b"], "not a comma-separated list of epochs"),
    (["--warmup-epochs", "10", "--epochs", "10"], "--warmup-epochs must be at least 0 and less than --epochs (10)"),
    (["--warmup-epochs", "-1"], "--warmup-epochs must be at least 0"),
    (["--momentum", "nan"], "--momentum must be a finite number, got nan"),
])
def test_bad_arguments_exit_2_with_one_line(args, message, capsys):
    if "GPU" == message and __import__("mxnet").context.num_gpus() > 0:
        pytest.skip("this machine has a GPU")
    status = main(["--dataset", "synthetic", "--no-progress", *args])
    err = capsys.readouterr().err.strip()
    assert status == 2
    assert err.startswith("error: ") and message in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("flag", ["--bucket-mb", "--lr", "--clip-norm"])
@pytest.mark.parametrize("value, shown", [("nan", "nan"), ("inf", "inf"), ("0", "0.0"), ("-1", "-1.0"), ("x", "'x'")])
def test_every_bad_value_of_a_positive_flag_is_refused_alike(flag, value, shown, capsys):
    """One style of error for one flag, whichever check refuses the value (the parser's type or the range)."""
    status = main(["--dataset", "synthetic", "--no-progress", f"{flag}={value}"])
    assert status == 2
    assert capsys.readouterr().err == f"error: {flag} must be a finite number > 0, got {shown}\n"


@pytest.mark.parametrize("args, message", [
    (["--wd", "1e40"], "--wd must be 0 or between 1.18e-38 and 3.40e+38"),    # infinite in float32
    (["--wd", "1e-46"], "--wd must be 0 or between 1.18e-38 and 3.40e+38"),   # 0 in float32, but not 0
    (["--lr-schedule", "step", "--lr-decay", "1e-45", "--lr-decay-epochs", "1"], "--lr-decay must be between"),
    (["--lr", "1e-30", "--lr-schedule", "step", "--lr-decay", "1e-5", "--epochs", "4", "--lr-decay-epochs", "1,2"],
     "--lr * --lr-decay**2 (the rate after the last decay) must be between"),
    (["--optimizer", "adam", "--lr", "2e-38"], "--lr * 0.152 (Adam's bias correction at its lowest) must be between"),
    (["--momentum", "1e-40"], "--momentum must be 0 or between"), (["--clip-norm", "1e39"], "--clip-norm must be"),
    (["--compression", "2bit:1e40"], "THRESHOLD > 0 in float32's normal range"),
])
def test_values_mxnets_operators_refuse_exit_2_before_a_step(args, message, easy_dir, capsys):
    """Values the flags' own checks once let through, which crashed inside MXNet's update ("Out of range value
    for wd") with a traceback: refused by the one rule of parallel.validate.check_float32."""
    status = main(["--data-dir", str(easy_dir), "--no-progress", "--epochs", "2", *args])
    err = capsys.readouterr().err.strip()
    assert status == 2
    assert err.startswith("error: ") and message in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("args, message", [
    (["--batch-size", "99999999999999999999999"], "--batch-size 99999999999999999999999 is more than the 256 "
                                                  "examples of the training set: every epoch would be one batch"),
    (["--batch-size", "257"], "--batch-size 257 is more than the 256 examples"),
    (["--epochs", "99999999999999999999999", "--lr-schedule", "cosine"], "--epochs must be <= 9007199254740992"),
    (["--epochs", str(2 ** 53 // 8 + 1), "--batch-size", "32"], f"--epochs {2 ** 53 // 8 + 1} makes 9.01e+15 "
                                                                "optimizer steps (8 an epoch), more than 2**53"),
])
def test_a_run_that_does_not_fit_its_data_exits_2_naming_the_flag(args, message, easy_dir, capsys):
    """A batch larger than the training set trained one batch of all of it an epoch (exit 0); more steps than
    float64 counts exactly failed in the cosine's check of its rates, never naming --epochs."""
    assert_refused(main(["--data-dir", str(easy_dir), "--no-progress", *args]), capsys, message)


@pytest.mark.parametrize("args, message", [
    (["--train-size", "0"], "--train-size must be >= 1, got 0"),
    (["--train-size", "300"], "--train-size 300 is more than the 256 examples of the training set"),
    (["--train-size", "100", "--batch-size", "101"], "--batch-size 101 is more than the 100 examples"),
])
def test_a_train_size_the_data_cannot_give_exits_2(args, message, easy_dir, capsys):
    assert_refused(main(["--data-dir", str(easy_dir), "--no-progress", *args]), capsys, message)


def test_a_train_size_trains_the_first_examples_and_tests_on_the_whole_test_set(easy_dir, tmp_path, capsys):
    """The quickstart's quick run: the first N examples, every test example."""
    metrics = tmp_path / "m.json"
    assert main(["--data-dir", str(easy_dir), "--no-progress", "--train-size", "100", "--batch-size", "50",
                 "--epochs", "1", "--metrics-json", str(metrics)]) == 0
    out = capsys.readouterr().out
    assert ": 100 train / 64 test examples, batch 50," in out.splitlines()[0], out
    assert json.loads(metrics.read_text())[0]["images_per_second"] > 0


def test_the_api_refuses_a_batch_larger_than_the_training_set():
    dataset = easy_dataset(num_train=20, num_test=5)
    strategy = make_strategy("data", init_model("lenet", 0), [mx.cpu(0)])
    with pytest.raises(ValueError, match="^batch_size 21 is more than the 20 examples of the training set"):
        fit(dataset, strategy, 0.1, RunConfig(epochs=1, batch_size=21))


@pytest.mark.parametrize("devices, batch, idle", [("cpu:4", 2, 2), ("cpu:4", 4, 0), ("cpu:1", 1, 0)])
def test_a_batch_smaller_than_the_data_replicas_warns_of_the_idle_ones(devices, batch, idle, easy_dir, capsys):
    """--devices cpu:64 --batch-size 8 left 56 contexts idle without a word. (The run then stops at --epochs,
    too many for float64's step count: the warning comes once the layout is known, before any step.)"""
    status = main(["--data-dir", str(easy_dir), "--no-progress", "--devices", devices, "--batch-size", str(batch),
                   "--epochs", str(2 ** 53)])
    err = capsys.readouterr().err.splitlines()
    assert status == 2 and err[-1].startswith("error: --epochs"), err
    warned = [line for line in err if "stay idle" in line]
    assert len(warned) == (idle > 0) and len(err) == 1 + (idle > 0), err
    if idle:
        assert warned[0] == (f"warning: --batch-size {batch} is split over 4 data replicas (--devices {devices}): "
                             f"{idle} of them get no example and stay idle; give a --batch-size of at least 4, or "
                             "fewer --devices")


@pytest.mark.parametrize("text", ["", " "])
def test_an_empty_list_of_decay_epochs_is_refused(text):
    """--lr-decay-epochs "" once ran a step schedule that never decays (checked without training: check_args)."""
    from parallel.cli import UsageError
    from parallel.train import build_parser, check_args
    args = build_parser().parse_args(["--dataset", "synthetic", "--lr-schedule", "step", "--lr-decay-epochs", text])
    with pytest.raises(UsageError, match=r"^--lr-decay-epochs needs at least one epoch to decay after, such as 5 or "
                                         r"5,8; got an empty list \(for no decay, use --lr-schedule constant\)$"):
        check_args(args)


@pytest.mark.parametrize("epochs, decays, says", [
    (10, [5, 8], None), (4, [2, 3], None),
    (3, [2], "warning: --epochs 3 leaves one decay of the default two (after half and three quarters of the "
             "epochs): after epoch 2; give --lr-decay-epochs to choose"),
    (1, [], "warning: --epochs 1 leaves no epoch to decay after: the rate stays constant"),
])
def test_default_decay_epochs_that_collapse_say_so(epochs, decays, says, capsys):
    """--lr-schedule step's default decays (after half and three quarters of --epochs) fall on one epoch for
    --epochs 3: the run says so in one warning line instead of quietly decaying once."""
    from parallel.train import build_parser, check_args
    args = build_parser().parse_args(["--dataset", "synthetic", "--epochs", str(epochs), "--lr-schedule", "step"])
    check_args(args)
    assert args.lr_decay_epochs == decays
    err = capsys.readouterr().err.strip()
    if says is None:
        assert err == ""
    else:
        assert err.startswith(says) and len(err.splitlines()) == 1, err


def test_unwritable_output_is_refused_before_training(tmp_path, capsys):
    target = tmp_path / "a-dir"
    target.mkdir()
    assert main(["--dataset", "synthetic", "--metrics-json", str(target), "--no-progress"]) == 2
    assert "is a directory" in capsys.readouterr().err
    if os.geteuid() != 0:   # root can write anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        assert main(["--dataset", "synthetic", "--plot", str(locked / "p.png"), "--no-progress"]) == 2


def test_offline_download_names_missing_files_and_directory(tmp_path, capsys):
    target = tmp_path / "fm"
    target.mkdir()   # an empty directory is one to download into
    assert main(["--data-dir", str(target), "--epochs", "1", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: could not download")
    assert "train-images-idx3-ubyte.gz" in err and str(target) in err and "use --dataset synthetic" in err


def test_offline_the_default_directory_is_named_with_how_to_make_it(tmp_path, capsys, monkeypatch):
    """The main command offline named ~/.mxnet/datasets/fashion-mnist as the place for the files, a directory it
    had just removed again: the line says to make it, and names the mirror variable."""
    monkeypatch.setenv("MXNET_HOME", str(tmp_path / "mxnet"))
    assert main(["--epochs", "1", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    target = tmp_path / "mxnet" / "datasets" / "fashion-mnist"
    assert len(err.splitlines()) == 1 and f"put the files there (mkdir -p {target}: the directory made for the " \
        "download is removed again), set PARALLEL_FASHION_MNIST_MIRRORS to a mirror you can reach" in err, err
    assert not (tmp_path / "mxnet").exists()


@pytest.mark.parametrize("kind", ["missing", "file"])
def test_a_data_dir_that_is_not_a_directory_is_refused_not_downloaded_into(tmp_path, capsys, monkeypatch, kind):
    """A mistyped --data-dir tried to download Fashion-MNIST into it (and failed offline, naming the download)."""
    target = tmp_path / "fashoin-mnist"
    if kind == "file":
        target.write_text("")
    monkeypatch.setattr("parallel.data.fashion_mnist.download_fashion_mnist",
                        lambda *args, **kwargs: pytest.fail("downloaded into a --data-dir that is not a directory"))
    assert main(["--data-dir", str(target), "--epochs", "1", "--no-progress"]) == 2
    err = capsys.readouterr().err
    what = "does not exist" if kind == "missing" else "is not a directory"
    assert err.startswith(f"error: --data-dir {str(target)!r} {what}; ") and err.count("\n") == 1, err
    assert target.exists() == (kind == "file")


@pytest.mark.slow
def test_bad_input_in_a_real_process_has_no_traceback(tmp_path):
    for args in (["--devices", "nope"], ["--lr", "nan"], ["--data-dir", str(tmp_path), "--epochs", "1"],
                 ["--strategy", "hybrid", "--devices", "cpu:4", "--stages", "3"]):
        result = run_cli(*args)
        assert result.returncode == 2, (args, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
        assert "Traceback" not in result.stderr


class _RecordingBar:
    """Stands in for tqdm: records, at every update, how many steps had been queued by then."""
    def __init__(self, log, *args, **kwargs):
        self.log, self.n = log, 0

    def update(self, k):
        self.n += k
        self.log["at_update"].append((self.n, self.log["queued"]))

    def close(self):
        pass


def _counting_strategy(log, nan_at=None):
    """A strategy (``parallel.strategies.Strategy``: its abstract members, the protocol's defaults for the rest) that
    counts the steps queued and trains nothing."""
    import mxnet as mx
    from parallel import Layout, Reducer
    from parallel.strategies import Strategy

    class Counting(Strategy):
        ctx_list, layout, reducer = [mx.cpu(0)], Layout(), Reducer()

        def train_step(self, X, y, lr=None, loss=None, optimizer=None, accumulate=1):
            log["queued"] += 1
            value = float("nan") if log["queued"] == nan_at else 1.0
            return mx.nd.array([value * X.shape[0]]), mx.nd.array([X.shape[0]])

        def evaluate(self, data_iter):
            return 0.5

        def groups(self):
            return []

        def describe(self, accumulate=1):
            return "counting"

        def places(self):
            return []
    return Counting()


@pytest.mark.parametrize("nan_at", [None, 1, 5, 9])
def test_progress_counts_finished_batches_and_nan_names_its_batch(monkeypatch, nan_at):
    """The host stays at most IN_FLIGHT steps ahead; the bar moves when a step's loss has been read, and a
    NaN loss stops the run naming exactly its batch (9 batches of 10 examples, the last one of 6)."""
    log = {"queued": 0, "at_update": []}
    monkeypatch.setattr(sys.modules["parallel.fit"], "tqdm", lambda *a, **k: _RecordingBar(log))   # parallel.fit is the function
    dataset = easy_dataset(num_train=86, num_test=10)
    if nan_at is not None:
        with pytest.raises(NonFiniteLossError, match=rf"at epoch 1, batch {nan_at} \(training diverged\)"):
            fit(dataset, _counting_strategy(log, nan_at), 0.1, RunConfig(epochs=1, batch_size=10))
        assert log["queued"] <= nan_at + IN_FLIGHT
        return
    history, _ = fit(dataset, _counting_strategy(log), 0.1, RunConfig(epochs=1, batch_size=10))
    assert [n for n, _ in log["at_update"]] == list(range(1, 10))
    assert all(queued - n <= IN_FLIGHT for n, queued in log["at_update"])
    assert log["at_update"][0] == (1, 1 + IN_FLIGHT)     # batch 1 is read once batch 3 is queued
    assert history[0]["train_loss"] == pytest.approx(1.0) and history[0]["train_acc"] == pytest.approx(1.0)


@pytest.mark.slow
@pytest.mark.parametrize("delay", [0.2, 0.4, 0.6, 0.9, 1.5, 4.0])
def test_ctrl_c_at_any_moment_exits_130_with_one_line(delay):
    """Ctrl-C while MXNet is imported (the first second), while the data is made, or while training:
    one line and status 130, never a traceback."""
    import signal
    import time
    process = start_process([sys.executable, "-m", "parallel.train", "--dataset", "synthetic", "--epochs", "1",
                             "--no-progress"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(delay)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=120)
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert process.returncode == 130 and len(lines) == 1, (process.returncode, err)
    # before training: at once; during training: at the next batch boundary, with nothing to resume from
    assert lines[0] == "error: interrupted" or (
        lines[0].startswith("stopped at epoch 1 after ") and "no --checkpoint-dir" in lines[0]), err


def test_help_and_argument_errors_do_not_load_mxnet():
    """--help and bad arguments answer before MXNet is imported (it takes about a second to load)."""
    code = ("import sys; from parallel.train import main\n"
            "for argv in (['--epochs', '0'], ['--lr', '1e-40'], ['--seed', '-1'], ['--plot', '']):\n"
            "    assert main(argv) == 2\n"
            "try:\n    main(['--help'])\nexcept SystemExit as e:\n    assert e.code == 0\n"
            "assert 'mxnet' not in sys.modules, 'mxnet was imported'\n")
    result = run_process([sys.executable, "-c", code], timeout=60)
    assert result.returncode == 0, result.stderr


@pytest.mark.slow
def test_any_seed_up_to_2_to_the_32_trains(data_dir, capsys):
    """Seeds from 42950 up overflowed numpy's range after training had started (seed * 100003 + epoch)."""
    for seed in ("42950", "4294967295"):
        assert main(["--devices", "cpu:1", "--epochs", "2", "--batch-size", "500", "--seed", seed,
                     "--data-dir", str(data_dir), "--no-progress"]) == 0, capsys.readouterr().err


@pytest.mark.slow
def test_plot_is_written_in_the_format_its_suffix_names(data_dir, tmp_path):
    magic = {"curves.jpg": b"\xff\xd8", "curves.pdf": b"%PDF", "curves.svg": b"<?xml", "curves.png": b"\x89PNG"}
    for name in magic:
        assert main(["--devices", "cpu:1", "--epochs", "1", "--batch-size", "500", "--data-dir", str(data_dir),
                     "--plot", str(tmp_path / name), "--no-progress"]) == 0
    for name, head in magic.items():
        assert (tmp_path / name).read_bytes().startswith(head), name


def test_header_names_the_data_it_trains_on(easy_dir, capsys):
    assert main(["--devices", "cpu:1", "--epochs", "1", "--batch-size", "256", "--data-dir", str(easy_dir),
                 "--no-progress"]) == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert header.startswith(f"training LeNet on the MNIST-format files in {easy_dir}: 256 train / 64 test")
    assert "fashion-mnist" not in header


def test_a_strategy_that_leaves_contexts_idle_says_so(easy_dir, capsys):
    assert main(["--devices", "cpu:4", "--strategy", "model", "--epochs", "1", "--batch-size", "256",
                 "--data-dir", str(easy_dir), "--no-progress"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["warning: --strategy model uses 2 of the 4 contexts of --devices cpu:4 (one per stage); "
                   "cpu(2), cpu(3) stay idle"]


def test_a_bug_is_not_disguised_as_a_user_error(easy_dir, monkeypatch):
    """A ValueError from the package's own code propagates (traceback, status 1), not 'error:' and 2."""
    def broken_fit(*args, **kwargs):
        raise ValueError("an internal invariant failed")

    monkeypatch.setattr("parallel.train_steps.fit", broken_fit)
    with pytest.raises(ValueError, match="an internal invariant failed"):
        main(["--devices", "cpu:1", "--epochs", "1", "--data-dir", str(easy_dir), "--no-progress"])


@pytest.mark.slow
def test_a_bug_in_a_real_process_shows_its_traceback_and_exits_1(data_dir, tmp_path):
    """The same in a real process: a bug planted through sitecustomize must not come out as exit 2."""
    (tmp_path / "sitecustomize.py").write_text(
        "import parallel.train_steps as t\n"
        "def fit(*a, **k):\n    raise ValueError('an internal invariant failed')\n"
        "t.fit = fit\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    result = run_process([sys.executable, "-m", "parallel.train", "--devices", "cpu:1", "--epochs", "1",
                             "--data-dir", str(data_dir), "--no-progress"], timeout=300, env=env)
    assert result.returncode == 1 and "Traceback" in result.stderr, result.stderr
    assert "ValueError: an internal invariant failed" in result.stderr


def test_fit_takes_a_built_strategy_and_a_run_configuration():
    """The names become objects in make_strategy alone: fit refuses anything else, naming the argument (before,
    fit(..., strategy=obj) silently ignored its ctx_list, algorithm, stages and model)."""
    from parallel import RunConfig, fit, init_model, make_strategy
    data = easy_dataset(num_train=20, num_test=10)
    with pytest.raises(ValueError, match="ctx_list is empty"):
        make_strategy("data", init_model("lenet"), [])
    with pytest.raises(TypeError, match="strategy must be a built strategy") as raised:
        fit(data, "data", 0.1, RunConfig(epochs=1, batch_size=10))
    assert raised.value.argument == "strategy"
    strategy = make_strategy("data", init_model("lenet"), [mx.cpu(0)])
    with pytest.raises(TypeError, match="config must be a parallel.RunConfig") as raised:
        fit(data, strategy, 0.1, {"epochs": 1, "batch_size": 10})
    assert raised.value.argument == "config"
    with pytest.raises(ValueError, match="batch_size must be >= 1") as raised:
        RunConfig(epochs=1, batch_size=0)
    assert raised.value.argument == "batch_size"
    with pytest.raises(ValueError, match="algorithm must be one of") as raised:
        make_strategy("data", init_model("lenet"), [mx.cpu(0)], reducer="no-such-algorithm")
    assert raised.value.argument == "algorithm"


# The layouts that hung at their first batch with the CLI's default threads (every core per operator): two
# contexts ran OpenBLAS's dot at the same time. One fresh process runs them all, as a user would, with
# OMP_NUM_THREADS unset so that the command sets it; a hang fails the test at its timeout.
LAYOUTS_AT_DEFAULT_THREADS = [
    ["--devices", "cpu:4", "--strategy", "data"],
    ["--devices", "cpu:4", "--strategy", "model"],
    ["--devices", "cpu:4", "--strategy", "pipeline"],
    ["--devices", "cpu:4", "--strategy", "hybrid"],
    ["--devices", "cpu:4", "--strategy", "hybrid", "--stages", "2"],
    ["--devices", "cpu:6", "--strategy", "hybrid", "--stages", "3"],
    ["--devices", "cpu:4", "--strategy", "hybrid", "--boundaries", "2"],
]


@pytest.mark.slow   # seconds the fast tier's 150 s budget cannot spare (docs/testing.md)
def test_every_strategy_on_four_contexts_at_the_clis_default_threads(tmp_path):
    from parallel.data import FILES as files
    small = easy_dataset(num_train=300, num_test=60, seed=3)
    for role, name in files.items():
        write_idx(tmp_path / name, getattr(small, role))
    code = ("import json, os, sys\n"
            "from parallel.train import main\n"
            f"layouts = {LAYOUTS_AT_DEFAULT_THREADS!r}\n"
            "common = ['--data-dir', sys.argv[1], '--epochs', '1', '--batch-size', '64', '--lr', '0.1',\n"
            "          '--seed', '0', '--no-progress']\n"
            "statuses = [main(layout + common) for layout in layouts]\n"
            "print(json.dumps({'statuses': statuses, 'threads': os.environ['OMP_NUM_THREADS']}))\n")
    env = {name: value for name, value in os.environ.items() if name != "OMP_NUM_THREADS"}
    result = run_process([sys.executable, "-c", code, str(tmp_path)], timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    cores = len(os.sched_getaffinity(0))
    assert report == {"statuses": [0] * len(LAYOUTS_AT_DEFAULT_THREADS), "threads": str(cores)}, result
    assert result.stdout.count("epoch 1, loss ") == len(LAYOUTS_AT_DEFAULT_THREADS)


def test_outputs_are_written_through_symbolic_links(easy_dir, tmp_path):
    target = tmp_path / "metrics" / "m.json"
    target.parent.mkdir()
    target.write_text("old")
    (tmp_path / "link.json").symlink_to(target)
    assert main(["--devices", "cpu:1", "--epochs", "1", "--batch-size", "256", "--data-dir", str(easy_dir),
                 "--metrics-json", str(tmp_path / "link.json"), "--no-progress"]) == 0
    assert (tmp_path / "link.json").is_symlink() and [m["epoch"] for m in json.loads(target.read_text())] == [1]


def test_a_one_epoch_plot_has_one_tick_at_its_epoch():
    from parallel.report import plot_metrics
    fig = plot_metrics([{"epoch": 1, "train_loss": 2.3, "train_acc": 0.1, "test_acc": 0.1}])
    for ax in fig.axes:
        assert ax.get_xlim() == (0.5, 1.5) and list(ax.get_xticks()) == [1]


def test_running_the_file_instead_of_the_module_says_how(tmp_path):
    from conftest import ROOT
    result = run_process([sys.executable, os.path.join(ROOT, "parallel", "train.py"), "--help"], timeout=60,
                         cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip() == ("error: run the command as a module, from the directory that holds parallel/: "
                                     "python -m parallel.train ...")


def test_data_errors_give_their_advice_in_the_commands_terms(tmp_path, capsys):
    """The library says 'use the synthetic dataset' and 'data_dir=None'; the command names its flags."""
    from parallel.data import FILES as files
    small = easy_dataset(num_train=20, num_test=10)
    for role in ("train_images", "train_labels", "test_images"):   # another dataset, one file missing
        write_idx(tmp_path / files[role], getattr(small, role))
    assert main(["--devices", "cpu:1", "--epochs", "1", "--data-dir", str(tmp_path), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert "without --data-dir" in err and "data_dir=None" not in err and len(err.splitlines()) == 1, err


#: Every optimizer the CLI offers, with a schedule, clipping, accumulation and each ZeRO stage, on the strategies that
#: take them.
OPTIMIZER_RUNS = {
    # lr 0.05: at 0.1 (with momentum 0.9, a step of 1.0) LeNet left its plateau in epoch 3 on an AMD EPYC and fell
    # back to chance for good; 0.05 learns the set within 4 epochs there
    "momentum": ["--momentum", "0.9", "--wd", "1e-4", "--lr", "0.05"],
    "nesterov-cosine-warmup": ["--momentum", "0.9", "--nesterov", "--lr-schedule", "cosine", "--warmup-epochs",
                               "0.5", "--lr", "0.2"],
    "step-clip-zero1": ["--momentum", "0.9", "--lr-schedule", "step", "--clip-norm", "1", "--zero", "1", "--lr",
                        "0.1"],
    "adam-zero2-accumulate": ["--optimizer", "adam", "--zero", "2", "--allreduce", "ring", "--accumulate", "3"],
    "adamw-hybrid-zero2": ["--optimizer", "adamw", "--lr", "0.003", "--strategy", "hybrid", "--devices", "cpu:4",
                           "--zero", "2"],
    "adam-pipeline": ["--optimizer", "adam", "--strategy", "pipeline", "--lr", "0.003"],
}


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory):
    return write_idx_files(tmp_path_factory.mktemp("small"), easy_dataset(num_train=640, num_test=100, seed=1))


def _optimizer_run(name, directory, epochs, capsys):
    """Run the configuration ``name``; check the header names its optimizer and sharding; return the test accuracies."""
    args = OPTIMIZER_RUNS[name]
    devices = [] if "--devices" in args else ["--devices", "cpu:2"]
    status = main(["--data-dir", str(directory), "--epochs", str(epochs), "--batch-size", "16", "--seed", "1",
                   "--no-progress", *devices, *args])
    out = capsys.readouterr().out
    assert status == 0, out
    header = [line for line in out.splitlines() if line.startswith("optimizer ")]
    assert len(header) == 1, out   # the header says which optimizer and sharding run
    optimizer = args[args.index("--optimizer") + 1] if "--optimizer" in args else "sgd"
    assert header[0].startswith(f"optimizer {optimizer}")
    zero = args[args.index("--zero") + 1] if "--zero" in args else "0"
    assert (f"ZeRO-{zero}" in header[0]) == (zero != "0")
    epochs_run = [line for line in out.splitlines() if line.startswith("epoch ")]
    assert len(epochs_run) == epochs and all(math.isfinite(float(l.split("loss ")[1].split(",")[0]))
                                             for l in epochs_run)
    return [float(line.split("test acc ")[1].split(",")[0]) for line in epochs_run]


@pytest.mark.slow   # every configuration trains a few epochs: the fast tier checks each optimizer in process
@pytest.mark.parametrize("name", sorted(OPTIMIZER_RUNS))
def test_every_optimizer_configuration_learns_from_the_cli(name, small_dir, data_dir, capsys):
    """Past half the test set right (chance is 0.1): Adam leaves LeNet's initial plateau within two short epochs;
    SGD needs more steps, six epochs of the larger set."""
    adam = "adam" in name
    assert _optimizer_run(name, *((small_dir, 2) if adam else (data_dir, 6)), capsys)[-1] > 0.5


@pytest.mark.parametrize("devices, warned", [("cpu:1", True), ("cpu:2", False)])
def test_compression_with_nothing_to_send_says_so(devices, warned, small_dir, capsys):
    """One context in one process sends no gradient: --compression fp16 there is a warning line, and the run
    still trains."""
    status = main(["--data-dir", str(small_dir), "--epochs", "1", "--batch-size", "64", "--no-progress",
                   "--devices", devices, "--compression", "fp16"])
    captured = capsys.readouterr()
    assert status == 0 and len([l for l in captured.out.splitlines() if l.startswith("epoch ")]) == 1
    lines = [line for line in captured.err.splitlines() if "compresses nothing" in line]
    assert lines == (["warning: --compression fp16 compresses nothing here: one context in one process sends no "
                      "gradient; it applies between several --devices or the workers of a job"] if warned else [])


def test_plain_sgd_prints_no_optimizer_line(easy_dir, capsys):
    assert main(["--data-dir", str(easy_dir), "--epochs", "1", "--no-progress"]) == 0
    assert not [line for line in capsys.readouterr().out.splitlines() if line.startswith("optimizer")]


#: Input the command refuses through the package's own checks: the error names the flag, never the API's name.
_API_NAMES = ("ctx_list", "micro_batches", "batch_size", "bucket_mb", "clip_norm", "algorithm", "zero=", "strategy=",
              "momentum=", "device spec", "stages=", "boundaries=")


@pytest.mark.parametrize("argv, flag", [
    ("--devices cpu:3 --strategy hybrid --stages 2", "--devices"), ("--devices cpu:1 --strategy model", "--devices"),
    ("--zero 3 --compression fp16", "--zero 3"), ("--strategy model --boundaries 9 --devices cpu:2", "--boundaries"),
    ("--strategy model --stages 9 --devices cpu:2", "--stages 9"), ("--nesterov", "--momentum 0.9"),
    ("--strategy data --stages 2", "--strategy"), ("--devices cpu:0", "--devices"),
    ("--batch-size 1 --strategy pipeline --devices cpu:2", "--batch-size"), ("--bucket-mb -1", "--bucket-mb"),
    ("--stages 2 --boundaries 1 --strategy model", "--boundaries"), ("--momentum 0.9 --optimizer adam", "--momentum"),
])
def test_every_refusal_names_its_flag_and_no_api_name(argv, flag, capsys):
    """The package's errors carry their arguments as data (parallel.validate.BadValue): the CLI renders them with
    its flags, so the line names no argument the user cannot type."""
    assert main(argv.split() + ["--dataset", "synthetic", "--epochs", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and len(err.splitlines()) == 1, err
    assert flag in err and not any(name in err for name in _API_NAMES), err


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_finite_parameters_finds_one_non_finite_element_on_any_worker(value):
    """One element of one replica (of one worker of a job) is enough; a finite model passes."""
    from parallel.fit import finite_parameters
    from conftest import in_threads, lenet_strategy
    strategy = lenet_strategy([mx.cpu(0), mx.cpu(1)])
    assert finite_parameters(strategy)
    strategy.groups()[0][1][0][0, 0, 0, 0] = value   # replica 1, LeNet's conv1 weight
    assert not finite_parameters(strategy)

    def work(job, rank):
        from parallel import Reducer
        worker = lenet_strategy([mx.cpu(rank)], reducer=Reducer(job=job))
        if rank == 1:
            worker.groups()[0][0][0][0, 0, 0, 0] = value
        return finite_parameters(worker)
    assert in_threads(2, work)[0] == [False, False]   # every worker gets the same answer


@pytest.mark.parametrize("layout", [{}, {"zero": 3}, {"name": "pipeline", "stages": 2}])
def test_parameters_that_became_infinite_stop_the_run_though_the_loss_stays_finite(layout):
    """--lr 1e30 makes LeNet's weights infinite while its loss stays finite (its sigmoids saturate): the run ends
    as a non-finite loss ends it, naming the rate, before any checkpoint or export could take the model."""
    from parallel.optim import SGD
    from conftest import lenet_strategy
    snapshots = []
    with pytest.raises(NonFiniteLossError, match=r"^lr is too large: the parameters became NaN or infinite by "
                                                 r"epoch 1, batch \d+ \(training diverged\); lower it$"):
        fit(easy_dataset(num_train=60, num_test=10), lenet_strategy([mx.cpu(0), mx.cpu(1)], **layout),
            SGD(1e30, zero=layout.get("zero", 0)), RunConfig(epochs=2, batch_size=10, checkpoint_every=2),
            on_checkpoint=snapshots.append)
    assert snapshots == []


def _readme_rows():
    """README.md's flag rows: the first cell's flag, the row's cells without backticks, spaces collapsed."""
    rows = {}
    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")) as f:
        for line in f:
            found = re.match(r"^\| `(--[a-z0-9-]+)", line)
            if found:
                cells = [" ".join(cell.replace("`", "").split()) for cell in line.strip().strip("|").split(" | ")]
                rows.setdefault(found.group(1), cells)
    return rows


def _helps():
    """Each flag of the command and its --help text, spaces collapsed."""
    from parallel.train import build_parser
    return {action.option_strings[-1]: " ".join((action.help or "").split()) for action in build_parser().options}


@pytest.mark.parametrize("flag", sorted(SCOPES))
def test_a_scoped_flag_says_where_it_applies_and_is_refused_elsewhere(flag, monkeypatch):
    """parallel.train.SCOPES, the one place that says where each flag applies: its --help text and its README row
    say it in the same words, a run that gives it where it does nothing is refused with one line naming it, and
    a run where it applies is not. (`--strategy model --schedule 1f1b` was silently ignored, and `--strategy model
    --virtual-stages 2 --schedule 1f1b` sent the user round a circle of advice.)"""
    from parallel.train import build_parser, check_args
    monkeypatch.delenv("PARALLEL_ELASTIC", raising=False)
    scope = SCOPES[flag]
    assert scope.where in _helps()[flag], _helps()[flag]
    assert scope.where in " | ".join(_readme_rows()[flag]), _readme_rows()[flag]
    with pytest.raises(UsageError) as refused:
        args = build_parser().parse_args(scope.out.split())
        check_args(args)
    assert flag in str(refused.value) and "\n" not in str(refused.value), str(refused.value)
    if scope.within is not None:
        check_args(build_parser().parse_args(scope.within.split()))


def test_what_the_readme_and_help_say_a_flag_does_not_go_with_is_refused():
    """The README said --expert-parallel works "not with --zero 3", --help said "with --zero 3", and the run
    worked: every "not with --X V" a flag's README row or --help text says is a combination the checks refuse."""
    from parallel.train import build_parser, check_args
    texts = [(flag, " | ".join(cells)) for flag, cells in _readme_rows().items()] + list(_helps().items())
    said = {(flag, found) for flag, text in texts
            for found in re.findall(r"not with (--[a-z-]+(?: [0-9a-z]+)?)", text)}
    assert said == {("--compression", "--zero 3")}, said   # the one there is: each new one needs an example here
    examples = {("--compression", "--zero 3"): "--compression fp16 --zero 3"}
    for (flag, other), argv in examples.items():
        with pytest.raises(UsageError, match=re.escape(flag)):
            check_args(build_parser().parse_args(argv.split()))


def test_the_readme_gives_each_flag_the_default_argparse_has():
    """A flag whose default is a value (not None, not a switch) shows that value in its README row's default
    column; the others (None: the run decides, e.g. 0.2 for sgd) say it in words there and in --help."""
    from parallel.train import build_parser
    cells = {flag: row[1] for flag, row in _readme_rows().items()}   # the default column
    checked = []
    for action in build_parser().options:
        default = action.default
        if default is None or isinstance(default, bool) or action.option_strings[-1] == "--help":
            continue
        flag = action.option_strings[-1]
        want = f"{default:g}" if isinstance(default, float) else str(default)
        assert cells[flag] == want, (flag, cells[flag], want)
        checked.append(flag)
    assert len(checked) >= 25, checked
