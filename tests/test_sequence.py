"""Sequence parallelism (issue 39, Korthikanti et al. 2022): with tensor parallelism, the layer norms and the
residual stream split along the sequence over each tensor group; the blocks' collectives the same bytes as tensor
parallelism's, the activations of those regions 1/T a context, ZeRO-3's sums. That it trains the one-context model
(and so tensor parallelism's) is ``tests/test_layouts.py``'s cells "sequence x tensor", "sequence x tensor, 4 ranks"
and the compositions.
"""
import json

import mxnet as mx
import numpy as np
import pytest

from parallel import Layout
from parallel.comm import algorithms
from parallel.comm.algorithms import chunk_bounds
from parallel.models.plan import Plan, plan_of
from parallel.models.vit import init_vit
from parallel.optim import SGD
from parallel.strategies import make_strategy
from parallel.train import main
from conftest import assert_close_to_scale, assert_refused, contexts, easy_dataset, write_idx_files

N, S, D = 8, 17, 64   # a batch's examples, the ViT's tokens, its width


def _batch(n=N):
    rng = np.random.RandomState(2)
    return mx.nd.array(rng.normal(size=(n, 1, 28, 28))), mx.nd.array(rng.randint(0, 10, n))


def _trained(layout, k, steps=3):
    strategy = make_strategy(layout, init_vit(0), contexts(k))
    optimizer = SGD(0.05, momentum=0.9, zero=layout.zero)
    X, y = _batch()
    for _ in range(steps):
        strategy.train_step(X, y, optimizer=optimizer)
    return strategy, [p.asnumpy() for p in strategy.params()]


@pytest.mark.slow   # the matrix's sequence x ZeRO-3 cell fails without it
def test_with_zero_3_each_block_s_slices_are_summed_before_its_reduce_scatter(monkeypatch):
    """ZeRO-3 (2 replicas x 2 ranks): each block's sequence-parallel arrays (layer norms, row-parallel biases) summed
    over the ranks in the gathered gradient buffers, before the block is reduce-scattered, trains the model
    sequence parallelism trains without ZeRO-3; without those sums it does not (each rank's slice alone)."""
    _, want = _trained(Layout(tensor=2, sequence=True), 4)
    strategy, got = _trained(Layout(tensor=2, sequence=True, zero=3), 4)
    assert_close_to_scale(got, want, 1e-5)
    assert "ZeRO-3" in strategy.describe() and "sequence parallel" in strategy.describe()
    # the plan names no array of the sequence region (a name none has): nothing is summed over the ranks
    monkeypatch.setattr(Plan, "summed", lambda self, net: ["(no array)"])
    _, unsummed = _trained(Layout(tensor=2, sequence=True, zero=3), 4)
    assert max(np.abs(a - b).max() / np.abs(b).max() for a, b in zip(unsummed, want)) > 1e-3


def test_fit_counts_the_activations_of_each_epoch_s_last_step_alone():
    """Counting what a forward keeps costs three calls into MXNet an array, every step: ``fit`` counts only each
    epoch's last step (the one its memory table reads), and leaves the strategy counting as it found it. Without
    counting, a step counts nothing."""
    from parallel import fit
    from parallel.config import RunConfig
    strategy = make_strategy(Layout(tensor=2, sequence=True), init_vit(0), contexts(2))
    seen = []
    fit(easy_dataset(num_train=24, num_test=8, seed=1), strategy, SGD(0.01), RunConfig(epochs=1, batch_size=8, progress=False),
        on_step=lambda epoch, batch: seen.append(strategy.activations()))
    assert [bool(counted) for counted in seen] == [False, False, True]   # 3 steps: the last one counted
    assert strategy.count_activations(False) is True   # fit left it counting, as made
    X, y = _batch()
    strategy.train_step(X, y, optimizer=SGD(0.01))
    assert strategy.activations() == {}
    assert strategy.count_activations(True) is False


@pytest.mark.parametrize("T", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_the_replicated_regions_activations_drop_to_each_rank_s_slice(T):
    """Tensor parallelism keeps each block's input, middle and output (the layer norms' inputs, the residual
    stream) whole on every rank: 3 x 4 blocks x N x 17 x 64 floats; sequence parallelism keeps rank t its slice of
    the 17 tokens (9 and 8 of them on 2 ranks), and less in all."""
    tensor, _ = _trained(Layout(tensor=T), T, steps=1)
    sequence, _ = _trained(Layout(tensor=T, sequence=True), T, steps=1)
    whole = 3 * 4 * N * S * D * 4
    bounds = chunk_bounds(S, T)
    for t, ctx in enumerate(contexts(T)):
        assert tensor.activations()[ctx]["replicated"] == whole
        assert sequence.activations()[ctx]["replicated"] == whole * (bounds[t + 1] - bounds[t]) // S
        assert sequence.activations()[ctx]["total"] < tensor.activations()[ctx]["total"]


@pytest.mark.parametrize("T", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_the_blocks_collectives_move_the_bytes_tensor_parallelism_moves(T):
    """A step's copies with sequence parallelism are tensor parallelism's plus what only it does: the embedding's
    split (its backward all-gathers the tokens' gradients), the head's all-gather of the tokens, and the sum of the
    blocks' layer norms' and biases' gradients over the ranks. So each block's all-gathers and reduce-scatters
    move what its f and g's allreduces move."""
    moved = {}
    for sequence in (False, True):
        strategy = make_strategy(Layout(tensor=T, sequence=sequence), init_vit(0), contexts(T))
        X, y = _batch()
        strategy.train_step(X, y, optimizer=SGD(0.1))
        mx.nd.waitall()
        before = algorithms.copied_bytes()
        strategy.train_step(X, y, optimizer=SGD(0.1))
        mx.nd.waitall()
        moved[sequence] = algorithms.copied_bytes() - before
    net = init_vit(0)
    names = set(plan_of(net).summed(net))
    summed = sum(p.data().size for p in net.collect_params().values() if p.name in names)
    assert len(names) == 4 * 6   # each block's two layer norms (scale, shift) and two row-parallel biases
    extra = 2 * (T - 1) * N * S * D * 4 + algorithms.bytes_moved("fused", summed * 4, T).total
    assert moved[True] - moved[False] == extra


def test_a_model_without_a_plan_is_refused():
    """A block of parallel layers that no model's plan knows (``parallel.models.plan.PLANS``), given to the
    strategy: it has no sequence region (the layout's own refusal of a model without one is ``test_layouts.py``'s)."""
    from parallel.models.layers import ColumnParallelDense, RowParallelDense
    net = mx.gluon.nn.HybridSequential(prefix="plain_")
    with net.name_scope():
        net.add(ColumnParallelDense(8, in_units=784), RowParallelDense(10, in_units=8))
    net.initialize(mx.init.Xavier(), ctx=mx.cpu())
    net(mx.nd.zeros((1, 1, 28, 28)))
    with pytest.raises(ValueError, match="no such blocks in its plan"):
        make_strategy(Layout(tensor=2, sequence=True), net, contexts(2))


@pytest.mark.slow   # seconds the fast tier's 150 s budget cannot spare (docs/testing.md)
def test_the_cli_records_the_activations_each_context_keeps(tmp_path, capsys):
    """Batches of 32 (64 examples, 2 batches an epoch): what each context keeps of a batch's activations."""
    data_dir = write_idx_files(tmp_path, easy_dataset(num_train=64, num_test=16, seed=1))
    metrics = tmp_path / "m.json"
    assert main(["--model", "vit", "--tensor", "2", "--sequence-parallel", "--devices", "cpu:2", "--data-dir",
                 str(data_dir), "--epochs", "1", "--batch-size", "32", "--no-progress", "--metrics-json",
                 str(metrics)]) == 0
    assert "sequence parallel: layer norms and the residual stream split" in capsys.readouterr().out
    rows = json.loads(metrics.read_text())[0]["memory"]
    replicated = [row["activations"]["replicated"] for row in rows]
    assert replicated == [3 * 4 * 32 * 9 * D * 4, 3 * 4 * 32 * 8 * D * 4]   # 9 and 8 of the 17 tokens
    assert all(row["activations"]["total"] > row["activations"]["replicated"] for row in rows)
    assert main(["--model", "vit", "--tensor", "2", "--sequence-parallel", "--zero", "3", "--devices", "cpu:4",
                 "--data-dir", str(data_dir), "--epochs", "1", "--batch-size", "32", "--no-progress"]) == 0
    assert "ZeRO-3" in capsys.readouterr().out


@pytest.mark.parametrize("flags, says", [
    (["--sequence-parallel"], "give --tensor 2 or more"),
    (["--sequence-parallel", "--tensor", "2", "--devices", "cpu:2", "--model", "resnet18"],
     "use --model vit or transformer"),
])
def test_bad_sequence_flags_get_one_line_and_status_2(flags, says, easy_dir, capsys):
    status = main(["--model", "vit", "--data-dir", str(easy_dir), "--epochs", "1", "--no-progress", *flags])
    assert_refused(status, capsys, says)


@pytest.mark.slow   # the matrix's timeline column runs sequence x tensor in the fast tier
def test_a_traced_sequence_parallel_step_names_its_collectives_truly():
    """A step traced (``parallel.trace``): every label holds (``labels_hold``), the sequence-parallel collectives
    and the sums over the ranks are named ``tensor``. A trace bracket that named the gradients' views into one
    buffer twice hung the step forever (the engine never runs such an operation)."""
    from parallel import trace
    from conftest import labels_hold
    strategy = make_strategy(Layout(tensor=2, sequence=True), init_vit(0), contexts(2))
    X, y = _batch()
    strategy.train_step(X, y, optimizer=SGD(0.1))
    with trace(contexts=strategy.ctx_list) as recorded:
        strategy.train_step(X, y, optimizer=SGD(0.1))
    labels_hold(recorded.result)
    issued = {e["name"] for e in recorded.result.events if e.get("tid") == 1 and e.get("ph") == "X"}
    assert {"tensor all-gather", "tensor reduce-scatter", "tensor sequence-parallel sums"} <= issued, issued
