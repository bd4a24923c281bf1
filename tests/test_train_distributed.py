"""python -m parallel.train under python -m parallel.launch: W workers x K contexts train the same model as one
context; rank 0 alone prints and writes; a killed worker ends the job in bounded time and --resume finishes it."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid

import mxnet as mx
import numpy as np
import pytest

from parallel import RunConfig, fit
from parallel.checkpoint import load_checkpoint
from parallel.models import LENET_PARAM_NAMES
from parallel.train import main
from conftest import (assert_same_arrays, assert_same_parameters, easy_dataset, job_processes, lenet_strategy,
                      start_process, stop_process, write_idx_files)

MARK = "PARALLEL_TEST_JOB"
TRAIN = ["--batch-size", "13", "--lr", "0.1", "--seed", "3", "--no-progress"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """70 train examples: batches of 13 end with one of 5, fewer than 3 workers x 2 contexts."""
    dataset = easy_dataset(num_train=70, num_test=23, seed=6)
    return write_idx_files(tmp_path_factory.mktemp("idx"), dataset), dataset


def launch(workers, cwd, *train_args, servers=None, mark=None):
    """Start ``parallel.train`` under the launcher; big buffers split over the servers (bound 1000 elements)."""
    env = [] if mark is None else ["--env", f"{MARK}:{mark}"]
    command = [sys.executable, "-m", "parallel.launch", "-n", str(workers), "-s", str(servers or workers),
               "--stall-timeout", "120", "--env", "MXNET_KVSTORE_BIGARRAY_BOUND:1000", *env,
               sys.executable, "-m", "parallel.train", *train_args]
    return start_process(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(process, timeout=300):
    try:
        return process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:   # SIGTERM first: the launcher then stops every process it started
        stop_process(process, grace=60)
        raise


def exported(prefix):
    arrays = mx.nd.load(f"{prefix}-0000.params")
    return [arrays[f"arg:{name}"].asnumpy() for name in LENET_PARAM_NAMES]


@pytest.mark.slow
# two and three workers (three: the server sums in arrival order), one context a worker and two; and a cross
# barrier through the dist kvstore (LeNet in buckets enough that some are held until backward ends)
@pytest.mark.parametrize("workers, k, flags", [(2, 1, ()), (2, 2, ()), (3, 2, ()),
                                               (2, 1, ("--cross-barrier", "--bucket-mb", "0.02"))])
def test_workers_times_contexts_train_the_same_model_as_one_context_through_the_cli(workers, k, flags, tiny,
                                                                                      tmp_path):
    data_dir, dataset = tiny
    process = launch(workers, tmp_path, "--data-dir", str(data_dir), "--devices", f"cpu:{k}", "--epochs", "2",
                     *TRAIN, *flags, "--export", "lenet", "--metrics-json", "m.json", servers=min(workers, 2))
    out, err = finish(process)
    assert process.returncode == 0, err[-3000:]
    history, device_params = fit(dataset, lenet_strategy([mx.cpu(0)], seed=3), 0.1,
                                 RunConfig(epochs=2, batch_size=13, seed=3))
    assert_same_parameters(exported(tmp_path / "lenet"), [p.asnumpy() for p in device_params[0]], "float32")
    # rank 0 alone prints the epochs and writes; its metrics cover every worker's examples
    assert sum(" epoch 1, loss " in line for line in out.splitlines()) == 1, out
    assert [line for line in out.splitlines() if "joined the job as rank" in line].__len__() == workers
    got = json.loads((tmp_path / "m.json").read_text())
    for g, w in zip(got, history):
        np.testing.assert_allclose([g["train_loss"], g["train_acc"]], [w["train_loss"], w["train_acc"]], rtol=1e-5)
        assert abs(g["test_acc"] - w["test_acc"]) <= 1 / 23 + 1e-9
    assert sorted(os.listdir(tmp_path)) == ["lenet-0000.params", "lenet-symbol.json", "m.json"]
    assert ("a cross barrier" in out) == bool(flags), out


API_WORKER = """
import json, sys
sys.path.insert(0, {tests!r})
from conftest import easy_dataset
import mxnet as mx
from parallel import Reducer, RunConfig, fit, init_model, make_strategy
from parallel.job import join

job = join()
seed = 3 + job.rank   # every rank seeds differently: rank 0's parameters and seed must win
strategy = make_strategy("data", init_model("lenet", seed), [mx.cpu(0)], reducer=Reducer(job=job))
history, _ = fit(easy_dataset(num_train=70, num_test=23, seed=6), strategy, 0.1,
                 RunConfig(epochs=2, batch_size=13, seed=seed))
with open({out!r} + str(job.rank), "w") as f:
    json.dump(history, f)
"""


@pytest.mark.slow
def test_fit_in_a_job_gives_every_rank_the_same_metrics(tiny, tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(API_WORKER.format(tests=os.path.dirname(os.path.abspath(__file__)), out=str(tmp_path / "h")))
    process = start_process([sys.executable, "-m", "parallel.launch", "-n", "3", "-s", "1", "--stall-timeout",
                             "120", sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    _, err = finish(process)
    assert process.returncode == 0, err[-3000:]
    histories = [json.loads((tmp_path / f"h{rank}").read_text()) for rank in range(3)]
    timeless = [[{key: m[key] for key in ("epoch", "train_loss", "train_acc", "test_acc")} for m in h]
                for h in histories]
    assert timeless[0] == timeless[1] == timeless[2]
    want, _ = fit(tiny[1], lenet_strategy([mx.cpu(0)], seed=3), 0.1, RunConfig(epochs=2, batch_size=13, seed=3))
    np.testing.assert_allclose([m["train_loss"] for m in timeless[0]], [m["train_loss"] for m in want], rtol=1e-5)


@pytest.mark.slow
def test_a_killed_worker_ends_the_job_and_resume_finishes_the_same_run(tmp_path):
    data_dir = write_idx_files(tmp_path, easy_dataset(num_train=1200, num_test=60, seed=7))   # 120 batches of 10
    args = ["--data-dir", str(data_dir), "--batch-size", "10", "--lr", "0.1", "--seed", "5", "--no-progress",
            "--devices", "cpu:1", "--epochs", "3", "--checkpoint-dir", "ckpt", "--export", "lenet"]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    straight.mkdir(), killed.mkdir()
    out, err = finish(launch(2, straight, *args))
    assert "exported LeNet" in out, err[-3000:]

    mark = uuid.uuid4().hex
    process = launch(2, killed, *args, mark=mark)
    for line in process.stdout:   # rank 0 has finished epoch 1 and written its checkpoint
        if " epoch 1, loss " in line:
            break
    else:
        raise AssertionError("the job ended before its first epoch: " + process.stderr.read()[-3000:])
    printer = line.split("]")[0] + "]"   # "[worker i]", the launch index of rank 0
    time.sleep(0.5)
    victims = job_processes(MARK, mark, "worker")
    assert len(victims) == 2
    killed_at = time.monotonic()
    os.kill(victims[0], signal.SIGKILL)
    out, err = finish(process, timeout=120)
    seconds = time.monotonic() - killed_at
    assert process.returncode not in (0, None) and seconds < 30, (process.returncode, seconds)
    print(f"the launcher exited {seconds:.2f} s after the SIGKILL")   # shown by pytest -s (README's figure)
    assert "was killed by SIGKILL" in err.strip().splitlines()[-1], err[-2000:]
    deadline = time.monotonic() + 5
    while job_processes(MARK, mark) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert job_processes(MARK, mark) == [], "processes of the job were left behind"
    state = load_checkpoint(killed / "ckpt").state   # the last checkpoint loads: the end of epoch 1
    assert (state.epoch, state.batch) == (2, 0), f"the kill did not land in epoch 2 ({printer}: {state})"

    out, err = finish(launch(2, killed, *args, "--resume"))
    assert "resuming from" in out and "exported LeNet" in out, err[-3000:]
    assert_same_parameters(exported(killed / "lenet"), exported(straight / "lenet"), "float32")


@pytest.mark.slow
@pytest.mark.parametrize("when", ["before the first checkpoint", "after a checkpoint"])
def test_ctrl_c_on_a_launched_job_leaves_no_lock_and_says_how_to_resume(when, tmp_path):
    """The launcher's SIGINT SIGTERMs the workers, which end at once from their signal-watching thread (the main
    thread waits inside ps-lite) after removing what they were writing: no .lock in --checkpoint-dir, and no
    directory at all before its first checkpoint. The launcher's one line says how to go on when a checkpoint
    exists. (It left the .lock and said nothing.)"""
    data_dir = write_idx_files(tmp_path, easy_dataset(num_train=2000, num_test=60, seed=7))
    mark = uuid.uuid4().hex
    every = ["--checkpoint-every", "1"] if when == "after a checkpoint" else []
    process = launch(2, tmp_path, "--data-dir", str(data_dir), "--batch-size", "4", "--devices", "cpu:1",
                     "--epochs", "1000", "--no-progress", "--checkpoint-dir", "ckpt", *every, mark=mark)
    ckpt = tmp_path / "ckpt"
    target = ckpt / ("checkpoint.json" if every else ".lock")
    deadline = time.monotonic() + 120
    while not target.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert target.exists(), process.poll()
    process.send_signal(signal.SIGINT)
    out, err = finish(process, timeout=120)
    assert process.returncode == 130, err[-3000:]
    lines = err.strip().splitlines()
    assert lines[-1].startswith("error: interrupted by SIGINT; stopped the "), lines[-5:]
    hint = "; the checkpoint in ckpt goes on from where it stopped: add --resume to the training command"
    assert lines[-1].endswith(hint) == bool(every), lines[-1]
    assert not [line for line in lines if "error: interrupted" in line and line.startswith("[worker")], lines
    if every:
        assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith(".")) == [], list(ckpt.iterdir())
    else:
        assert not ckpt.exists(), list(ckpt.iterdir())
    deadline = time.monotonic() + 5
    while job_processes(MARK, mark) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert job_processes(MARK, mark) == []


@pytest.mark.slow
def test_a_launched_job_into_a_log_shows_no_progress_bar_and_labels_its_lines_by_rank(tiny, tmp_path):
    """No --no-progress, output to pipes (a log): no worker draws a bar (each refresh arrived as a line, from
    every worker); once a worker said its rank its lines carry it, and its trace file is named the same way."""
    process = launch(2, tmp_path, "--data-dir", str(tiny[0]), "--batch-size", "13", "--devices", "cpu:1",
                     "--epochs", "2", "--trace", "t.json")
    out, err = finish(process)
    assert process.returncode == 0, err[-3000:]
    assert not [line for line in (out + err).splitlines() if "%|" in line or "it/s" in line], err[-3000:]
    joined = {line.split()[1].rstrip("]"): line.split()[7] for line in out.splitlines()
              if line.startswith("[worker ") and " joined the job as rank " in line}
    assert sorted(joined.values()) == ["0", "1"], out
    epochs = [line for line in out.splitlines() if " epoch " in line and ", loss " in line]
    assert len(epochs) == 2 and all(line.startswith("[rank 0] epoch ") for line in epochs), out
    assert out.splitlines()[-1].startswith("[rank 0] trace written to t.rank0.json .. t.rank1.json"), out
    assert (tmp_path / "t.rank0.json").exists() and (tmp_path / "t.rank1.json").exists()


def test_distributed_flags_outside_a_job(capsys):
    """Every layout trains across processes (tests/test_layouts.py); the kvstore's flag needs a job."""
    assert main(["--kvstore", "dist_sync", "--dataset", "synthetic"]) == 2
    assert "--kvstore applies to a distributed job" in capsys.readouterr().err


@pytest.mark.slow
def test_resnet18_trains_in_a_job_and_rank_0_exports_it(tmp_path):
    """ResNet-18 (BatchNorm over every worker's slice, the default) runs under the launcher from
    rank 0's parameters and running statistics; rank 0 alone writes, and the export loads back in gluon."""
    (tmp_path / "idx").mkdir()
    data_dir = write_idx_files(tmp_path / "idx", easy_dataset(num_train=6, num_test=3, seed=4))
    process = launch(2, tmp_path, "--model", "resnet18", "--data-dir", str(data_dir), "--devices", "cpu:1",
                     "--epochs", "1", "--batch-size", "3", "--lr", "0.05", "--no-progress", "--export", "resnet",
                     "--metrics-json", "m.json", servers=1)
    out, err = finish(process)
    assert process.returncode == 0, err[-3000:]
    assert sum(" epoch 1, loss " in line for line in out.splitlines()) == 1, out
    assert len(json.loads((tmp_path / "m.json").read_text())) == 1
    net = mx.gluon.SymbolBlock.imports(str(tmp_path / "resnet-symbol.json"), ["data"],
                                       str(tmp_path / "resnet-0000.params"))
    assert np.isfinite(net(mx.nd.ones((2, 1, 28, 28))).asnumpy()).all()


@pytest.mark.slow
def test_a_job_resumes_its_optimizer_state_on_every_worker(tiny, tmp_path):
    """2 workers x 2 contexts, Nesterov momentum sharded with ZeRO-2 and 2 micro-batches: 1 epoch, then --resume
    --epochs 2, equals 2 epochs straight. Rank 0 reads the checkpoint's momentum and every worker gets it: a
    worker that started from zero momentum would compute other gradients, and the runs would part."""
    data_dir, _ = tiny
    args = ["--data-dir", str(data_dir), *TRAIN, "--devices", "cpu:2", "--momentum", "0.9", "--nesterov",
            "--zero", "2", "--allreduce", "ring", "--accumulate", "2", "--checkpoint-dir", "ckpt", "--export",
            "lenet"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    straight.mkdir(), resumed.mkdir()
    out, err = finish(launch(2, straight, *args, "--epochs", "2"))
    assert "exported LeNet" in out and "ZeRO-2" in out, err[-3000:]
    out, err = finish(launch(2, resumed, *args, "--epochs", "1"))
    assert load_checkpoint(resumed / "ckpt").optimizer_state, err[-3000:]
    out, err = finish(launch(2, resumed, *args, "--epochs", "2", "--resume"))
    assert "resuming from" in out and "exported LeNet" in out, err[-3000:]
    assert_same_parameters(exported(resumed / "lenet"), exported(straight / "lenet"), "float32")


@pytest.mark.slow
def test_a_sharded_job_is_zero_0_and_its_checkpoint_resumes_on_any_layout(tiny, tmp_path):
    """2 workers x 2 contexts with ``--zero 3`` (each context keeps a quarter of the model; the last batch of 5
    leaves contexts idle) export the bits ``--zero 0`` does in the same job, through ps-lite's servers. Its
    checkpoint after one epoch resumes in one process (cpu:1, ``--zero 0``), and in the job with ``--zero 3`` on 1
    context a worker: each as close to the uninterrupted run on its layout as the straight runs of two layouts are
    to each other (within a factor 2: both are float32 rounding of the sums' order); on the same layout, bitwise."""
    data_dir, _ = tiny
    args = ["--data-dir", str(data_dir), *TRAIN, "--momentum", "0.9", "--checkpoint-dir", "ckpt", "--export", "lenet"]
    runs, outs = {}, {}
    for name, workers, layout in (("zero0", 2, ["--devices", "cpu:2"]), ("zero3", 2, ["--devices", "cpu:2", "--zero", "3"]),
                                  ("one", 1, ["--devices", "cpu:1"]), ("job1", 2, ["--devices", "cpu:1", "--zero", "3"])):
        (tmp_path / name).mkdir()
        if workers == 1:
            assert main([*args, *layout, "--epochs", "2", "--checkpoint-dir", str(tmp_path / name / "ckpt"),
                         "--export", str(tmp_path / name / "lenet")]) == 0
        else:
            outs[name], err = finish(launch(workers, tmp_path / name, *args, *layout, "--epochs", "2"))
            assert "exported LeNet" in outs[name], err[-3000:]
        runs[name] = exported(tmp_path / name / "lenet")
    assert "ZeRO-3: each context keeps 1/4 (2 workers x 2 contexts)" in outs["zero3"]
    assert_same_arrays([runs["zero3"]], [runs["zero0"]])
    scale = max(np.abs(w).max() for w in runs["zero3"])
    apart = max(np.abs(a - b).max() for name in ("one", "job1") for a, b in zip(runs[name], runs["zero3"]))
    assert apart < 1e-4 * scale   # rounding of the sums' order, not another model
    first = tmp_path / "first"   # the job's checkpoint after one epoch, which every layout below resumes
    first.mkdir()
    out, err = finish(launch(2, first, *args, "--devices", "cpu:2", "--zero", "3", "--epochs", "1"))
    assert load_checkpoint(first / "ckpt").optimizer_state, err[-3000:]
    for name, workers, layout in (("one", 1, ["--devices", "cpu:1"]), ("job1", 2, ["--devices", "cpu:1", "--zero", "3"]),
                                  ("zero3", 2, ["--devices", "cpu:2", "--zero", "3"])):
        directory = tmp_path / f"resumed-{name}"
        directory.mkdir()
        shutil.copytree(first / "ckpt", directory / "ckpt")
        if workers == 1:
            assert main([*args, *layout, "--epochs", "2", "--resume", "--checkpoint-dir", str(directory / "ckpt"),
                         "--export", str(directory / "lenet")]) == 0
        else:
            out, err = finish(launch(workers, directory, *args, *layout, "--epochs", "2", "--resume"))
            assert "resuming from" in out, err[-3000:]
        resumed = exported(directory / "lenet")
        if name == "zero3":
            assert_same_arrays([resumed], [runs["zero3"]])
        else:
            gap = max(np.abs(a - b).max() for a, b in zip(resumed, runs[name]))
            assert gap <= 2 * max(apart, 1e-7 * scale), (name, gap, apart)   # the same order: float32 rounding


BATCHNORM_WORKER = """
import sys
sys.path.insert(0, {tests!r})
import mxnet as mx
import numpy as np
from mxnet import autograd
from conftest import small_resnet
from parallel import Layout, Reducer, get_params, make_strategy, split_and_load
from parallel.comm.statistics import across_workers
from parallel.job import join, worker_slice
from parallel.models.gluon import GluonNet
from parallel.optim import SGD

job, k = join(), {k}
ctx_list = [mx.cpu(i) for i in range(k)]
X = mx.nd.array(np.load({data!r})["X"], dtype="float64")
net = small_resnet()
net.cast("float64")
start, stop = worker_slice(13, k, job.rank, job.num_workers)   # one forward and backward of 13 examples
replicas = [get_params(net, ctx) for ctx in ctx_list]
shards = split_and_load(X[start:stop], ctx_list)
with across_workers(job), autograd.record():
    outputs = GluonNet(net).forward_all(shards, replicas[:len(shards)])
    losses = [(out * out).sum() for out in outputs]
autograd.backward(losses)
grads = [job.allsum(1000 + i, mx.nd.add_n(*[r[i].grad.as_in_context(mx.cpu()) for r in replicas]))
         for i in range(len(replicas[0]))]
layout = {layout}
strategy = make_strategy(layout, net, ctx_list, reducer=Reducer(job=job))
optimizer = SGD(0.05, momentum=0.9, zero=layout.zero)
for n in (12, 1, 7, 5):   # a batch of 1 leaves workers without an example
    strategy.train_step(X[13:13 + n], mx.nd.arange(n) % 10, optimizer=optimizer)
np.savez({out!r} + str(job.rank), start=start,
         outputs=np.concatenate([o.asnumpy() for o in outputs]) if outputs else np.zeros((0, 10)),
         **{{f"grad{{i}}": g.asnumpy() for i, g in enumerate(grads)}},
         **{{f"param{{i}}": p.asnumpy() for i, p in enumerate(strategy.params())}},
         **{{f"aux{{i}}": a.asnumpy() for i, a in enumerate(strategy.aux())}})
"""


def _one_context_batchnorm(X):
    """The small ResNet in float64 on one context: the outputs and gradients of one forward and backward of
    ``X[:13]``, then its arrays and running statistics after the batches the workers train."""
    from mxnet import autograd
    from parallel import Layout, get_params, make_strategy
    from parallel.models.gluon import GluonNet
    from parallel.optim import SGD
    from conftest import small_resnet
    net = small_resnet()
    net.cast("float64")
    replica = get_params(net, mx.cpu(0))
    with autograd.record():
        out = GluonNet(net)(X[:13], replica)
        loss = (out * out).sum()
    loss.backward()
    want = {"outputs": out.asnumpy(), **{f"grad{i}": p.grad.asnumpy() for i, p in enumerate(replica)}}
    strategy = make_strategy(Layout("data"), net, [mx.cpu(0)])
    optimizer = SGD(0.05, momentum=0.9)
    for n in (12, 1, 7, 5):
        strategy.train_step(X[13:13 + n], mx.nd.arange(n) % 10, optimizer=optimizer)
    want.update({f"param{i}": p.asnumpy() for i, p in enumerate(strategy.params())})
    want.update({f"aux{i}": a.asnumpy() for i, a in enumerate(strategy.aux())})
    return want


@pytest.mark.slow
@pytest.mark.parametrize("workers, k, layout", [(2, 1, 'Layout("data")'), (3, 2, 'Layout("data")'),
                                                (2, 2, 'Layout("data", zero=3, recompute=True)')])
def test_batchnorm_over_the_workers_is_one_context_s_through_the_launcher(workers, k, layout, tmp_path):
    """Issue 50's measure: W workers x K contexts with unequal shards, real ps-lite servers, train a BatchNorm network
    (the small ResNet, float64) within 1e-9 of one context: the outputs and gradients of one forward and backward
    (the gradients summed over the workers), then the parameters and running statistics after four steps that
    leave a worker without an example; every worker ends with the same bits."""
    _batchnorm_through_the_launcher(workers, k, layout, tmp_path)


#: Rank 1's first BatchNorm gather of the first training step waits behind a long computation, while its next step
#: (a batch of 1: rank 1 has no example) makes its rounds of the same keys at once.
LATE_GATHER = """
from parallel.comm import statistics
_forward = statistics.WorkerSum.forward
def _late(self, buffer):
    if job.rank == 1 and not getattr(job, "late", False):
        job.late = True
        big = mx.nd.ones((800, 800), ctx=buffer.context, dtype=buffer.dtype)
        for _ in range(6):
            big = mx.nd.dot(big, big) / 800
        buffer = buffer + 0 * big[0, 0]
    return _forward(self, buffer)
statistics.WorkerSum.forward = _late
"""


@pytest.mark.slow
def test_a_worker_without_an_example_sums_after_its_late_rounds_of_the_step_before(tmp_path):
    """A worker whose gather of one step still waits for its array when its next step, without an example, makes
    the same BatchNorm's rounds: they leave after it (``Job.after_last_round``; the backward's once the forward's
    is summed, ``statistics.idle``) and the job trains the one-context model. Before, the zeros left first, the
    servers paired them with the other workers' earlier round, and the job hung in that step (CI, stop 65)."""
    _batchnorm_through_the_launcher(3, 2, 'Layout("data")', tmp_path, prelude=LATE_GATHER)


def _batchnorm_through_the_launcher(workers, k, layout, tmp_path, prelude=""):
    """``BATCHNORM_WORKER`` under the launcher (``prelude`` run before its training steps) against one context."""
    rng = np.random.RandomState(5)
    np.savez(tmp_path / "data.npz", X=rng.uniform(size=(38, 1, 28, 28)))
    script = tmp_path / "worker.py"
    text = BATCHNORM_WORKER.format(tests=os.path.dirname(os.path.abspath(__file__)), k=k, layout=layout,
                                   data=str(tmp_path / "data.npz"), out=str(tmp_path / "rank"))
    script.write_text(text.replace("for n in (12, 1, 7, 5):", prelude + "for n in (12, 1, 7, 5):", 1))
    process = start_process([sys.executable, "-m", "parallel.launch", "-n", str(workers), "-s", "2",
                             "--stall-timeout", "120", sys.executable, str(script)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, err = finish(process)
    assert process.returncode == 0, err[-20000:]   # on a stall: each worker's records and stack, then the error
    ranks = [dict(np.load(tmp_path / f"rank{r}.npz")) for r in range(workers)]
    want = _one_context_batchnorm(mx.nd.array(np.load(tmp_path / "data.npz")["X"], dtype="float64"))
    outputs = np.concatenate([got.pop("outputs") for got in sorted(ranks, key=lambda got: int(got.pop("start")))])
    np.testing.assert_allclose(outputs, want.pop("outputs"), rtol=0, atol=1e-9 * np.abs(outputs).max())
    for got in ranks:
        assert sorted(got) == sorted(want)
        for name, value in want.items():   # a bias right before BatchNorm stays 0 up to rounding: scale 1e-3 at least
            scale = max(np.abs(value).max(), 1e-3)
            tolerance = 1e-6 if name.startswith("aux") else 1e-9   # MXNet's BatchNorm on one context: float32's
            np.testing.assert_allclose(got[name], value, rtol=0, atol=tolerance * scale, err_msg=name)
            np.testing.assert_array_equal(got[name], ranks[0][name], err_msg=name)


@pytest.mark.slow
def test_a_resnet18_job_resumes_its_batchnorm_statistics_and_the_flag_keeps_them_per_worker(tmp_path):
    """ResNet-18 in a job of 2 workers (BatchNorm over every worker's slice, the default, as the header says): one
    epoch, then --resume --epochs 2, ends with the bits of two epochs straight, running statistics included
    (saved once, the same on every worker; read back by rank 0 and broadcast). ``--batchnorm-stats worker`` runs and
    says so, and trains another model."""
    (tmp_path / "idx").mkdir()
    data_dir = write_idx_files(tmp_path / "idx", easy_dataset(num_train=8, num_test=4, seed=4))
    args = ["--model", "resnet18", "--data-dir", str(data_dir), "--devices", "cpu:1", "--batch-size", "3", "--lr",
            "0.05", "--momentum", "0.9", "--no-progress", "--checkpoint-dir", "ckpt"]
    runs = {}
    for name, extra in (("straight", ["--epochs", "2"]), ("resumed", ["--epochs", "1"]),
                        ("resumed", ["--epochs", "2", "--resume"]),
                        ("worker", ["--epochs", "2", "--batchnorm-stats", "worker"])):
        (tmp_path / name).mkdir(exist_ok=True)
        out, err = finish(launch(2, tmp_path / name, *args, *extra, servers=1))
        assert " epoch " in out, err[-3000:]
        runs[name] = load_checkpoint(str(tmp_path / name / "ckpt"))
        says = "per worker" if name == "worker" else "BatchNorm over every worker's slice of the batch"
        assert says in out, out
    assert_same_arrays([[p.asnumpy() for p in runs["resumed"].params], [a.asnumpy() for a in runs["resumed"].aux]],
                       [[p.asnumpy() for p in runs["straight"].params], [a.asnumpy() for a in runs["straight"].aux]])
    apart = max(float(np.abs(a.asnumpy() - b.asnumpy()).max()) for a, b in zip(runs["worker"].aux,
                                                                                 runs["straight"].aux))
    assert apart > 1e-4
