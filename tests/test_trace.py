"""Timelines of steps (``parallel.trace``, ``fit(trace=)``, ``--trace``): a lane per context whose events run
forward, backward, allreduce, update, in that order, in a Chrome trace and its plot."""
import json
import os
import sys

import pytest

from parallel import Reducer, get_params, init_lenet_params, plot_timeline, read_trace, trace, train_batch
from parallel.compress import make_codec
from parallel.optim import make_optimizer
from parallel.trace import PHASES, check_traceable, worker_path
from parallel.train import main
from conftest import (contexts, easy_dataset, fast_only, labels_hold, make_batches, run_process, trace_brackets,
                      trace_operators, write_idx_files)


def phases_in_order(phases):
    """Whether a lane's phases (its operators' ``cat``, in time order) hold a forward, a backward and an update, the
    first forward before the last backward and the last backward before the last update. (The first backward may
    come before the first forward: the backward of the loss's mean and pick needs none of the forward's values, and
    MXNet runs an operator once its inputs are ready.)"""
    if not {"forward", "backward", "update"} <= set(phases):
        return False
    last = {phase: len(phases) - 1 - phases[::-1].index(phase) for phase in ("backward", "update")}
    return phases.index("forward") < last["backward"] < last["update"]


def _phases_in_order(timeline, lanes, reduces=True):
    """Every lane's operators are named by a phase, or by themselves (phase other), in order
    (``phases_in_order``); it has a bucket's reduction (an issued allreduce bracket) before its last update; every
    label holds (``labels_hold``)."""
    assert timeline.lanes == lanes
    for lane in range(len(lanes)):
        events = trace_operators(timeline, lane)
        phases = [e["cat"] for e in events]
        assert set(phases) <= set(PHASES), phases
        assert phases_in_order(phases), (lanes[lane], phases)
        sums = [b["ts"] for b in trace_brackets(timeline, lane) if b["cat"] == "allreduce"]
        assert not reduces or (sums and min(sums) < max(e["ts"] for e in events if e["cat"] == "update"))
        assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in events)
    labels_hold(timeline)


@pytest.mark.parametrize("compression", [None, pytest.param("topk:0.05", marks=pytest.mark.slow)])
def test_a_traced_step_has_a_lane_per_context_in_step_order(compression, tmp_path):
    ctx = contexts(2)
    device_params = [get_params(init_lenet_params(), c) for c in ctx]
    optimizer = make_optimizer("sgd", 0.1, momentum=0.9)
    compressor = make_codec(compression) if compression else None
    batches = make_batches([32] * 3)
    train_batch(*batches[0], device_params, ctx, optimizer=optimizer, reducer=Reducer(compression=compressor))
    for i, (X, y) in enumerate(batches[1:]):   # twice: MXNet's profiler is configured once per process
        with trace(tmp_path / f"step{i}.json") as recorded:
            train_batch(X, y, device_params, ctx, optimizer=optimizer, reducer=Reducer(compression=compressor))
        _phases_in_order(recorded.result, ["cpu(0)", "cpu(1)"])
        written = read_trace(tmp_path / f"step{i}.json")
        assert written.events == json.loads(json.dumps(recorded.result.events))
        ops = [e["args"]["op"] for e in written.events if e.get("ph") == "X" and e["tid"] == 0]
        assert ops.count("sgd_mom_update") == 2   # one update a context: this block's step alone
    figure = plot_timeline(written, tmp_path / "step.png")
    assert (tmp_path / "step.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [t.get_text() for t in figure.axes[0].get_yticklabels()] == ["cpu(0)", "cpu(1)"]


#: A trace in a process whose MXNet profiler was configured and used before (as benchmarks/profile_step.py does):
#: MXNet then writes neither the head of its JSON nor the labels of its slots into the trace's file.
_AFTER_ANOTHER_PROFILE = """
import json, sys, mxnet as mx
sys.path.insert(0, "tests")
from conftest import make_batches
from parallel import get_params, init_lenet_params, trace, train_batch
mx.profiler.set_config(profile_all=True, aggregate_stats=True, filename=sys.argv[1] + "/other.json")
mx.profiler.set_state("run")
(mx.nd.ones((4, 4)) * 2).wait_to_read()
mx.profiler.set_state("stop")
mx.profiler.dumps(reset=True)
ctx = [mx.cpu(0), mx.cpu(1)]
device_params = [get_params(init_lenet_params(), c) for c in ctx]
X, y = make_batches([32])[0]
with trace(sys.argv[1] + "/step.json", contexts=ctx):
    train_batch(X, y, device_params, ctx, 0.1)
"""


@pytest.mark.slow   # a second profiler user: the lanes' names are the fast tests'
def test_a_trace_after_another_use_of_the_profiler_still_names_its_lanes(tmp_path):
    result = run_process([sys.executable, "-c", _AFTER_ANOTHER_PROFILE, str(tmp_path)], timeout=120,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert result.returncode == 0, result.stderr[-3000:]
    _phases_in_order(read_trace(tmp_path / "step.json"), ["cpu(0)", "cpu(1)"])


def test_lanes_follow_the_contexts_given(tmp_path):
    ctx = contexts(2)
    device_params = [get_params(init_lenet_params(), c) for c in ctx]
    X, y = make_batches([32])[0]
    train_batch(X, y, device_params, ctx, 0.1)
    with trace(contexts=ctx[::-1]) as recorded:
        train_batch(X, y, device_params, ctx, 0.1)
    _phases_in_order(recorded.result, ["cpu(1)", "cpu(0)"])


def test_contexts_the_profiler_cannot_record_are_refused(capsys):
    import mxnet as mx
    cpus = len(os.sched_getaffinity(0))
    check_traceable([mx.cpu(i) for i in range(cpus)])
    with pytest.raises(ValueError, match=rf"cpu\(0\)..cpu\({cpus - 1}\) on this machine's {cpus} processors, "
                                         rf"not cpu\({cpus}\)"):
        trace(contexts=[mx.cpu(0), mx.cpu(cpus)]).__enter__()
    with trace():   # the refusal left the profiler free
        pass
    assert main(["--dataset", "synthetic", "--epochs", "1", "--devices", f"cpu:{cpus + 2}", "--no-progress",
                 "--trace", "steps.json"]) == 2   # cpu(N + 2) would abort the process inside MXNet
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--trace: MXNet's profiler records CPU contexts" in err, err


def test_one_trace_at_a_time():
    with trace():
        with pytest.raises(RuntimeError, match="already recording"):
            trace().__enter__()


def test_a_bracket_builds_nothing_while_no_trace_records():
    """The trace's brackets and marks take functions of their arrays (and, for a bracket, may take its label and
    details' values as functions) and call none of them while nothing records, so a step that nothing observes
    builds none of their arguments; a list is refused, since it would be built every step. (While a trace records
    they are called: every test above that checks a trace's labels.)"""
    import mxnet as mx
    from parallel.trace import collective, issued, mark_forward_each, mark_recompute
    called = []

    def arrays():
        called.append("arrays")
        return [mx.nd.ones((1,))]

    with issued("update", arrays, lambda: called.append("label"), bytes=lambda: called.append("bytes")) as made:
        made.append(mx.nd.zeros((1,)))
    with collective("gather", lambda: [arrays()]):
        pass
    mark_forward_each(arrays)
    mark_recompute(arrays)
    assert called == []
    for bracket, name in ((lambda: issued("update", [mx.nd.ones((1,))]).__enter__(), "arrays"),
                          (lambda: collective("gather", [[mx.nd.ones((1,))]]), "arrays"),
                          (lambda: mark_forward_each([mx.nd.ones((1,))]), "arrays"),
                          (lambda: mark_recompute([mx.nd.ones((1,))]), "buffers")):
        with pytest.raises(TypeError, match=f"^{name} must be a function returning the arrays"):
            bracket()


def test_worker_paths():
    class Job:
        rank, num_workers = 1, 2
    assert worker_path("run/step.json", Job()) == "run/step.rank1.json"
    assert worker_path("step.json", None) == "step.json"


def test_the_cli_writes_a_trace_of_steps_2_to_4(tmp_path, capsys):
    data_dir = write_idx_files(tmp_path, easy_dataset(num_train=200, num_test=50, seed=4))
    path = tmp_path / "steps.json"
    assert main(["--data-dir", str(data_dir), "--epochs", "1", "--devices", "cpu:2", "--batch-size", "32",
                 "--no-progress", "--trace", str(path)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (f"trace written to {path}: open it in Perfetto "
                                                        "(ui.perfetto.dev) or chrome://tracing")
    timeline = read_trace(path)
    _phases_in_order(timeline, ["cpu(0)", "cpu(1)"])
    ops = [e["args"]["op"] for e in timeline.events if e.get("ph") == "X" and e["tid"] == 0]
    assert ops.count("sgd_update") == 3 * 2


@pytest.mark.parametrize("layout", fast_only([["--strategy", "model"],
                                              ["--strategy", "pipeline", "--micro-batches", "2"]], fast={1}))
def test_model_and_pipeline_traces_name_their_backward_pass(layout, tmp_path):
    """Their LeNet stages run an imperative backward pass, in bulks MXNet names ImperativeBulk, which the trace
    dropped: every event was forward (or load, update). Each stage's lane now has backward events after its
    forward ones and before its last update."""
    data_dir = write_idx_files(tmp_path, easy_dataset(num_train=128, num_test=32, seed=4))
    path = tmp_path / "steps.json"
    assert main(["--data-dir", str(data_dir), "--epochs", "1", "--devices", "cpu:2", "--batch-size", "32",
                 "--no-progress", "--trace", str(path), *layout]) == 0
    timeline = read_trace(path)
    assert timeline.lanes == ["cpu(0)", "cpu(1)"]
    for lane in (0, 1):
        names = [e["cat"] for e in trace_operators(timeline, lane)]
        assert phases_in_order(names), names
        assert "allreduce" not in names + [b["cat"] for b in trace_brackets(timeline, lane)]   # one replica sums nothing
    labels_hold(timeline)
    sends = [e for e in timeline.events if e.get("ph") == "X" and e["cat"] == "send"]
    assert {e["tid"] for e in sends} == {0, 1}   # the stages' copies, in the brackets the strategy queued


@pytest.mark.parametrize("examples, steps", [pytest.param(20, 1, marks=pytest.mark.slow), (64, 2)])
def test_a_run_shorter_than_the_traced_steps_traces_what_it_ran(examples, steps, tmp_path, capsys):
    """A run of fewer than 4 steps wrote no trace (one step: nothing at all, and no word of it)."""
    data_dir = write_idx_files(tmp_path, easy_dataset(num_train=examples, num_test=10, seed=4))
    path = tmp_path / "steps.json"
    assert main(["--data-dir", str(data_dir), "--epochs", "1", "--devices", "cpu:2", "--batch-size",
                 str(min(32, examples)), "--no-progress", "--trace", str(path)]) == 0   # 1 step of 20, or 2 of 32
    assert capsys.readouterr().out.splitlines()[-1] == (f"trace written to {path}: open it in Perfetto "
                                                        "(ui.perfetto.dev) or chrome://tracing")
    timeline = read_trace(path)
    _phases_in_order(timeline, ["cpu(0)", "cpu(1)"])
    updates = [e["args"]["op"] for e in timeline.events if e.get("ph") == "X" and e["tid"] == 0].count("sgd_update")
    assert updates == 2   # one step on each context: the only one, or the second


def test_an_empty_trace_path_exits_2(capsys):
    assert main(["--dataset", "synthetic", "--epochs", "1", "--trace", ""]) == 2
    assert "--trace needs a path" in capsys.readouterr().err


@pytest.mark.slow
def test_each_worker_of_a_job_writes_its_lanes(tmp_path):
    data_dir = write_idx_files(tmp_path, easy_dataset(num_train=200, num_test=50, seed=4))
    result = run_process([sys.executable, "-m", "parallel.launch", "-n", "2", sys.executable, "-m", "parallel.train",
                          "--data-dir", str(data_dir), "--epochs", "1", "--devices", "cpu:2", "--batch-size", "32",
                          "--no-progress", "--compression", "fp16", "--trace", "steps.json"], timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):
        _phases_in_order(read_trace(tmp_path / f"steps.rank{rank}.json"),
                         [f"rank {rank} cpu(0)", f"rank {rank} cpu(1)"])


@pytest.mark.slow   # the matrix's timeline column runs ZeRO-3 with recomputation in the fast tier
@pytest.mark.parametrize("prefetch", [False, True])
def test_a_zero_3_step_names_its_gathers_recomputations_and_reduce_scatters(prefetch):
    """ZeRO-3's copies were named load, forward or allreduce and its recomputed forward backward; each lane now has
    a gather before each block's forward, then the last block's backward, its reduce-scatter, and for each block
    before it a gather, the recomputed forward and its backward. The engine runs what is ready, so an operator at
    a boundary may take its neighbour's name, or none while two brackets are open (a gather's copies while the
    metrics' bracket is): the order is checked on the phases' median positions, the gathers by their brackets."""
    import statistics
    from parallel.optim import SGD
    from parallel.strategies import FullyShardedDataParallel
    from conftest import small_resnet
    strategy = FullyShardedDataParallel(small_resnet(), contexts(2), prefetch=prefetch)
    optimizer = SGD(0.1, zero=3)
    X, y = make_batches([24], seed=3)[0]
    strategy.train_step(X, y, optimizer=optimizer)   # the graphs built before the trace
    with trace(contexts=strategy.ctx_list) as recorded:
        strategy.train_step(X, y, optimizer=optimizer)
    n = len(strategy.blocks)
    labels_hold(recorded.result)
    for lane in (0, 1):
        names = [e["cat"] for e in trace_operators(recorded.result, lane)]
        where = {p: statistics.median(i for i, name in enumerate(names) if name == p)
                 for p in ("forward", "recompute", "reduce-scatter", "update")}
        assert where["forward"] < where["recompute"] < where["update"], where
        assert where["forward"] < where["reduce-scatter"] < where["update"], where
        assert names.count("update") == 1 and "backward" in names
        # a gather before each block's forward and before each recomputation: all but the last block's, and with
        # prefetch the one before it too, whose buffers still hold them
        gathers = [e for e in trace_brackets(recorded.result, lane) if e["cat"] == "gather"]
        assert len(gathers) == 2 * n - (2 if prefetch else 1), gathers


@pytest.mark.slow   # seconds the fast tier's 150 s budget cannot spare (docs/testing.md)
def test_the_sums_of_micro_batches_are_metrics_not_an_update():
    """The step's sum over its micro-batches ran unmarked, so the engine could run it inside the update's bracket
    (its ``add_n`` is one an update runs): under load, a ZeRO-3 lane showed three update operators. The sum is now a
    metrics bracket of its own, one more than the micro-batches', and one micro-batch's sums are not added again."""
    from parallel import init_lenet_params
    from parallel.optim import SGD
    from parallel.strategies import FullyShardedDataParallel
    X, y = make_batches([16], seed=3)[0]
    for accumulate in (1, 2):
        strategy, optimizer = FullyShardedDataParallel(init_lenet_params(seed=0), contexts(2)), SGD(0.1, zero=3)
        strategy.train_step(X, y, optimizer=optimizer, accumulate=accumulate)
        with trace(contexts=strategy.ctx_list) as recorded:
            strategy.train_step(X, y, optimizer=optimizer, accumulate=accumulate)
        labels_hold(recorded.result)
        metrics = [e for e in trace_brackets(recorded.result, 0) if e["cat"] == "metrics"]
        assert len(metrics) == (accumulate + 1 if accumulate > 1 else 1), metrics
        update = [e["args"]["op"] for e in trace_operators(recorded.result, 0) if e["cat"] == "update"]
        assert update and not any(op.startswith("add_n") for op in update), update


@pytest.mark.slow   # the CLI's flag: ZeRO-3's names are test_a_zero_3_step_names_its_...'s
def test_the_cli_traces_zero_3(tmp_path):
    data_dir = write_idx_files(tmp_path, easy_dataset(num_train=128, num_test=32, seed=4))
    path = tmp_path / "steps.json"
    assert main(["--data-dir", str(data_dir), "--epochs", "1", "--devices", "cpu:2", "--batch-size", "32",
                 "--no-progress", "--trace", str(path), "--zero", "3"]) == 0
    timeline = read_trace(path)
    labels_hold(timeline)
    for lane in (0, 1):
        names = {e["cat"] for e in trace_operators(timeline, lane)}
        assert {"gather", "forward", "recompute", "backward", "reduce-scatter", "update"} <= names, names
    figure = plot_timeline(timeline)
    assert "reduce-scatter" in [t.get_text() for t in figure.legends[0].get_texts()]


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["--allreduce", "ring"], ["--compression", "2bit"], ["--compression", "powersgd:2"],
                                    ["--zero", "1"], ["--zero", "2"], ["--accumulate", "2"], ["--clip-norm", "1"],
                                    ["--strategy", "pipeline", "--schedule", "1f1b", "--micro-batches", "4"],
                                    ["--model", "vit", "--tensor", "2"]])
def test_every_label_holds_on_every_layout(layout, tmp_path):
    """Each layout's issuers bracket their work: every operator named after one ran inside its bracket and is one
    it runs; the layout's own collectives are there by name."""
    data_dir = write_idx_files(tmp_path, easy_dataset(num_train=128, num_test=16, seed=4))
    path = tmp_path / "steps.json"
    assert main(["--data-dir", str(data_dir), "--epochs", "1", "--devices", "cpu:2", "--batch-size", "32",
                 "--no-progress", "--trace", str(path), *layout]) == 0
    timeline = read_trace(path)
    labels_hold(timeline)
    kinds = {e["cat"] for e in timeline.events if e.get("ph") == "X" and e["tid"] == 1}
    expected = {"--zero": {"1": {"allreduce", "gather"}, "2": {"reduce-scatter", "gather"}}.get(layout[-1]),
                "--strategy": {"send"}, "--model": {"tensor"}}.get(layout[0], {"allreduce"})
    assert expected <= kinds and {"load", "forward", "update"} <= kinds, kinds


_SAME_ARRAY_TWICE = """
import mxnet as mx
from parallel.trace import issued, trace
a = mx.nd.ones((2,))
with trace():
    with issued("metrics", lambda: [a, a]) as made:
        made += [a, a * 2]
print("done")
"""


@pytest.mark.slow   # seconds the fast tier's 150 s budget cannot spare (docs/testing.md)
def test_a_bracket_names_each_array_once():
    """An engine operation that names an array twice is never run (MXNet's engine waits forever): the metrics'
    bracket named a shard's sum twice on one context and the trace never ended. The marks name each array once."""
    result = run_process([sys.executable, "-c", _SAME_ARRAY_TWICE], timeout=60,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert result.returncode == 0 and result.stdout.strip() == "done", result.stderr[-2000:]


@pytest.mark.parametrize("end, status", [("pass", 0), ("from parallel.job import abandon; abandon(3)", 3),
                                         ("from parallel.interrupt import _exit_at_once; _exit_at_once()", 130)])
def test_a_traced_process_leaves_nothing_in_the_temporary_directory(tmp_path, end, status):
    """MXNet's profiler writes to a temporary file, read and removed at the end of each trace (79 of them, 1.7 MB
    each, once piled up in /tmp): nothing is left when the process ends, also by ``os._exit`` (a worker that
    abandons the job or is interrupted, pytest-xdist's workers: three to four a CI run were left so)."""
    code = ("import os, mxnet as mx; from parallel.trace import trace\n"
            "for _ in range(2):\n"
            "    with trace(None):\n        (mx.nd.ones((3,)) * 2).wait_to_read()\n"
            "    print(os.listdir(os.environ['TMPDIR']), flush=True)\n"
            + end)
    result = run_process([sys.executable, "-c", code], timeout=120, env=dict(os.environ, TMPDIR=str(tmp_path)))
    assert result.returncode == status, result.stderr
    assert result.stdout.split() == ["[]", "[]"]   # each trace read its events and removed the file
    assert list(tmp_path.iterdir()) == []
