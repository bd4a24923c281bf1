"""Jobs that heal: checkpoints every N steps (``fit(checkpoint_every=N)``, ``--checkpoint-every``), and
``python -m parallel.train`` under ``python -m parallel.launch --max-restarts`` resuming by itself after a worker
is SIGKILLed at any point, ending bitwise equal to the job never interrupted; with ``-n MIN:MAX`` the job goes on
with another number of workers and ends with the same model to float32 rounding."""
import json
import os
import sys

import mxnet as mx
import numpy as np
import pytest

from parallel import RunConfig, Snapshot, fit, make_strategy
from parallel.checkpoint import load_checkpoint
from parallel.cli import RESTART_ENV
from parallel.models import LENET_PARAM_NAMES
from parallel.optim import make_optimizer
from parallel.train import main
from conftest import (FAULT_WRAPPER, assert_same_parameters, easy_dataset, lenet_strategy, run_process,
                      write_idx_files)


def _snapshot(record):
    def on_checkpoint(snapshot):
        record.append(Snapshot(snapshot.state, [p.copy() for p in snapshot.params], [],
                               {name: [a.copy() for a in arrays] for name, arrays in snapshot.optimizer_state.items()},
                               {}))
    return on_checkpoint


@pytest.mark.slow   # seconds the fast tier's 150 s budget cannot spare (docs/testing.md)
def test_checkpoint_every_n_steps_and_resume_from_each_is_bitwise(tmp_path):
    dataset = easy_dataset(num_train=70, num_test=20, seed=1)   # batches of 16: 5 a epoch, the last of 6
    ctx = [mx.cpu(0), mx.cpu(1)]
    config = RunConfig(epochs=3, batch_size=16, seed=2, checkpoint_every=3)
    record = []
    history, model = fit(dataset, lenet_strategy(ctx, seed=2), make_optimizer("sgd", 0.05, momentum=0.9), config,
                         on_checkpoint=_snapshot(record))
    want = [p.asnumpy() for p in model[0]]
    steps = [(s.state.epoch - 1) * 5 + s.state.batch for s in record]
    # every third step, and every epoch's end (steps 5, 10, 15), once
    assert steps == [3, 5, 6, 9, 10, 12, 15], steps
    assert [(s.state.epoch, s.state.batch) for s in record][:3] == [(1, 3), (2, 0), (2, 1)]
    for snapshot in record[:-1]:
        again, state = [], snapshot.state
        strategy = make_strategy("data", snapshot.params, ctx)
        _, resumed = fit(dataset, strategy, make_optimizer("sgd", 0.05, momentum=0.9), config,
                         on_checkpoint=_snapshot(again), resume=snapshot)
        for got, expected in zip(resumed[0], want):
            np.testing.assert_array_equal(got.asnumpy(), expected, err_msg=f"resumed at {state.epoch}/{state.batch}")
        # the resumed run checkpoints where the uninterrupted one did
        assert [(s.state.epoch, s.state.batch) for s in again] == [
            (s.state.epoch, s.state.batch) for s in record if (s.state.epoch, s.state.batch) > (state.epoch, state.batch)]


@pytest.mark.parametrize("value", [0, True, 2.5])
def test_a_run_refuses_a_bad_checkpoint_every(value):
    with pytest.raises(TypeError if not isinstance(value, int) or isinstance(value, bool) else ValueError,
                       match="checkpoint_every") as raised:
        RunConfig(epochs=1, batch_size=8, checkpoint_every=value)
    assert raised.value.argument == "checkpoint_every"


@pytest.mark.parametrize("args, message", [
    (["--checkpoint-every", "5"], "--checkpoint-every needs --checkpoint-dir"),
    (["--checkpoint-every", "0", "--checkpoint-dir", "c"], "--checkpoint-every must be >= 1"),
    (["--checkpoint-every", "x", "--checkpoint-dir", "c"], "invalid int value"),
    (["--commit-every", "0"], "--commit-every must be >= 1"),
])
def test_bad_checkpoint_every_exits_2(args, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["--dataset", "synthetic", "--epochs", "1"] + args) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("error: ") and message in line
    assert os.listdir(tmp_path) == []


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """70 train examples: batches of 13, 6 a epoch, the last of 5."""
    return write_idx_files(tmp_path_factory.mktemp("idx"), easy_dataset(num_train=70, num_test=23, seed=6))


def test_a_restarted_run_resumes_by_itself_and_a_first_start_does_not(tiny, tmp_path, monkeypatch, capsys):
    """PARALLEL_RESTART >= 1 (what the launcher sets on a restart) resumes from --checkpoint-dir, where a first
    start over a checkpoint is refused; a restart with no checkpoint yet starts over."""
    monkeypatch.chdir(tmp_path)
    args = ["--data-dir", str(tiny), "--batch-size", "13", "--lr", "0.1", "--seed", "3", "--no-progress",
            "--devices", "cpu:2", "--checkpoint-dir", "ckpt", "--checkpoint-every", "4", "--export", "m"]
    assert main(args + ["--epochs", "2"]) == 0
    whole = mx.nd.load("m-0000.params")
    assert main(args + ["--epochs", "3"]) == 2
    assert "already holds a checkpoint" in capsys.readouterr().err
    monkeypatch.setenv(RESTART_ENV, "1")
    assert main(args + ["--epochs", "3"]) == 0
    out = capsys.readouterr().out
    assert "restart 1 of the job: resuming from its last checkpoint" in out and "epoch 3" in out
    assert main(args[:-6] + ["--checkpoint-dir", "fresh", "--epochs", "1"]) == 0
    assert "restart 1 of the job: no checkpoint in fresh yet, starting over" in capsys.readouterr().out
    assert load_checkpoint("ckpt").state.epoch == 4 and set(whole) == set(mx.nd.load("m-0000.params"))


TRAIN = ["--batch-size", "13", "--lr", "0.1", "--seed", "3", "--no-progress", "--devices", "cpu:1", "--epochs",
         "3", "--momentum", "0.9", "--checkpoint-dir", "ckpt", "--checkpoint-every", "4"]


def run_job(tmp_path, data_dir, plans, workers="2", discovery=None, timeout=400, train=TRAIN, launcher=()):
    (tmp_path / "wrapper.py").write_text(FAULT_WRAPPER)
    discover = [] if discovery is None else ["--host-discovery-script", f"cat {discovery}", *launcher]
    env = dict(os.environ, OMP_NUM_THREADS="1")   # every process, whatever the number of workers: equal rounding
    return run_process([sys.executable, "-m", "parallel.launch", "-n", workers, "-s", "1", "--max-restarts", "2",
                        "--grace", "2", "--stall-timeout", "120", *discover, sys.executable,
                        str(tmp_path / "wrapper.py"), plans, str(discovery), "--data-dir", str(data_dir), *train],
                       timeout=timeout, cwd=tmp_path, env=env)


@pytest.fixture(scope="module")
def straight(tiny, tmp_path_factory):
    """The job never interrupted: its final parameters and optimizer state."""
    directory = tmp_path_factory.mktemp("straight")
    result = run_job(directory, tiny, "none")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "restart" not in result.stderr
    return load_checkpoint(directory / "ckpt")


@pytest.mark.slow
@pytest.mark.parametrize("where", [
    "0/step:3:0",    # before the first checkpoint (after step 4): restarts from scratch
    "0/step:10:1",   # mid-epoch 2, on the worker that does not write
    "0/write:3",     # inside the third checkpoint write (after step 8): the second one is the last whole one
    "0/step:18:1",   # in the last batch
])
def test_a_job_killed_anywhere_restarts_and_ends_bitwise_equal(where, tiny, straight, tmp_path):
    result = run_job(tmp_path, tiny, where)
    assert result.returncode == 0, result.stderr[-3000:]
    restarts = [line for line in result.stderr.splitlines() if line.startswith("restart ")]
    assert len(restarts) == 1 and "was killed by SIGKILL" in restarts[0], result.stderr[-3000:]
    resumed = "no checkpoint in ckpt yet, starting over" if where == "0/step:3:0" else "resuming from its last"
    assert resumed in result.stdout, result.stdout[-3000:]
    got = load_checkpoint(tmp_path / "ckpt")
    assert got.state.epoch == 4
    assert len(got.params) == 8 and sorted(straight.optimizer_state) == ["momentum"]
    for g, w in zip(got.params, straight.params):
        np.testing.assert_array_equal(g.asnumpy(), w.asnumpy())
    for name in straight.optimizer_state:
        for g, w in zip(got.optimizer_state[name], straight.optimizer_state[name]):
            np.testing.assert_array_equal(g.asnumpy(), w.asnumpy())


@pytest.mark.slow
def test_a_job_goes_from_2_workers_to_1_to_3_and_trains_the_same_model(tiny, straight, tmp_path):
    """The first start's rank 1 leaves one host in the discovery file and dies before its 7th step; the second
    start's only worker leaves three and dies before its 6th (step 13 of the run); the third start finishes."""
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost\nlocalhost\n")
    result = run_job(tmp_path, tiny, "0/step:7:1/localhost+1/step:6:0/localhost,localhost,localhost",
                     workers="1:3", discovery=hosts, launcher=["--discovery-interval", "1000"])
    assert result.returncode == 0, result.stderr[-3000:]
    counts = [line.rsplit("; ", 1)[1] for line in result.stderr.splitlines() if line.startswith("restart ")]
    assert counts == ["starting 1 worker(s) again", "starting 3 worker(s) again"], result.stderr[-3000:]
    layouts = [line.split("] ", 1)[1] for line in result.stdout.splitlines() if "] training LeNet" in line]
    assert [line.rsplit(" on ", 1)[1] for line in layouts] == ["2 worker(s) x 1 context(s)",
                                                               "1 worker(s) x 1 context(s)",
                                                               "3 worker(s) x 1 context(s)"], result.stdout[-3000:]
    got = load_checkpoint(tmp_path / "ckpt")
    assert got.state.epoch == 4
    assert_same_parameters([p.asnumpy() for p in got.params], [p.asnumpy() for p in straight.params], "float32")


@pytest.mark.slow
def test_an_elastic_batchnorm_job_goes_from_2_workers_to_1_to_2_and_carries_its_statistics_exactly(tmp_path):
    """ResNet-18 (17 BatchNorm layers, each normalising over every worker's slice), batches of 6, 4 a epoch,
    a checkpoint each: rank 1 dies at its 6th step and lists one host, the single worker then dies at its 6th and
    lists two. The job ends with the bits, running statistics included, of the same sizes run by hand: 2 workers
    for epoch 1, then ``--resume`` on 1 for epoch 2 and on 2 for epoch 3. So a change of size carries the
    parameters, the optimizer's state and the running statistics exactly, and the new job's BatchNorm sums work
    at its new size; that any size trains the one-device model is proven in float64 (tests/test_layouts.py, and
    tests/test_train_distributed.py through the launcher), since in float32 this initialization amplifies
    rounding (docs/gluon.md). Where it must be false: the job that ran 2 workers throughout has other bits."""
    (tmp_path / "idx").mkdir()
    data_dir = write_idx_files(tmp_path / "idx", easy_dataset(num_train=24, num_test=4, seed=6))
    train = ["--model", "resnet18", "--batch-size", "6", "--lr", "0.05", "--momentum", "0.9", "--seed", "3",
             "--no-progress", "--devices", "cpu:1", "--checkpoint-dir", "ckpt", "--checkpoint-every", "4"]
    models = {}
    for name, runs in (("by hand", [("2", "1", []), ("1", "2", ["--resume"]), ("2", "3", ["--resume"])]),
                       ("straight", [("2", "3", [])])):
        (tmp_path / name).mkdir()
        for workers, epochs, extra in runs:
            result = run_job(tmp_path / name, data_dir, "none", workers=workers,
                             train=train + ["--epochs", epochs, *extra])
            assert result.returncode == 0, result.stderr[-3000:]
        models[name] = load_checkpoint(tmp_path / name / "ckpt")
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost\nlocalhost\n")
    result = run_job(tmp_path, data_dir, "0/step:6:1/localhost+1/step:6:0/localhost,localhost", workers="1:2",
                     discovery=hosts, train=train + ["--epochs", "3"], launcher=["--discovery-interval", "1000"])
    assert result.returncode == 0, result.stderr[-3000:]
    layouts = [line.rsplit(" on ", 1)[1] for line in result.stdout.splitlines() if "] training ResNet-18" in line]
    assert layouts == ["2 worker(s) x 1 context(s)", "1 worker(s) x 1 context(s)", "2 worker(s) x 1 context(s)"], \
        result.stdout[-3000:]
    assert "BatchNorm over every worker's slice of the batch" in result.stdout, result.stdout[-3000:]
    got = load_checkpoint(tmp_path / "ckpt")
    assert got.state.epoch == models["by hand"].state.epoch == 4
    want = models["by hand"]
    assert len(got.aux) == len(want.aux) == 34   # each BatchNorm's running mean and variance
    for g, w in zip(got.params + got.aux + got.optimizer_state["momentum"],
                    want.params + want.aux + want.optimizer_state["momentum"]):
        np.testing.assert_array_equal(g.asnumpy(), w.asnumpy())
    assert any(not np.array_equal(g.asnumpy(), w.asnumpy())
               for g, w in zip(got.params + got.aux, models["straight"].params + models["straight"].aux))


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["powersgd:2"])
def test_a_compressed_job_killed_mid_epoch_resumes_its_residuals_bitwise(spec, tiny, tmp_path):
    """2 workers x 2 contexts: residuals between the contexts and across the workers, and PowerSGD's Q matrices,
    go into the checkpoint from every worker and come back to each on the restart. PowerSGD keeps the most state of
    the compressors (a residual at every place, as top-k's and 2bit's, and its Q matrices); every compressor's
    state is saved and restored through the same checkpoint entries, which
    tests/test_compress_checkpoint.py proves bitwise for each of them in one process."""
    train = [arg if arg != "cpu:1" else "cpu:2" for arg in TRAIN] + ["--compression", spec]
    (tmp_path / "straight").mkdir()
    straight = run_job(tmp_path / "straight", tiny, "none", train=train)
    assert straight.returncode == 0, straight.stderr[-3000:]
    want = load_checkpoint(tmp_path / "straight" / "ckpt")
    assert {f"w{r}/residual/{where}" for r in range(2) for where in ("c0", "c1", "across")} <= \
        set(want.compression_state)
    result = run_job(tmp_path, tiny, "0/step:10:1", train=train)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resuming from its last" in result.stdout, result.stdout[-3000:]
    got = load_checkpoint(tmp_path / "ckpt")
    for g, w in zip(got.params, want.params):
        np.testing.assert_array_equal(g.asnumpy(), w.asnumpy())
    assert sorted(got.compression_state) == sorted(want.compression_state)
    for name, value in want.compression_state.items():
        np.testing.assert_array_equal(got.compression_state[name].asnumpy(), value.asnumpy())


@pytest.mark.slow
def test_an_elastic_job_grows_and_shrinks_with_its_state_in_memory_and_trains_the_same_model(tiny, straight,
                                                                                             tmp_path):
    """No --checkpoint-dir: the first start's one worker lists a second host at its 4th step and waits; the
    launcher sees it, takes the state the worker committed in memory and starts 2 workers from it. The second
    start's rank 1 lists one host and is SIGKILLed at its 9th step: the launcher takes the survivor's last commit
    (rank 0 waits in the step's sum, its server thread answers) and starts 1 worker from it. Every epoch is trained
    once, each records its number of workers, and the model is the one of the job that ran 2 workers throughout."""
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost\n")
    train = [arg for arg in TRAIN[:-4]] + ["--export", "m", "--metrics-json", "metrics.json"]
    assert "--checkpoint-dir" not in train
    result = run_job(tmp_path, tiny, "0/grow:4:0/localhost,localhost+1/step:9:1/localhost", workers="1:2",
                     discovery=hosts, train=train, launcher=["--discovery-interval", "0.2"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "the job's hosts changed: 127.0.0.1 joined (2 listed, -n 1:2); starting 2 worker(s) again" in \
        result.stderr, result.stderr[-3000:]
    taken = [line for line in result.stderr.splitlines() if line.startswith("took the state of step ")]
    assert len(taken) == 2, result.stderr[-3000:]
    layouts = [line.rsplit(" on ", 1)[1] for line in result.stdout.splitlines() if "] training LeNet" in line]
    assert layouts == ["1 worker(s) x 1 context(s)", "2 worker(s) x 1 context(s)", "1 worker(s) x 1 context(s)"], \
        result.stdout[-3000:]
    resumed = [line for line in result.stdout.splitlines() if "resuming from the state a worker committed" in line]
    assert len(resumed) == 2 and not (tmp_path / "ckpt").exists(), result.stdout[-3000:]
    history = json.loads((tmp_path / "metrics.json").read_text())
    assert [m["epoch"] for m in history] == [1, 2, 3] and history[-1]["workers"] == 1
    assert {m["workers"] for m in history} <= {1, 2} and 2 in [m["workers"] for m in history], history
    exported = mx.nd.load(str(tmp_path / "m-0000.params"))
    assert_same_parameters([exported[f"arg:{name}"].asnumpy() for name in LENET_PARAM_NAMES],
                           [p.asnumpy() for p in straight.params], "float32")


@pytest.mark.slow
def test_an_elastic_worker_that_raises_is_restarted_from_a_live_workers_state(tiny, straight, tmp_path):
    """Horovod's scenario of a rank failing by an exception at a scheduled step (the 9th, on rank 1), with no
    --checkpoint-dir: the launcher takes rank 0's last commit (step 8, --commit-every 4) and starts both again; the
    model is the straight job's, bitwise (the same layout, the same sums)."""
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost\nlocalhost\n")
    train = [arg for arg in TRAIN[:-4]] + ["--commit-every", "4", "--export", "m"]
    result = run_job(tmp_path, tiny, "0/raise:9:1", workers="1:2", discovery=hosts, train=train)
    assert result.returncode == 0, result.stderr[-3000:]
    restarts = [line for line in result.stderr.splitlines() if line.startswith("restart ")]
    assert len(restarts) == 1 and "RuntimeError: a failure planned at step 9" in restarts[0], result.stderr[-3000:]
    assert "took the state of step 8 " in result.stderr, result.stderr[-3000:]
    assert "resuming from the state a worker committed in memory: epoch 2, after 2 batch(es)" in result.stdout
    exported = mx.nd.load(str(tmp_path / "m-0000.params"))
    for name, want in zip(LENET_PARAM_NAMES, straight.params):
        np.testing.assert_array_equal(exported[f"arg:{name}"].asnumpy(), want.asnumpy())


@pytest.mark.slow
def test_an_elastic_job_with_its_model_sharded_across_the_workers_resumes_from_a_commit(tiny, tmp_path):
    """--zero 3 shards the parameters and the optimizer's state over both workers: each commit gathers them whole
    (every worker, in the same order) and the restart lays them out again. Rank 1 raises at its 9th step; the
    job ends bitwise equal to the same job never interrupted."""
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost\nlocalhost\n")
    train = [arg for arg in TRAIN[:-4]] + ["--zero", "3", "--commit-every", "4", "--export", "m"]
    models = {}
    for plan in ("none", "0/raise:9:1"):
        (tmp_path / plan.replace("/", "_")).mkdir()
        result = run_job(tmp_path / plan.replace("/", "_"), tiny, plan, workers="1:2", discovery=hosts, train=train)
        assert result.returncode == 0, result.stderr[-3000:]
        assert ("took the state of step 8 " in result.stderr) == (plan != "none"), result.stderr[-3000:]
        models[plan] = mx.nd.load(str(tmp_path / plan.replace("/", "_") / "m-0000.params"))
    for name in LENET_PARAM_NAMES:
        np.testing.assert_array_equal(models["0/raise:9:1"][f"arg:{name}"].asnumpy(),
                                      models["none"][f"arg:{name}"].asnumpy())


@pytest.mark.slow
def test_an_elastic_job_whose_hosts_stay_the_same_is_never_started_again(tiny, tmp_path):
    """Where it must be false: the discovery script lists the same hosts at every poll (in another order), and the
    job runs once to its end, with nothing taken and no restart."""
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost\n127.0.0.1\n")
    train = [arg for arg in TRAIN[:-4]]
    result = run_job(tmp_path, tiny, "0/grow:4:0/127.0.0.1,localhost", workers="1:2", discovery=hosts, train=train,
                     launcher=["--discovery-interval", "0.2"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "took the state" not in result.stderr and "restart" not in result.stderr, result.stderr[-3000:]
    assert result.stdout.count("] training LeNet") == 1
