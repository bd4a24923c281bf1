"""``--logdir`` and ``RunConfig(logdir=...)``: TensorBoard's event files, read back with TensorBoard's own reader
(``EventAccumulator``), hold what the run printed and wrote: the epochs' metrics, a point a step, the schedule's
rates, the gradient's norm, the bytes the collectives copied, the memory of each context, the configuration; in a
job rank 0 alone writes; a run without a logdir writes none; bad input is one line (CLI) or a named error (API)."""
import importlib
import json
import os
import re

import numpy as np
import pytest

import mxnet as mx
from mxnet import autograd

from parallel import Reducer, RunConfig, fit, init_model, make_strategy, synthetic_dataset, write_idx
from parallel.board import EPOCH_TAGS, STEP_TAGS, check_logdir, memory_tag
from parallel.comm import algorithms, bytes_moved
from parallel.data import FILES
from parallel.models.lenet import lenet, softmax_cross_entropy
from parallel.optim import SGD
from parallel.optim.schedules import Cosine
from parallel.train import main
from conftest import easy_dataset, in_threads, run_process

LENET_BYTES = 4 * 129068   # LeNet's float32 parameters


def read_events(logdir):
    """TensorBoard's own reading of ``logdir``: ``{tag: [(step, value), ...]}`` and the config text."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    scalars = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    texts = [t.tensor_proto.string_val[0].decode() for t in events.Tensors("config/text_summary")] \
        if "config/text_summary" in events.Tags()["tensors"] else []
    return scalars, texts


def event_files(directory):
    return [os.path.join(d, n) for d, _, names in os.walk(directory) for n in names if "tfevents" in n]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """600 training and 200 test examples (6 steps an epoch at batch 100) as an MNIST-format directory."""
    directory = tmp_path_factory.mktemp("idx")
    dataset = easy_dataset(num_train=600, num_test=200, seed=1)
    for role, name in FILES.items():
        write_idx(directory / name, getattr(dataset, role))
    return directory


def test_the_cli_writes_what_the_run_printed_and_recorded(data_dir, tmp_path, capsys, monkeypatch):
    copies = []   # every copy between contexts, as tests/test_comm.py counts them
    copy = algorithms.copy_to
    monkeypatch.setattr(algorithms, "copy_to", lambda src, dst: copies.append(src.size * 4) or copy(src, dst))
    metrics_path, logdir = tmp_path / "m.json", tmp_path / "board"
    assert main(["--devices", "cpu:2", "--epochs", "2", "--batch-size", "100", "--lr", "0.5", "--data-dir",
                 str(data_dir), "--lr-schedule", "cosine", "--warmup-epochs", "0.5", "--metrics-json",
                 str(metrics_path), "--logdir", str(logdir), "--no-progress"]) == 0
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("epoch ")]
    history = json.loads(metrics_path.read_text())
    scalars, texts = read_events(logdir)
    assert len(event_files(logdir)) == 1
    assert set(scalars) == set(STEP_TAGS) - {"comm/bytes_pushed"} | set(EPOCH_TAGS) | {"memory/cpu0", "memory/cpu1"}

    for tag, key in EPOCH_TAGS.items():   # float32 in the event file
        assert [step for step, _ in scalars[tag]] == [1, 2]
        np.testing.assert_allclose([v for _, v in scalars[tag]], [m[key] for m in history], rtol=1e-6)
    for line, (_, loss), (_, test_acc) in zip(printed, scalars["epoch/train_loss"], scalars["epoch/test_acc"]):
        assert f"loss {loss:.3f}," in line and f"test acc {test_acc:.3f}," in line
    for m, epoch in zip(history, (1, 2)):   # memory as --metrics-json records it, a context's parts added up
        for row in m["memory"]:
            total = sum(v for k, v in row.items() if k != "context")
            assert scalars[memory_tag(row["context"])][epoch - 1] == (epoch, total)

    steps = 2 * 6
    for tag in STEP_TAGS.keys() - {"comm/bytes_pushed"}:
        assert [step for step, _ in scalars[tag]] == list(range(1, steps + 1)), tag
    schedule = SGD(0.5, schedule=Cosine(steps, warmup_steps=3))
    np.testing.assert_allclose([v for _, v in scalars["train/lr"]], [schedule.lr_at(t) for t in range(1, steps + 1)],
                               rtol=1e-6)
    assert 0 < scalars["train/lr"][0][1] < scalars["train/lr"][2][1]   # warming up
    # each step copies what bytes_moved says the fused allreduce of LeNet's gradient copies, and nothing else does
    assert {v for _, v in scalars["comm/bytes_moved"]} == {bytes_moved("fused", LENET_BYTES, 2).total}
    assert sum(v for _, v in scalars["comm/bytes_moved"]) == sum(copies)
    assert all(v > 0 for _, v in scalars["train/grad_norm"] + scalars["train/examples_per_second"])
    np.testing.assert_allclose(np.mean([v for _, v in scalars["train/loss"][:6]]), history[0]["train_loss"],
                               rtol=1e-5)   # an epoch's steps average to its loss (equal batches)
    assert len(texts) == 1 and "| strategy | data |" in texts[0] and "| epochs | 2 |" in texts[0]
    assert "| contexts | cpu(0), cpu(1) |" in texts[0]


def _tiny(n=32):
    return synthetic_dataset(num_train=n, num_test=16, seed=3)


@pytest.mark.parametrize("clip_norm", [None, 1e-4])
def test_the_gradient_norm_is_the_mean_gradients_before_clipping(tmp_path, clip_norm):
    """One step over the whole (tiny) dataset on two contexts against autograd's gradient on one context."""
    dataset = _tiny()
    strategy = make_strategy("data", init_model("lenet", seed=0), [mx.cpu(0), mx.cpu(1)])
    optimizer = SGD(0.1, clip_norm=clip_norm)
    fit(dataset, strategy, optimizer, RunConfig(epochs=1, batch_size=32, logdir=tmp_path))
    assert not optimizer.record_norm and optimizer.grad_norm is None   # given back as it was
    params = [p.copy() for p in init_model("lenet", seed=0)]
    for p in params:
        p.attach_grad()
    X = mx.nd.array(dataset.train_images, dtype="float32").reshape((-1, 1, 28, 28)) / 255
    with autograd.record():
        loss = softmax_cross_entropy(lenet(X, params), mx.nd.array(dataset.train_labels)).sum()
    loss.backward()
    want = np.sqrt(sum(float((p.grad.astype("float64") ** 2).sum().asscalar()) for p in params)) / 32
    scalars, _ = read_events(tmp_path)
    [(step, got)] = scalars["train/grad_norm"]
    assert step == 1 and got == pytest.approx(want, rel=1e-4)
    assert scalars["train/loss"][0][1] == pytest.approx(float(loss.asscalar()) / 32, rel=1e-5)


def test_in_a_job_rank_0_alone_writes(tmp_path, threads_reduce_at_once, monkeypatch):
    """Two workers (threads standing in for ps-lite's servers) given the same logdir: one writer, one event file,
    rank 0's, with the gradient each worker pushed once a step."""
    fit_module, opened = importlib.import_module("parallel.fit"), []
    monkeypatch.setattr(fit_module, "Board", lambda logdir, board=fit_module.Board: opened.append(logdir) or
                        board(logdir))
    dataset = _tiny(64)
    logdir = tmp_path / "board"

    def work(job, rank):
        strategy = make_strategy("data", init_model("lenet", seed=0), [mx.cpu(rank)], reducer=Reducer(job=job))
        return fit(dataset, strategy, 0.1, RunConfig(epochs=1, batch_size=32, logdir=logdir))[0]
    (first, second), _ = in_threads(2, work)
    timing = ("seconds", "images_per_second")
    assert [{k: v for k, v in m.items() if k not in timing} for m in first] == \
        [{k: v for k, v in m.items() if k not in timing} for m in second]
    assert opened == [str(logdir)]
    [path] = event_files(logdir)
    scalars, texts = read_events(logdir)
    assert [v for _, v in scalars["comm/bytes_pushed"]] == [LENET_BYTES, LENET_BYTES]
    assert scalars["epoch/test_acc"][0][1] == pytest.approx(first[0]["test_acc"])
    assert "| workers | 2 |" in texts[0]


def test_a_run_without_a_logdir_writes_no_event_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    optimizer = SGD(0.1)
    strategy = make_strategy("data", init_model("lenet", seed=0), [mx.cpu(0)])
    fit(_tiny(), strategy, optimizer, RunConfig(epochs=1, batch_size=32))
    assert RunConfig(epochs=1, batch_size=32).logdir is None
    assert not event_files(tmp_path) and not os.path.exists(tmp_path / "runs")   # tensorboardX's default
    assert optimizer.grad_norm is None   # nothing computed for a board nobody reads


def test_an_interrupted_run_closes_its_event_file(tmp_path):
    """Ctrl-C (KeyboardInterrupt) inside the loop: the steps written so far are on disk, readable."""
    class Interrupted:
        calls = 0

        def __call__(self):
            self.calls += 1
            if self.calls == 6:   # before step 6: steps 1-5 queued, the oldest 3 read (IN_FLIGHT 2 in flight)
                raise KeyboardInterrupt
            return False
    strategy = make_strategy("data", init_model("lenet", seed=0), [mx.cpu(0)])
    with pytest.raises(KeyboardInterrupt):
        fit(_tiny(256), strategy, 0.1, RunConfig(epochs=1, batch_size=32, logdir=tmp_path), stop=Interrupted())
    scalars, texts = read_events(tmp_path)
    assert [step for step, _ in scalars["train/loss"]] == [1, 2, 3] and texts


@pytest.mark.parametrize("value, error, says", [
    (3, TypeError, "logdir must be a path"),
    ("", ValueError, "logdir must name a file or directory"),
    ("FILE", ValueError, "is a file, not a directory"),
])
def test_the_api_refuses_a_bad_logdir_naming_it(tmp_path, value, error, says):
    if value == "FILE":
        value = tmp_path / "f"
        value.write_text("")
    with pytest.raises(error, match=says):
        RunConfig(epochs=1, batch_size=32, logdir=value)
    with pytest.raises(error, match=says):
        check_logdir(value)


def test_the_cli_refuses_a_bad_logdir_in_one_line(tmp_path):
    import sys
    afile = tmp_path / "f"
    afile.write_text("")
    for logdir, says in ((str(afile), f"--logdir {str(afile)!r} is a file, not a directory"),
                         ("", "--logdir needs a path"), (str(tmp_path / "m.json"), "--metrics-json and --logdir both")):
        result = run_process([sys.executable, "-m", "parallel.train", "--dataset", "synthetic", "--epochs", "1",
                              "--metrics-json", str(tmp_path / "m.json"), "--logdir", logdir], timeout=120,
                             cwd=str(tmp_path))
        assert result.returncode == 2, result.stderr
        assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: ") and says in result.stderr, (
            result.stderr)
        assert not re.search(r"Traceback", result.stderr)
    assert afile.read_text() == "" and not event_files(tmp_path)


def test_a_loss_that_diverged_is_written_without_tensorboardxs_warning(tmp_path, caplog):
    """--lr 1e30 --logdir DIR printed tensorboardX's "NaN or Inf found in input tensor." three times before the
    run's one error line; the value is still written, as it is."""
    from parallel.board import Board
    board = Board(tmp_path)
    with caplog.at_level("WARNING"):
        board.scalars({"train/loss": float("nan"), "train/acc": float("inf")}, 1)
    board.writer.close()
    assert not [r for r in caplog.records if r.name.startswith("tensorboardX")], caplog.records
    assert list(tmp_path.glob("events.out.tfevents.*"))
