"""--checkpoint-dir, --resume, --export and clean interruption through the CLI (signals in real processes)."""
import json
import os
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import time

import mxnet as mx
import numpy as np
import pytest
from mxnet import gluon

from parallel import checkpoint as ckpt
from parallel.models import lenet
from parallel.train import main
from conftest import easy_dataset, run_process, start_process, write_idx_files


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    # 30 batches of 10 per epoch
    return write_idx_files(tmp_path_factory.mktemp("idx"), easy_dataset(num_train=300, num_test=60, seed=6))


def _args(data_dir, *extra):
    return ["--data-dir", str(data_dir), "--batch-size", "10", "--lr", "0.1", "--seed", "3", "--no-progress",
            *extra]


def _params(directory):
    return [p.asnumpy() for p in ckpt.load_checkpoint(directory).params]


def _without_timings(history):
    """The metrics of the computation: not the timings, nor the memory (and pipeline) a run measures for the epochs
    it trained."""
    return [{k: v for k, v in m.items() if k not in ("seconds", "images_per_second", "memory", "pipeline")}
            for m in history]


def _snapshot(directory):
    return {name: (directory / name).read_bytes() for name in sorted(os.listdir(directory))}


STRATEGY_ARGS = {
    "data-naive": ["--devices", "cpu:2", "--allreduce", "naive"],
    "data-ring": ["--devices", "cpu:3", "--allreduce", "ring"],
    "model": ["--devices", "cpu:2", "--strategy", "model"],
    "pipeline": ["--devices", "cpu:2", "--strategy", "pipeline", "--micro-batches", "3"],
    "hybrid-tree": ["--devices", "cpu:4", "--strategy", "hybrid", "--allreduce", "tree"],
    # optimizers with state: it is saved, resumed, and re-sharded
    "momentum-zero1": ["--devices", "cpu:2", "--momentum", "0.9", "--wd", "1e-4", "--zero", "1"],
    "adam-hybrid-zero2-accumulate": ["--devices", "cpu:4", "--strategy", "hybrid", "--optimizer", "adam", "--lr",
                                     "0.003", "--zero", "2", "--accumulate", "2", "--clip-norm", "1"],
    "nesterov-model-warmup": ["--devices", "cpu:2", "--strategy", "model", "--momentum", "0.9", "--nesterov",
                              "--warmup-epochs", "0.5"],
    # ZeRO-3: the parameters and the state sharded, gathered into the checkpoint and sharded again
    "adam-zero3-clip": ["--devices", "cpu:3", "--optimizer", "adam", "--lr", "0.003", "--zero", "3", "--clip-norm",
                        "1"],
}


# The slow tier: the CLI's resume runs in the fast tier through test_vit.py's and test_compress_checkpoint.py's, and
# that every layout resumes bitwise is test_checkpoint.py's claim.
@pytest.mark.slow
@pytest.mark.parametrize("layout", STRATEGY_ARGS)
def test_resume_with_more_epochs_is_bitwise_the_longer_run(layout, data_dir, tmp_path, capsys):
    """1 epoch, then --resume --epochs 2: the same parameters and metrics as 2 epochs at once; --export writes
    what the checkpoint holds, and SymbolBlock.imports predicts what the from-scratch lenet predicts."""
    layout_args = STRATEGY_ARGS[layout]
    once, twice = tmp_path / "once", tmp_path / "twice"
    assert main(_args(data_dir, *layout_args, "--epochs", "2", "--checkpoint-dir", str(once),
                      "--metrics-json", str(tmp_path / "once.json"))) == 0
    assert main(_args(data_dir, *layout_args, "--epochs", "1", "--checkpoint-dir", str(twice),
                      "--metrics-json", str(tmp_path / "twice.json"))) == 0
    assert ckpt.load_checkpoint(twice).state.epoch == 2
    assert main(_args(data_dir, *layout_args, "--epochs", "2", "--checkpoint-dir", str(twice), "--resume",
                      "--metrics-json", str(tmp_path / "twice.json"), "--export", str(tmp_path / "lenet"))) == 0
    assert "resuming from" in capsys.readouterr().out
    for got, want in zip(_params(twice), _params(once)):
        np.testing.assert_array_equal(got, want)
    history = json.loads((tmp_path / "twice.json").read_text())
    assert [m["epoch"] for m in history] == [1, 2]
    assert _without_timings(history) == _without_timings(json.loads((tmp_path / "once.json").read_text()))
    net = gluon.SymbolBlock.imports(str(tmp_path / "lenet-symbol.json"), ["data"],
                                    str(tmp_path / "lenet-0000.params"), ctx=mx.cpu(1))
    X = mx.nd.random.uniform(shape=(6, 1, 28, 28), ctx=mx.cpu(1))
    want = lenet(X, [mx.nd.array(p, ctx=mx.cpu(1)) for p in _params(twice)])
    np.testing.assert_allclose(net(X).asnumpy(), want.asnumpy(), rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def _trained_one_epoch(data_dir, tmp_path_factory):
    directory = tmp_path_factory.mktemp("one-epoch") / "ckpt"
    assert main(_args(data_dir, "--devices", "cpu:2", "--epochs", "1", "--checkpoint-dir", str(directory))) == 0
    return directory


@pytest.fixture
def one_epoch(_trained_one_epoch, tmp_path):
    """A checkpoint directory of one epoch on two contexts, the test's own copy (a test may damage it): trained once
    for the module."""
    return shutil.copytree(_trained_one_epoch, tmp_path / "ckpt")


@pytest.mark.parametrize("change, message", [
    (["--lr", "0.5"], "trained with lr 0.1, this run asks for 0.5"),
    (["--batch-size", "20"], "trained with batch_size 10, this run asks for 20"),
    (["--seed", "4"], "trained with seed 3, this run asks for 4"),
    (["--epochs", "0"], "--epochs must be >= 1"),
    (["--momentum", "0.9"], "trained with optimizer sgd(lr=0.1), this run asks for sgd(lr=0.1, momentum=0.9)"),
    (["--optimizer", "adam", "--lr", "0.1"], "this run asks for adam("),
    (["--lr", "0.5", "--seed", "4"], "; resume with the same --lr,"),   # the advice names the flag
    (["--clip-norm", "1"], "clip_norm=1.0)"),
])
def test_resume_refuses_a_change_of_computation(one_epoch, data_dir, change, message, capsys):
    before = _snapshot(one_epoch)
    status = main(_args(data_dir, "--devices", "cpu:2", "--epochs", "2", "--checkpoint-dir", str(one_epoch),
                        "--resume", *change))
    err = capsys.readouterr().err.strip()
    assert status == 2 and err.startswith("error: ") and message in err and len(err.splitlines()) == 1, err
    assert _snapshot(one_epoch) == before


def test_resuming_with_another_optimizer_names_the_optimizer_not_its_default_lr(data_dir, tmp_path, capsys):
    """A momentum-SGD checkpoint (its default lr 0.2) resumed with --optimizer adam (whose default lr is 0.001):
    the change is the optimizer, named as the flag the user typed."""
    common = ["--data-dir", str(data_dir), "--batch-size", "10", "--no-progress", "--devices", "cpu:1",
              "--checkpoint-dir", str(tmp_path / "ckpt")]
    assert main(common + ["--epochs", "1", "--momentum", "0.9"]) == 0
    capsys.readouterr()
    assert main(common + ["--epochs", "2", "--resume", "--optimizer", "adam"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: the checkpoint was trained with optimizer sgd(lr=0.2, momentum=0.9), this run asks "
                          "for adam(lr=0.001") and len(err.splitlines()) == 1, err
    assert "resume with the same --optimizer," in err and "same lr" not in err, err


def test_resume_refuses_another_dataset(one_epoch, data_dir, tmp_path, capsys):
    other = tmp_path / "other"
    other.mkdir()
    write_idx_files(other, easy_dataset(num_train=300, num_test=60, seed=7))
    before = _snapshot(one_epoch)
    assert main(_args(other, "--devices", "cpu:2", "--epochs", "2", "--checkpoint-dir", str(one_epoch),
                      "--resume")) == 2
    err = capsys.readouterr().err.strip()
    # named as what they are: other MNIST-format files than Fashion-MNIST, in their directories
    assert (f"trained with dataset the MNIST-format files in {data_dir} (" in err
            and f"asks for the MNIST-format files in {other} (" in err and len(err.splitlines()) == 1), err
    assert _snapshot(one_epoch) == before


@pytest.mark.parametrize("args, message", [
    (["--epochs", "2"], "already holds a checkpoint; add --resume"),              # would overwrite it
    (["--epochs", "1", "--resume"], None),                                       # finished: nothing to train
])
def test_an_existing_checkpoint_is_never_overwritten_by_a_new_run(one_epoch, data_dir, args, message, capsys):
    before = _snapshot(one_epoch)
    status = main(_args(data_dir, "--devices", "cpu:2", "--checkpoint-dir", str(one_epoch), *args))
    out, err = capsys.readouterr()
    if message is None:
        assert status == 0, err
        assert "has finished all 1 epochs; nothing to train" in out
        assert _snapshot(one_epoch) == before
    else:
        assert status == 2 and message in err, err
        assert _snapshot(one_epoch) == before


def test_resume_errors(data_dir, tmp_path, capsys):
    for args, message in ((["--resume"], "--resume needs --checkpoint-dir"),
                          (["--resume", "--checkpoint-dir", str(tmp_path / "none")], "no checkpoint"),
                          (["--checkpoint-dir", ""], "--checkpoint-dir needs a path"),
                          (["--export", ""], "--export needs a path"),
                          (["--export", str(tmp_path / "missing" / "lenet")], "does not exist")):
        assert main(_args(data_dir, "--epochs", "1", *args)) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err


def test_resume_refuses_fewer_epochs_than_finished(data_dir, tmp_path, capsys):
    directory = tmp_path / "c"
    assert main(_args(data_dir, "--devices", "cpu:1", "--epochs", "2", "--checkpoint-dir", str(directory))) == 0
    before = _snapshot(directory)
    assert main(_args(data_dir, "--devices", "cpu:1", "--epochs", "1", "--checkpoint-dir", str(directory),
                      "--resume")) == 2
    assert "--epochs 1 is fewer than the 2 epochs" in capsys.readouterr().err
    assert _snapshot(directory) == before


def _start(data_dir, cwd, *extra, preexec_fn=None):
    command = [sys.executable, "-m", "parallel.train", *_args(data_dir, "--devices", "cpu:2", *extra)]
    return start_process(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=preexec_fn)


def _wait_for_epoch_line(process):
    for line in process.stdout:
        if line.startswith("epoch 1,"):
            return
    raise AssertionError("the run ended before its first epoch: " + process.stderr.read())


@pytest.mark.slow
@pytest.mark.parametrize("sig, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_stops_at_a_batch_boundary_and_the_resume_command_finishes_the_run(data_dir, tmp_path, sig,
                                                                                     status):
    """Signalled mid-run: one line with the exact command to resume, status 130/143; that command finishes
    the run with parameters and metrics bitwise those of the run never interrupted."""
    # 4 epochs: the signal, sent at epoch 1's line, arrives with 3 epochs (90 batches) still to run
    common = ("--epochs", "4", "--checkpoint-dir", "ckpt", "--metrics-json", "m.json", "--plot", "p.png")
    straight = tmp_path / "straight"
    straight.mkdir()
    assert _start(data_dir, straight, *common).wait(timeout=300) == 0
    stopped = tmp_path / "stopped"
    stopped.mkdir()
    process = _start(data_dir, stopped, *common)
    _wait_for_epoch_line(process)
    process.send_signal(sig)
    _, err = process.communicate(timeout=120)
    lines = err.strip().splitlines()
    assert process.returncode == status and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("stopped at epoch ") and "Resume with: python -m parallel.train " in lines[0]
    state = ckpt.load_checkpoint(stopped / "ckpt").state
    assert state.epoch < 4 or state.batch < 30, "the signal arrived after the run had finished"
    assert [m["epoch"] for m in json.loads((stopped / "m.json").read_text())] == list(range(1, state.epoch))
    command = shlex.split(lines[0].split("Resume with: ")[1])
    assert command[:3] == ["python", "-m", "parallel.train"] and command[-1] == "--resume"
    resumed = run_process([sys.executable, *command[1:]], cwd=stopped, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    for got, want in zip(_params(stopped / "ckpt"), _params(straight / "ckpt")):
        np.testing.assert_array_equal(got, want)
    history = json.loads((stopped / "m.json").read_text())
    assert [m["epoch"] for m in history] == list(range(1, 5))
    assert _without_timings(history) == _without_timings(json.loads((straight / "m.json").read_text()))


@pytest.mark.slow
def test_a_second_ctrl_c_exits_at_once_keeping_the_last_checkpoint(data_dir, tmp_path):
    process = _start(data_dir, tmp_path, "--epochs", "50", "--checkpoint-dir", "ckpt")
    _wait_for_epoch_line(process)   # printed just before epoch 1's checkpoint is written: wait for that too
    deadline = time.monotonic() + 60
    while not (tmp_path / "ckpt" / "checkpoint.json").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    process.send_signal(signal.SIGINT)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=120)
    lines = err.strip().splitlines()
    assert process.returncode == 130 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0] == "error: interrupted" or lines[0].startswith("stopped at epoch"), err
    assert ckpt.load_checkpoint(tmp_path / "ckpt").state.epoch >= 2   # the last complete checkpoint loads
    # nothing half-written, and no lock file: the directory is free for the next run
    assert not [name for name in os.listdir(tmp_path / "ckpt") if name.endswith(".tmp") or name == ".lock"]


def _limit_file_size():
    resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))   # a parameter file is ~516 KB


@pytest.mark.slow
def test_a_failed_checkpoint_write_ends_the_run_and_keeps_the_previous_checkpoint(data_dir, tmp_path):
    assert main(_args(data_dir, "--devices", "cpu:2", "--epochs", "1", "--checkpoint-dir",
                      str(tmp_path / "ckpt"))) == 0
    before = _snapshot(tmp_path / "ckpt")
    process = _start(data_dir, tmp_path, "--epochs", "2", "--checkpoint-dir", "ckpt", "--resume",
                     preexec_fn=_limit_file_size)
    _, err = process.communicate(timeout=300)
    lines = err.strip().splitlines()
    assert process.returncode == 2 and len(lines) == 1, err
    assert lines[0].startswith("error: cannot write the checkpoint in 'ckpt'") and "intact" in lines[0], err
    assert _snapshot(tmp_path / "ckpt") == before
    assert ckpt.load_checkpoint(tmp_path / "ckpt").state.epoch == 2


def test_a_diverging_run_leaves_no_checkpoint(data_dir, tmp_path, capsys):
    assert main(_args(data_dir, "--devices", "cpu:2", "--epochs", "2", "--lr", "1e10", "--checkpoint-dir",
                      str(tmp_path / "ckpt"))) == 2
    assert "loss became" in capsys.readouterr().err
    assert not ckpt.has_checkpoint(tmp_path / "ckpt")


@pytest.mark.parametrize("damage", ["truncated manifest", "foreign file", "other version", "corrupt params"])
def test_a_damaged_checkpoint_exits_2_with_one_line_and_nothing_overwritten(one_epoch, data_dir, damage, capsys):
    manifest_path = one_epoch / ckpt.MANIFEST
    manifest = json.loads(manifest_path.read_text())
    if damage == "truncated manifest":
        manifest_path.write_text(manifest_path.read_text()[:100])
    elif damage == "foreign file":
        manifest_path.write_text('{"model": "resnet", "weights": "w.bin"}')
    elif damage == "other version":
        manifest_path.write_text(json.dumps({**manifest, "version": ckpt.VERSION + 1}))
    else:
        params = one_epoch / manifest["params_file"]
        params.write_bytes(params.read_bytes()[:-8] + b"\0" * 8)
    before = _snapshot(one_epoch)
    assert main(_args(data_dir, "--devices", "cpu:2", "--epochs", "2", "--checkpoint-dir", str(one_epoch),
                      "--resume", "--metrics-json", str(one_epoch / "m.json"))) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and len(err.splitlines()) == 1, err
    assert _snapshot(one_epoch) == before


@pytest.fixture(scope="module")
def finished_epoch(data_dir, tmp_path_factory):
    """A checkpoint after one epoch, to copy and damage."""
    directory = tmp_path_factory.mktemp("finished") / "ckpt"
    assert main(_args(data_dir, "--devices", "cpu:1", "--epochs", "1", "--checkpoint-dir", str(directory))) == 0
    return directory


@pytest.mark.parametrize("section, field, value, message", [
    ("state", "epoch", "x", "state.epoch must be an int, got 'x'"),
    ("state", "epoch", -5, "state.epoch must be >= 1, got -5"),
    ("state", "batch", 1e6, "state.batch must be an int, got 1000000.0"),
    ("state", "batch", 30, "it points at epoch 2, batch 30, but an epoch here has 30 batches"),
    ("state", "loss_sum", float("nan"), "state.loss_sum must be a finite number"),
    ("state", "shuffle_seed", 5, "it orders epoch 2 with seed 5, but --seed 3 gives"),
    ("state", "history", [], "state.history must list the 1 epoch(s) finished before epoch 2"),
    ("state", "history", [{"epoch": 1}], "state.history[0].train_loss must be a number, got None"),
    ("config", None, {}, "(no config.dataset)"),
    ("config", "dataset", "fashion-mnist", "config.dataset must be a name and a fingerprint"),
    ("config", "lr", "x", "config.lr must be a number, got 'x'"),
    ("config", "optimizer", "sgd", "config.optimizer must be an optimizer's configuration"),
])
def test_a_malformed_manifest_field_is_a_corrupt_checkpoint(finished_epoch, data_dir, tmp_path, section, field,
                                                             value, message, capsys):
    """A field of checkpoint.json of the wrong type or range gave a traceback, and "config": {} resumed without
    any compatibility check: each is refused as a corrupt checkpoint, one line, status 2."""
    directory = tmp_path / "ckpt"
    shutil.copytree(finished_epoch, directory)
    manifest = json.loads((directory / ckpt.MANIFEST).read_text())
    if field is None:
        manifest[section] = value
    else:
        manifest[section][field] = value
    (directory / ckpt.MANIFEST).write_text(json.dumps(manifest))
    before = _snapshot(directory)
    status = main(_args(data_dir, "--devices", "cpu:1", "--epochs", "2", "--checkpoint-dir", str(directory),
                        "--resume"))
    out, err = capsys.readouterr()
    assert status == 2 and len(err.strip().splitlines()) == 1 and message in err, err
    assert err.startswith(f"error: {directory / ckpt.MANIFEST}: ") and "cannot be resumed" in err, err
    assert "epoch 2" not in out and _snapshot(directory) == before


def test_a_second_run_into_a_held_checkpoint_dir_is_refused_naming_the_holder(data_dir, tmp_path, capsys):
    """Two runs into one directory both succeeded and the last writer won: the directory is locked for a run's
    life, and a second run is refused, before it trains, with one line that names the holder."""
    from parallel.files import DirectoryLock
    directory = tmp_path / "ckpt"
    directory.mkdir()
    with DirectoryLock(directory):   # what a run in progress holds
        status = main(_args(data_dir, "--devices", "cpu:1", "--epochs", "1", "--checkpoint-dir", str(directory)))
        out, err = capsys.readouterr()
    assert status == 2 and len(err.strip().splitlines()) == 1, err
    assert f"is in use by process {os.getpid()} on " in err and "training LeNet" not in out
    assert os.listdir(directory) == []   # the holder's lock file went with it; nothing else was written
    assert main(_args(data_dir, "--devices", "cpu:1", "--epochs", "1", "--checkpoint-dir", str(directory))) == 0
    assert sorted(os.listdir(directory)) == ["checkpoint.json", "params-000001.params"]   # no lock file left


def test_a_checkpoint_dir_that_cannot_be_made_is_refused_before_training(data_dir, tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    status = main(_args(data_dir, "--devices", "cpu:1", "--epochs", "1", "--checkpoint-dir",
                        str(tmp_path / "file" / "ckpt")))
    out, err = capsys.readouterr()
    assert status == 2 and "training LeNet" not in out, out
    assert err.strip() == (f"error: --checkpoint-dir {str(tmp_path / 'file' / 'ckpt')!r} cannot hold the checkpoint: "
                           "Not a directory")


def test_outputs_inside_a_new_checkpoint_dir_and_no_empty_directory_left(data_dir, tmp_path, capsys, monkeypatch):
    """--export run1/model with a fresh --checkpoint-dir run1 was refused (run1 did not exist yet); a run that
    fails before writing anything leaves no empty directory behind."""
    monkeypatch.chdir(tmp_path)
    assert main(_args(data_dir, "--devices", "cpu:1", "--epochs", "1", "--checkpoint-dir", "run1",
                      "--export", "run1/model", "--metrics-json", "run1/m.json")) == 0, capsys.readouterr().err
    assert sorted(os.listdir("run1")) == ["checkpoint.json", "m.json", "model-0000.params", "model-symbol.json",
                                          "params-000001.params"]
    assert main(_args(data_dir, "--devices", "tpu:1", "--epochs", "1", "--checkpoint-dir", "run2")) == 2
    assert "unknown --devices" in capsys.readouterr().err and not os.path.exists("run2")


def test_a_cosine_schedule_resumes_only_over_the_epochs_it_spans(data_dir, tmp_path, capsys):
    """The schedule is part of the computation: more --epochs would stretch the cosine, so they are refused (a
    constant rate may train further, as test_resume_with_more_epochs_is_bitwise_the_longer_run shows)."""
    args = _args(data_dir, "--devices", "cpu:2", "--momentum", "0.9", "--lr-schedule", "cosine", "--checkpoint-dir",
                 str(tmp_path / "ckpt"))
    assert main([*args, "--epochs", "2"]) == 0
    capsys.readouterr()
    assert main([*args, "--epochs", "3", "--resume"]) == 2
    err = capsys.readouterr().err
    assert "'total_steps': 60" in err and "'total_steps': 90" in err and len(err.splitlines()) == 1, err
    assert main([*args, "--epochs", "2", "--resume"]) == 0
    assert "has finished all 2 epochs" in capsys.readouterr().out


def test_a_checkpoint_without_optimizer_state_resumes_as_plain_sgd(one_epoch, data_dir, capsys):
    """Version 1 checkpoints (before optimizers had state) were written by plain SGD runs: they resume so."""
    manifest = json.loads((one_epoch / ckpt.MANIFEST).read_text())
    assert manifest["version"] == ckpt.VERSION and manifest["optimizer_file"] is None
    manifest["version"] = 1
    for key in ("optimizer_file", "optimizer_sha256"):
        del manifest[key]
    del manifest["config"]["optimizer"]
    (one_epoch / ckpt.MANIFEST).write_text(json.dumps(manifest))
    resume = _args(data_dir, "--devices", "cpu:2", "--epochs", "2", "--checkpoint-dir", str(one_epoch), "--resume")
    assert main([*resume, "--momentum", "0.9"]) == 2
    assert "trained with optimizer sgd(lr=0.1), this run asks for sgd(lr=0.1, momentum=0.9)" in capsys.readouterr().err
    assert main(resume) == 0
