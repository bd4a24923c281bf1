"""Tensor parallelism (``--tensor T``, the composed strategy's tensor axis, ``parallel.models.layers``): the ViT's
heads and MLP units split over T contexts by its parallel layers, Megatron's f and g between, data parallelism over
the groups: the groups each layout forms (that each trains the one-context model is ``tests/test_layouts.py``'s),
across the processes of a job, clipping, ZeRO, its collectives by Megatron's count, checkpoints and resumes across
layouts, and the CLI's refusals."""
import json

import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd

from parallel import Reducer
from parallel.comm.replica import block_state
from parallel.comm.tensor import SegmentTape
from parallel.models import init_model
from parallel.optim import SGD, AdamW, memory_table
from parallel.strategies import Hybrid, make_strategy
from parallel.train import main
from conftest import (assert_close_to_scale, contexts, easy_dataset, fast_only, in_threads, make_batches,
                      write_idx_files)

SIZES = (12, 12, 7, 2)   # the last batch leaves the second group idle on 4 contexts


def _train(strategy, optimizer, sizes=SIZES):
    for X, y in make_batches(list(sizes), seed=1):
        strategy.train_step(X, y, optimizer=optimizer)
    return [p.asnumpy() for p in strategy.params()]


@pytest.fixture(scope="module")
def one_context():
    """The ViT trained on one context without tensor parallelism, with momentum SGD."""
    return _train(make_strategy("data", init_model("vit", 0), contexts(1)), SGD(0.05, momentum=0.9))


@pytest.mark.parametrize("tensor, k", [(2, 2), (4, 4), (3, 3), (2, 4)])
def test_tensor_ranks_form_groups_of_the_data_replicas(tensor, k):
    """T = 2, 4 (and 3, whose heads and units split unevenly), and data x tensor (2 groups of 2): one replica a group
    of T ranks. That each trains the one-context model is ``test_layouts.py``'s cells "tensor", "tensor, 4 ranks",
    "tensor, 3 ranks splitting unevenly" and "data x tensor"."""
    strategy = make_strategy("data", init_model("vit", 0), contexts(k), tensor=tensor)
    assert isinstance(strategy, Hybrid) and len(strategy.replicas) == k // tensor


@pytest.mark.parametrize("stages, k", [(2, 4), (2, 8), (3, 6)])
def test_all_three_axes_form_a_group_of_ranks_a_stage_and_replica(stages, k):
    """The hybrid strategy with --tensor: data x pipeline-stages x tensor (8 contexts: 2 replicas x 2 stages x 2
    ranks). That each trains the one-context model is ``test_layouts.py``'s cells "pipeline x tensor",
    "data x pipeline x tensor" and "3 stages x tensor"."""
    strategy = make_strategy("hybrid", init_model("vit", 0), contexts(k), stages, tensor=2)
    assert strategy.name == "hybrid" and len(strategy.ranges) == stages
    assert len(strategy.replicas) == k // (2 * stages) and len(strategy.groups()) == 2 * stages


@pytest.mark.slow   # seconds the fast tier's 150 s budget cannot spare (docs/testing.md)
def test_two_workers_of_tensor_groups_train_the_one_context_model(threads_reduce_at_once, one_context):
    """Across processes (threads standing in for ps-lite): 2 workers, each one group of 2 ranks on contexts of its
    own; each worker trains its slice of the global batch (the last, of 2, leaves worker 1 without an example) and
    each rank's gradients are summed over the workers. Rank 1 starts from another model: rank 0's wins. Both
    workers end with the same model, the one-context model to 1e-5 of its scale."""
    def work(job, rank):
        initial = init_model("vit", 0 if rank == 0 else 7)
        strategy = make_strategy("data", initial, [mx.cpu(2 * rank), mx.cpu(2 * rank + 1)], tensor=2,
                                 reducer=Reducer(job=job))
        assert "over 2 worker(s)" in strategy.describe()
        got = _train(strategy, SGD(0.05, momentum=0.9))
        X, y = make_batches([10], seed=4)[0]
        return got, strategy.evaluate([(X, y)])
    (first, accuracy0), (second, accuracy1) = in_threads(2, work)[0]
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)
    assert accuracy0 == accuracy1
    assert_close_to_scale(first, one_context, 1e-5)


@pytest.mark.parametrize("tensor, k, stages", fast_only([(2, 2, None), (2, 8, 2)], fast={0}))
def test_clipping_counts_the_replicated_arrays_once(tensor, k, stages):
    """Clipping by the global norm: the layer norms, biases and positions every rank holds count once, so the
    clipped model is one context's to rounding (the norm adds its squares in another order)."""
    def clipped(strategy):
        optimizer = SGD(0.05, momentum=0.9, clip_norm=0.5)
        for X, y in make_batches(list(SIZES), seed=1):
            strategy.train_step(X, y, optimizer=optimizer)
        return [p.asnumpy() for p in strategy.params()]
    want = clipped(make_strategy("data", init_model("vit", 0), contexts(1)))
    strategy = make_strategy("data" if stages is None else "hybrid", init_model("vit", 0), contexts(k), stages,
                             tensor=tensor)
    assert strategy.replicas[0][0][1].copies and not strategy.replicas[0][0][0].copies
    assert_close_to_scale(clipped(strategy), want, 1e-5)
    unclipped = _train(make_strategy("data", init_model("vit", 0), contexts(1)), SGD(0.05, momentum=0.9))
    assert max(np.abs(a - b).max() for a, b in zip(unclipped, want)) > 1e-4   # the clip did act


def test_two_workers_of_stages_of_tensor_groups_train_the_one_context_model(threads_reduce_at_once, one_context):
    """All three axes across processes: 2 workers (threads standing in for ps-lite), each one replica of 2 stages of
    2 ranks on 4 contexts of its own; each stage's rank t sums its gradients over the workers under keys of its own.
    The one-context model to 1e-5 of its scale, on both workers."""
    def work(job, rank):
        strategy = make_strategy("hybrid", init_model("vit", 0), [mx.cpu(4 * rank + i) for i in range(4)], 2,
                                 tensor=2, reducer=Reducer(job=job))
        return _train(strategy, SGD(0.05, momentum=0.9))
    first, second = in_threads(2, work)[0]
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)
    assert_close_to_scale(first, one_context, 1e-5)


@pytest.mark.slow   # seconds the fast tier's 150 s budget cannot spare (docs/testing.md)
def test_zero_1_and_2_shard_each_ranks_state_over_the_groups_bitwise():
    """ZeRO-1 and 2 on tensor parallelism: each rank's optimizer state sharded over the groups holding that rank
    (2 groups of 2 ranks: half each); the same model and state, bitwise, as ZeRO-0 on the same layout."""
    from parallel.optim import Adam
    results, tables = {}, {}
    for zero in (0, 1, 2):
        strategy = make_strategy("data", init_model("vit", 0), contexts(4), zero=zero, tensor=2)
        optimizer = Adam(0.01, zero=zero)
        results[zero] = _train(strategy, optimizer)
        state = strategy.gather_state(optimizer)
        results[zero] += [a.asnumpy() for name in sorted(state) for a in state[name]]
        tables[zero] = memory_table(optimizer, strategy.groups())
    for zero in (1, 2):
        for got, want in zip(results[zero], results[0]):
            np.testing.assert_array_equal(got, want)
        for row, whole in zip(tables[zero], tables[0]):
            assert abs(row["optimizer_state"] - whole["optimizer_state"] / 2) <= 4 * 64


def _vit_names():
    """The ViT's structural names (what a checkpoint stores), in its order."""
    from parallel.models import MODELS
    return MODELS["vit"].behaviour.layout().names


def test_the_ranks_hold_their_parts_and_put_the_model_back_together():
    """Each rank holds what the ViT's parallel layers say: its heads' rows of the query/key/value layer, their
    columns of the output projection, its MLP units, its pixels of the patch projection and its classes; the
    replicated arrays whole; the model's arrays put back together bit for bit."""
    net = init_model("vit", 0)
    names, arrays, _, _ = block_state(net)
    strategy = make_strategy("data", net, contexts(2), tensor=2)
    ranks = strategy.replicas[0][0]
    structural = dict(zip(names, _vit_names()))
    shapes = {structural[name]: [dict(zip(rank.names, rank))[name].shape for rank in ranks] for name in names}
    assert shapes["1.attention.qkv.weight"] == [(96, 64), (96, 64)]      # 2 of 4 heads' q, k, v rows each
    assert shapes["1.attention.proj.weight"] == [(64, 32), (64, 32)]     # their columns of the projection
    assert shapes["1.hidden.weight"] == [(64, 64), (64, 64)] and shapes["1.out.weight"] == [(64, 64), (64, 64)]
    assert shapes["0.proj.weight"] == [(64, 25), (64, 24)]               # the 49 pixels of a patch
    assert shapes["5.dense.weight"] == [(5, 64), (5, 64)]                # the 10 classes
    assert shapes["1.norm1.gamma"] == [(64,), (64,)]                     # replicated
    qkv = names[list(structural.values()).index("1.attention.qkv.weight")]
    np.testing.assert_array_equal(dict(zip(ranks[1].names, ranks[1]))[qkv].asnumpy()[:32],
                                  dict(zip(names, arrays))[qkv].asnumpy()[32:64])
    for back, array in zip(strategy.params(), arrays):
        np.testing.assert_array_equal(back.asnumpy(), array.asnumpy())


@pytest.mark.parametrize("tensor, batch, stages", [(2, 8, 1), (4, 6, 1), (3, 5, 1), (2, 8, 2)])
def test_the_collectives_sum_megatrons_count(tensor, batch, stages, monkeypatch):
    """Every tape's f and g sum, over a step, Megatron's 4 L b s h a rank (two allreduces of the activations a
    block forward, two backward) plus the patch projection's b (s - 1) h and the head's b h, on every rank; every
    rank's part of the model gets its gradient (the step moves every array)."""
    summed = []
    backward = SegmentTape.backward

    def recording(tape, *args, **kwargs):
        result = backward(tape, *args, **kwargs)
        summed.append(tape.allreduced)
        return result
    name = "data" if stages == 1 else "hybrid"
    strategy = make_strategy(name, init_model("vit", 0), contexts(tensor * stages), stages if stages > 1 else None,
                             tensor=tensor)
    X, y = make_batches([batch], seed=1)[0]
    before = [p.asnumpy() for p in strategy.params()]
    monkeypatch.setattr(SegmentTape, "backward", recording)
    strategy.train_step(X, y, optimizer=SGD(0.1))
    depth, tokens, dim = 4, 17, 64
    megatron = 4 * depth * batch * tokens * dim + batch * (tokens - 1) * dim + batch * dim
    assert sum(summed) == tensor * megatron
    assert all(not np.array_equal(a.asnumpy(), b) for a, b in zip(strategy.params(), before))


def test_each_rank_keeps_its_part_of_the_model_and_its_state():
    strategy = make_strategy("data", init_model("vit", 0), contexts(4), tensor=2)
    optimizer = AdamW(0.003)
    X, y = make_batches([8], seed=1)[0]
    strategy.train_step(X, y, optimizer=optimizer)
    table = memory_table(optimizer, strategy.groups())
    whole = 4 * sum(p.size for p in strategy.params())
    for row in table:   # each rank about half the model (the replicated arrays whole), its gradient, AdamW's two
        assert whole / 2 < row["parameters"] < 0.6 * whole
        assert row["gradients"] == row["parameters"] and row["optimizer_state"] == 2 * row["parameters"]


@pytest.mark.slow   # resuming on another layout is test_checkpoint.py's
def test_a_checkpoint_moves_between_tensor_and_data_parallel_layouts(tmp_path):
    """Written by --tensor 2 on 4 contexts, resumed on one context without tensor parallelism and on --tensor 4:
    each run as close to the uninterrupted one-context run as float32 rounding of the layouts (1e-5 of the scale
    with momentum); a checkpoint's arrays are the ViT's, by name, whatever the layout."""
    data_dir = write_idx_files(tmp_path, easy_dataset(num_train=48, num_test=16, seed=3))
    common = ["--model", "vit", "--data-dir", str(data_dir), "--batch-size", "16", "--lr", "0.05", "--momentum",
              "0.9", "--no-progress", "--seed", "1"]

    def run(name, *extra):
        assert main(common + ["--checkpoint-dir", str(tmp_path / name), *extra]) == 0
        from parallel.checkpoint import load_checkpoint
        checkpoint = load_checkpoint(str(tmp_path / name))
        return [p.asnumpy() for p in checkpoint.params], checkpoint
    straight, _ = run("straight", "--epochs", "2", "--devices", "cpu:1")
    _, first = run("moved", "--epochs", "1", "--devices", "cpu:4", "--tensor", "2")
    assert first.model == "vit" and first.config["tensor"] == 2 and len(first.params) == 56
    moved, _ = run("moved", "--epochs", "2", "--devices", "cpu:1", "--resume")
    assert_close_to_scale(moved, straight, 1e-5)
    run("moved4", "--epochs", "1", "--devices", "cpu:4", "--tensor", "2")
    again, _ = run("moved4", "--epochs", "2", "--devices", "cpu:4", "--tensor", "4", "--resume")
    assert_close_to_scale(again, straight, 1e-5)
    run("moved3d", "--epochs", "1", "--devices", "cpu:8", "--strategy", "hybrid", "--stages", "2", "--tensor", "2")
    three, _ = run("moved3d", "--epochs", "2", "--devices", "cpu:2", "--resume")
    assert_close_to_scale(three, straight, 1e-5)


@pytest.mark.slow   # seconds the fast tier's 150 s budget cannot spare (docs/testing.md)
def test_the_cli_trains_on_all_three_axes(tmp_path, capsys):
    data_dir = write_idx_files(tmp_path, easy_dataset(num_train=64, num_test=16, seed=3))
    assert main(["--model", "vit", "--data-dir", str(data_dir), "--batch-size", "16", "--epochs", "1",
                 "--devices", "cpu:8", "--strategy", "hybrid", "--stages", "2", "--tensor", "2", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert ("strategy hybrid: 2 replicas x 2 stages x 2 tensor ranks: children 0-2 @ cpu(0),cpu(1),cpu(4),cpu(5) | "
            "3-5 @ cpu(2),cpu(3),cpu(6),cpu(7)") in out
    assert "hybrid parallel on [cpu(0)" in out


@pytest.mark.slow   # seconds the fast tier's 150 s budget cannot spare (docs/testing.md)
def test_the_cli_trains_with_tensor_parallelism_and_says_how(tmp_path, capsys):
    data_dir = write_idx_files(tmp_path, easy_dataset(num_train=64, num_test=16, seed=3))
    metrics = tmp_path / "m.json"
    assert main(["--model", "vit", "--data-dir", str(data_dir), "--batch-size", "16", "--epochs", "1",
                 "--devices", "cpu:4", "--tensor", "2", "--optimizer", "adamw", "--lr", "0.003", "--no-progress",
                 "--metrics-json", str(metrics), "--export", str(tmp_path / "vit")]) == 0
    out = capsys.readouterr().out
    assert "strategy data: 2 replicas x 2 tensor ranks: children 0-5 @ cpu(0),cpu(1),cpu(2),cpu(3)" in out
    memory = json.loads(metrics.read_text())[-1]["memory"]
    assert sorted(row["context"] for row in memory) == [f"cpu({i})" for i in range(4)]
    exported = mx.gluon.SymbolBlock.imports(str(tmp_path / "vit-symbol.json"), ["data"],
                                            str(tmp_path / "vit-0000.params"))
    assert exported(mx.nd.zeros((2, 1, 28, 28))).shape == (2, 10)


@pytest.mark.slow
def test_a_job_of_tensor_groups_trains_the_one_context_model_through_the_cli(tmp_path):
    """python -m parallel.launch -n 2 python -m parallel.train --model vit --devices cpu:2 --tensor 2: 2 workers,
    each a group of 2 ranks, through the launcher's real servers; the exported model is the one-context run's to
    1e-5 of its scale, and its checkpoint resumes in one process on one context."""
    import subprocess
    import sys
    from conftest import start_process, stop_process
    data_dir = write_idx_files(tmp_path, easy_dataset(num_train=48, num_test=16, seed=3))
    args = ["--model", "vit", "--data-dir", str(data_dir), "--batch-size", "16", "--lr", "0.05", "--momentum",
            "0.9", "--seed", "1", "--no-progress", "--epochs", "2"]
    process = start_process([sys.executable, "-m", "parallel.launch", "-n", "2", "-s", "2", "--stall-timeout", "120",
                             sys.executable, "-m", "parallel.train", *args, "--devices", "cpu:2", "--tensor", "2",
                             "--checkpoint-dir", str(tmp_path / "job")], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        out, err = process.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        stop_process(process, grace=60)
        raise
    assert process.returncode == 0, err[-3000:]
    assert "over 2 worker(s)" in out
    assert main(args + ["--devices", "cpu:1", "--checkpoint-dir", str(tmp_path / "one")]) == 0
    from parallel.checkpoint import load_checkpoint
    job = [p.asnumpy() for p in load_checkpoint(str(tmp_path / "job")).params]
    one = [p.asnumpy() for p in load_checkpoint(str(tmp_path / "one")).params]
    assert_close_to_scale(job, one, 1e-5)
    assert main(args[:-1] + ["3", "--devices", "cpu:1", "--checkpoint-dir", str(tmp_path / "job"), "--resume"]) == 0


@pytest.mark.parametrize("extra, says", [
    (["--tensor", "2"], "--tensor 2 splits layers made of parallel layers (attention heads, MLP units); LeNet has "
                        "none: use --model vit or transformer"),
    (["--model", "vit", "--tensor", "8", "--devices", "cpu:8"], "--tensor 8 ranks cannot split ViT's 4 attention"),
    (["--model", "vit", "--tensor", "2", "--devices", "cpu:3"],
     "3 contexts in --devices cannot form equal groups of --tensor 2; use a multiple of 2 contexts"),
    (["--model", "vit", "--tensor", "2", "--strategy", "hybrid", "--devices", "cpu:6"],
     "6 contexts in --devices cannot form equal groups of 2 --stages of --tensor 2; use a multiple of 4 contexts"),
    (["--model", "vit", "--tensor", "0"], "--tensor must be"),
])
def test_cli_refuses_what_tensor_parallelism_does_not_do_with_one_line(extra, says, tmp_path, capsys):
    data_dir = write_idx_files(tmp_path, easy_dataset(num_train=32, num_test=8, seed=3))
    args = ["--data-dir", str(data_dir), "--epochs", "1", "--batch-size", "8", "--no-progress"]
    if "--devices" not in extra:
        args += ["--devices", "cpu:2"]
    assert main(args + extra) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and says in err and len(err.splitlines()) == 1, err
