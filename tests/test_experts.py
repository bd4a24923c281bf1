"""A mixture of experts and expert parallelism (issue 39): the router and its capacity, the layer against a plain
reference, the all-to-all's bytes against their formula, and expert parallelism on 2 and 4 contexts training the
one-context model (the same tokens dropped), with ZeRO and across checkpoints of another degree.
"""
import json
import math

import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd

from parallel import Layout
from parallel.comm import algorithms
from parallel.models.moe import Experts, MoEFeedForward, aux_losses, capacity_of, expert_specs, route
from parallel.models.vit import init_vit
from parallel.optim import SGD
from parallel.strategies import make_strategy
from parallel.strategies import Hybrid
from parallel.train import main
from conftest import (assert_close_to_scale, assert_refused, contexts, diagonal, easy_dataset, fast_only,
                      write_idx_files)

E = 4


def _batches(sizes=(16, 16, 8), dtype="float32", seed=3):
    rng = np.random.RandomState(seed)
    return [(mx.nd.array(rng.normal(size=(n, 1, 28, 28)), dtype=dtype), mx.nd.array(rng.randint(0, 10, n)))
            for n in sizes]


def _train(strategy, batches, zero=0):
    optimizer = SGD(0.05, momentum=0.9, zero=zero)
    dropped = []
    for X, y in batches:
        strategy.train_step(X, y, optimizer=optimizer)
        dropped.append([s.routing.slot.copy() for s in strategy.routing()])
    return [p.asnumpy() for p in strategy.params()], dropped


# ---- the router -----------------------------------------------------------------------------------------------

def test_route_queues_first_choices_in_token_order_and_drops_past_capacity():
    probs = np.array([[0.6, 0.3, 0.1], [0.5, 0.4, 0.1], [0.2, 0.7, 0.1], [0.7, 0.2, 0.1]])
    one = route(probs, top_k=1, capacity=2)
    assert one.choice[:, 0].tolist() == [0, 0, 1, 0]
    assert one.slot[:, 0].tolist() == [0, 1, 0, -1]   # the third token for expert 0 is past its capacity
    assert one.routed.tolist() == [3, 1, 0] and one.first.tolist() == [3, 1, 0]
    two = route(probs, top_k=2, capacity=3)
    # every first choice queues before any second: token 3's first (expert 0, place 2) before token 0's second
    assert two.choice.tolist() == [[0, 1], [0, 1], [1, 0], [0, 1]]
    assert two.slot.tolist() == [[0, 1], [1, 2], [0, -1], [2, -1]]
    assert two.routed.tolist() == [4, 4, 0]


def test_route_in_another_queue_order_is_by_row_and_drops_by_that_order():
    """Context groups hold each example's tokens in slices, so the replicas' rows are not one context's queue:
    ``route(..., order)`` queues the rows in ``order`` and answers by row. With a capacity that drops, the order
    decides which choice is dropped."""
    probs = np.array([[0.6, 0.3, 0.1], [0.5, 0.4, 0.1], [0.2, 0.7, 0.1], [0.7, 0.2, 0.1]])
    order = np.array([3, 1, 0, 2])
    by_row = route(probs, top_k=1, capacity=2, order=order)
    queued = route(probs[order], top_k=1, capacity=2)
    rows = np.argsort(order)
    assert by_row.choice.tolist() == queued.choice[rows].tolist() and by_row.slot.tolist() == queued.slot[rows].tolist()
    assert by_row.slot[:, 0].tolist() == [-1, 1, 0, 0]   # token 0 now queues third for expert 0: dropped
    assert by_row.slot[:, 0].tolist() != route(probs, top_k=1, capacity=2).slot[:, 0].tolist()
    assert by_row.routed.tolist() == route(probs, 1, 2).routed.tolist()   # the counts do not depend on the order


def test_route_breaks_ties_to_the_lower_expert_and_capacity_rounds_up():
    assert route(np.full((2, 3), 1 / 3), 1, 5).choice[:, 0].tolist() == [0, 0]
    assert capacity_of(tokens=10, experts=4, top_k=1, capacity_factor=1.0) == 3
    assert capacity_of(tokens=10, experts=4, top_k=2, capacity_factor=1.25) == 7


# ---- the layer ------------------------------------------------------------------------------------------------

def _vit_holding(arrays):
    """A ViT with experts (another seed's) given the trained ``arrays`` (a strategy's ``params()``, the model's
    order), as a run resumed from a checkpoint starts: the model a strategy of another layout is made of."""
    block = init_vit(1, experts=E)
    trained = [p for p in block.collect_params().values() if p.grad_req != "null"]
    assert len(trained) == len(arrays)
    for param, array in zip(trained, arrays):
        param.set_data(mx.nd.array(array, dtype=array.dtype))
    return block


def _reference(layer, X, gate_scale=1.0):
    """The layer by its definition, token by token in float64: each chosen expert's MLP weighted by its gate (times
    ``gate_scale``), nothing for a dropped choice (the routing taken from the layer's own)."""
    p = {name: getattr(layer, name).data().asnumpy().astype(np.float64)
         for name in ("router_weight", "fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias")}
    tokens = X.asnumpy().reshape(-1, X.shape[-1]).astype(np.float64)
    scores = tokens @ p["router_weight"].T
    probs = np.exp(scores - scores.max(1, keepdims=True))
    probs /= probs.sum(1, keepdims=True)
    routing = layer.last.routing
    out = np.zeros_like(tokens)
    for t in range(len(tokens)):
        gates = probs[t, routing.choice[t]]
        gates = (gates / gates.sum() if len(gates) > 1 else gates) * gate_scale
        for j, e in enumerate(routing.choice[t]):
            if routing.slot[t, j] < 0:
                continue
            h = p["fc1_weight"][e] @ tokens[t] + p["fc1_bias"][e]
            h = 0.5 * h * (1 + np.vectorize(math.erf)(h / math.sqrt(2)))   # GELU
            out[t] += gates[j] * (p["fc2_weight"][e] @ h + p["fc2_bias"][e])
    return out.reshape(X.shape), probs


@pytest.mark.parametrize("top_k, capacity_factor, gate_scale", [(1, 4.0, 1.0), (2, 2.0, 1.0), (1, 0.5, 1.0),
                                                                 (2, 0.75, 1.0), (1, 4.0, 4.0), (2, 0.75, 2.5)])
def test_the_layer_is_its_definition_and_a_dropped_token_gets_nothing(top_k, capacity_factor, gate_scale):
    mx.random.seed(0)
    layer = MoEFeedForward(dim=6, hidden=8, experts=E, top_k=top_k, capacity_factor=capacity_factor,
                           gate_scale=gate_scale)
    layer.initialize(mx.init.Normal(0.5))
    X = mx.nd.random.normal(shape=(3, 7, 6), dtype="float32")
    out = layer(X)
    want, probs = _reference(layer, X, gate_scale)
    np.testing.assert_allclose(out.asnumpy(), want, rtol=0, atol=1e-5 * np.abs(want).max())
    if gate_scale != 1:   # the scale is a factor of every output: the unscaled layer's is not the same
        assert not np.allclose(out.asnumpy(), want / gate_scale, rtol=0, atol=1e-3 * np.abs(want).max())
    stats = layer.last
    assert stats.choices == 21 * top_k and stats.routed.sum() == 21 * top_k
    dropped_tokens = (stats.routing.slot < 0).all(axis=1)
    assert stats.dropped == (stats.routing.slot < 0).sum()
    if capacity_factor >= E / top_k:
        assert stats.dropped == 0
    else:
        assert stats.dropped > 0
        assert dropped_tokens.any() or top_k > 1   # with top-1, a dropped choice is a dropped token
        assert np.all(out.asnumpy().reshape(21, 6)[dropped_tokens] == 0)   # the residual carries them
    # Switch's loss: aux_weight * E * sum_e f_e P_e
    f = np.bincount(stats.routing.choice[:, 0], minlength=E) / 21
    assert float(stats.aux[0].asscalar()) == pytest.approx(0.01 * E * (f * probs.mean(0)).sum(), rel=1e-5)


def test_the_auxiliary_losses_reach_the_router_and_the_z_loss_is_its_formula():
    mx.random.seed(1)
    layer = MoEFeedForward(dim=6, hidden=8, experts=E, z_weight=0.1)
    layer.initialize(mx.init.Normal(0.5))
    X = mx.nd.random.normal(shape=(2, 5, 6))
    with autograd.record():
        layer(X)
        aux = aux_losses(layer)
    autograd.backward(aux)
    assert len(aux) == 1 and np.abs(layer.router_weight.grad().asnumpy()).max() > 0
    assert np.abs(layer.fc1_weight.grad().asnumpy()).max() == 0   # the experts are not in the auxiliary losses
    scores = X.asnumpy().reshape(10, 6) @ layer.router_weight.data().asnumpy().T
    lse = np.log(np.exp(scores).sum(1))
    probs = np.exp(scores - lse[:, None])
    f = np.bincount(layer.last.routing.choice[:, 0], minlength=E) / 10
    want = 0.01 * E * (f * probs.mean(0)).sum() + 0.1 * (lse ** 2).mean()
    assert float(aux[0].asscalar()) == pytest.approx(want, rel=1e-5)


def test_the_layer_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="top_k must be between 1 and 4"):
        MoEFeedForward(4, 8, E, top_k=5)
    with pytest.raises(ValueError, match="capacity_factor must be a finite number above 0"):
        MoEFeedForward(4, 8, E, capacity_factor=0)
    with pytest.raises(ValueError, match="experts must be"):
        MoEFeedForward(4, 8, 1)
    layer = MoEFeedForward(4, 8, E)
    layer.initialize()
    layer.hybridize()
    with pytest.raises(TypeError, match="cannot run as a symbol"):
        layer(mx.nd.ones((1, 2, 4)))


# ---- expert parallelism ---------------------------------------------------------------------------------------

def _moe(factor=1.0):
    """The ViT with 4 experts, top-2, of capacity factor ``factor`` (2 drops none)."""
    return init_vit(0, experts=Experts(E, top_k=2, capacity_factor=factor))


@pytest.fixture(scope="module")
def one_context():
    """The MoE ViT (4 experts, top-2) trained on one context, a capacity that drops some tokens, and one that drops
    none."""
    return {factor: _train(make_strategy("data", _moe(factor), contexts(1)), _batches()) for factor in (1.0, E / 2)}


@pytest.mark.parametrize("kp, factor", fast_only([(kp, f) for kp in ((2, 2), (4, 4), (4, 2)) for f in (1.0, E / 2)],
                                                fast={4}))   # fast: 4 contexts, 2 a member, a capacity that drops
def test_expert_parallelism_trains_the_one_context_model_dropping_the_same_tokens(kp, factor, one_context):
    k, p = kp
    strategy = make_strategy(Layout(expert_parallel=p), _moe(factor), contexts(k))
    assert isinstance(strategy, Hybrid)
    got, dropped = _train(strategy, _batches())
    want, want_dropped = one_context[factor]
    assert_close_to_scale(got, want, 1e-5)
    for mine, theirs in zip(dropped, want_dropped):   # every batch, every layer: the same choices dropped
        for a, b in zip(mine, theirs):
            np.testing.assert_array_equal(a, b)
    some = sum((slot < 0).sum() for step in dropped for slot in step)
    assert (some > 0) == (factor < E / 2)
    initial = [p.data().asnumpy() for p in _moe().collect_params().values()]
    assert max(np.abs(a - b).max() for a, b in zip(got, initial)) > 1e-3   # it trained


def test_experts_gradients_are_summed_only_over_the_replicas_that_hold_them():
    """4 contexts, groups of 2: replicas 0 and 2 hold experts 0-1, 1 and 3 experts 2-3; each pair ends equal, the
    pairs hold different experts, and every replica the same router."""
    strategy = make_strategy(Layout(expert_parallel=2), init_vit(0, experts=E), contexts(4))
    groups = strategy.groups()
    assert [len(g) for g in groups] == [4, 2, 2]
    X, y = _batches((8,))[0]
    strategy.train_step(X, y, optimizer=SGD(0.1))
    experts = [strategy.expert_replicas[d][0][0].data.asnumpy() for d in range(4)]   # one chunk, one rank
    np.testing.assert_array_equal(experts[0], experts[2])
    np.testing.assert_array_equal(experts[1], experts[3])
    assert np.abs(experts[0] - experts[1]).max() > 0
    dense = [strategy.replicas[d][0][0].data.asnumpy() for d in range(4)]
    assert all(np.array_equal(dense[0], d) for d in dense[1:])


def test_the_all_to_all_moves_its_formula_s_bytes():
    """Forward: each accepted choice whose expert another member holds goes there and back, ``2 x 4 x dim`` bytes;
    with one context a group, none."""
    for k, p in ((2, 2), (4, 4), (4, 2), (2, 1)):
        strategy = make_strategy(Layout(expert_parallel=p), _moe(), contexts(k))
        X, _ = _batches((16,))[0]
        before = algorithms.copied_bytes()
        strategy.evaluate([(X, mx.nd.zeros((16,)))])
        moved = algorithms.copied_bytes() - before
        bounds = np.cumsum([0] + [16 // k] * k) * 17   # 16 examples over k replicas, 17 tokens each
        want = 0
        for stats in strategy.routing():
            choice, slot, mine = stats.routing.choice, stats.routing.slot, 0
            for r in range(k):
                t, j = np.nonzero(slot[bounds[r]:bounds[r + 1]] >= 0)
                owner = choice[bounds[r]:bounds[r + 1]][t, j] // (E // p)
                mine += 2 * 4 * 64 * int((owner != r % p).sum())
            assert stats.sent_bytes == mine
            want += mine
        assert moved == want
        assert (want > 0) == (p > 1)


@pytest.mark.slow   # the matrix's experts x ZeRO cells
def test_zero_shards_each_group_and_trains_the_same_model():
    want, _ = _train(make_strategy(Layout(expert_parallel=2), init_vit(0, experts=E), contexts(4)), _batches())
    for zero in (1, 2):
        got, _ = _train(make_strategy(Layout(expert_parallel=2, zero=zero), init_vit(0, experts=E), contexts(4)),
                        _batches(), zero=zero)
        assert_close_to_scale(got, want, 1e-6)


@pytest.mark.slow   # the matrix's experts x ZeRO-3 cell
def test_zero_3_shards_each_member_s_experts_over_the_replicas_holding_them():
    """ZeRO-3 with expert parallelism (``Hybrid``): the dense arrays sharded over the 4 replicas, each member's
    experts over the 2 holding them; the same model as without ZeRO-3, which a new layout then reads back whole."""
    want, _ = _train(make_strategy(Layout(expert_parallel=2), init_vit(0, experts=E), contexts(4)), _batches())
    strategy = make_strategy(Layout(expert_parallel=2, zero=3), init_vit(0, experts=E), contexts(4))
    assert "a member's experts over the 2 replicas holding them" in strategy.describe()
    dense, members = strategy.sharded[0][0], strategy.expert_sharded[0]
    assert len(members) == 2 and [len(m.ctx_list) for m in members] == [2, 2]
    model = init_vit(0, experts=E)
    experts = expert_specs(model)
    sizes = [p.data().size for p in model.collect_params().values()]
    expert_sizes = [p.data().size for p in model.collect_params().values() if p.name in experts]
    # the members' shards hold every expert once, the dense shards every other array once
    assert sum(shard.data.size for m in members for shard in m.shards) == sum(expert_sizes)
    assert sum(shard.data.size for shard in dense.shards) == sum(sizes) - sum(expert_sizes)
    got, _ = _train(strategy, _batches(), zero=3)
    assert_close_to_scale(got, want, 1e-6)
    again = make_strategy(Layout(expert_parallel=4, zero=3), _vit_holding(got), contexts(4))
    assert_close_to_scale([p.asnumpy() for p in again.params()], got, 0)


def test_a_model_moves_between_expert_parallel_degrees_whole():
    """The arrays of a layout of 2 experts a context, given to one of 1 a context and read back, are the same
    model: what a checkpoint resumed on another degree relies on."""
    first = make_strategy(Layout(expert_parallel=2), init_vit(0, experts=E), contexts(2))
    X, y = _batches((8,))[0]
    first.train_step(X, y, optimizer=SGD(0.1))
    trained = [p.asnumpy() for p in first.params()]
    second = make_strategy(Layout(expert_parallel=4), _vit_holding(trained), contexts(4))
    for a, b in zip(second.params(), trained):
        np.testing.assert_array_equal(a.asnumpy() if isinstance(a, mx.nd.NDArray) else a, b)
    assert second.expert_replicas[3][0][0][0].shape[0] == 1   # a context holds one expert of each layer


@pytest.mark.parametrize("layout, k, says", [
    (Layout(expert_parallel=3), 3, "cannot share 4 experts equally"),
    (Layout(expert_parallel=2), 3, "cannot group 3"),
])
def test_layouts_the_experts_cannot_take_are_refused(layout, k, says):
    with pytest.raises(ValueError, match=says):
        make_strategy(layout, init_vit(0, experts=E), contexts(k))


def test_expert_parallelism_without_experts_and_a_batch_too_small_are_refused():
    with pytest.raises(ValueError, match="the model has none"):
        make_strategy(Layout(expert_parallel=2), init_vit(0), contexts(2))
    strategy = make_strategy(Layout(expert_parallel=2), init_vit(0, experts=E), contexts(2))
    X, y = _batches((1,))[0]
    with pytest.raises(ValueError, match="a batch of 1 example"):
        strategy.train_step(X, y, optimizer=SGD(0.1))


# ---- the command line -----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_dir(tmp_path_factory):
    """64 train examples (2 batches of 32 an epoch) and 16 test ones: the CLI's path to the experts, whose training
    the matrix proves (tests/test_layouts.py)."""
    return write_idx_files(tmp_path_factory.mktemp("small"), easy_dataset(num_train=64, num_test=16, seed=1))


@pytest.mark.slow   # seconds the fast tier's 150 s budget cannot spare (docs/testing.md)
def test_the_cli_trains_experts_and_records_their_routing(small_dir, tmp_path, capsys):
    metrics = tmp_path / "m.json"
    assert main(["--model", "vit", "--experts", "4", "--top-k", "2", "--capacity-factor", "1.5",
                 "--router-z-loss", "0.001", "--expert-parallel", "2", "--devices", "cpu:2", "--data-dir",
                 str(small_dir), "--epochs", "2", "--batch-size", "32", "--optimizer", "adamw", "--no-progress",
                 "--metrics-json", str(metrics), "--checkpoint-dir", str(tmp_path / "ck")]) == 0
    out = capsys.readouterr().out
    assert "training ViT (4 experts, top-2)" in out
    assert "2 replicas: " in out and "each replica holding 2 of the 4 experts of 2 MoE layers" in out
    for epoch in json.loads(metrics.read_text()):
        experts = epoch["experts"]
        tokens = np.array(experts["tokens"])
        assert tokens.shape == (2, 4) and tokens.sum() == 2 * 64 * 17 * 2   # layers x experts; every choice
        assert 0 <= experts["dropped"] < 1 and experts["aux_loss"] > 0
    # resumed on another expert-parallel degree, one context
    assert main(["--model", "vit", "--experts", "4", "--top-k", "2", "--capacity-factor", "1.5",
                 "--router-z-loss", "0.001", "--devices", "cpu:1", "--data-dir", str(small_dir), "--epochs", "3",
                 "--batch-size", "32", "--optimizer", "adamw", "--no-progress", "--checkpoint-dir",
                 str(tmp_path / "ck"), "--resume"]) == 0
    assert "epoch 3," in capsys.readouterr().out


@pytest.mark.slow   # seconds the fast tier's 150 s budget cannot spare (docs/testing.md)
def test_the_cli_trains_experts_with_sequence_parallelism(small_dir, tmp_path, capsys):
    """``--sequence-parallel`` with experts (issue 46): each tensor rank routes its slice of the sequence, queued in
    one context's order; over 2 replicas that share their experts (the matrix proves it trains the one-context
    model: tests/test_layouts.py)."""
    metrics = tmp_path / "m.json"
    assert main(["--model", "vit", "--experts", "4", "--top-k", "2", "--router-z-loss", "0.001", "--tensor", "2",
                 "--sequence-parallel", "--expert-parallel", "2", "--devices", "cpu:4", "--data-dir", str(small_dir),
                 "--epochs", "1", "--batch-size", "32", "--no-progress", "--metrics-json", str(metrics)]) == 0
    out = capsys.readouterr().out
    assert "sequence parallel: layer norms and the residual stream split" in out and "2 tensor ranks" in out
    experts = json.loads(metrics.read_text())[0]["experts"]
    assert np.array(experts["tokens"]).sum() == 2 * 64 * 17 * 2 and experts["aux_loss"] > 0   # each choice once


@pytest.mark.slow   # the CLI's experts: test_the_cli_trains_experts_and_records_their_routing
def test_the_cli_trains_experts_across_pipeline_stages_and_resumes_them_spread(small_dir, tmp_path, capsys):
    """A mixture of experts composed with pipeline stages (issue 39): 2 stages fed 2 micro-batches in 1F1B's order
    record their routing per epoch; the checkpoint resumes with the experts spread over 2 contexts and ZeRO-3
    instead, then over 2 replicas of 2 tensor ranks with ZeRO-3 (issue 46: built)."""
    metrics = tmp_path / "m.json"
    common = ["--model", "vit", "--experts", "4", "--data-dir", str(small_dir), "--batch-size", "32", "--optimizer",
              "adamw", "--no-progress", "--checkpoint-dir", str(tmp_path / "ck")]
    assert main([*common, "--strategy", "pipeline", "--stages", "2", "--micro-batches", "2", "--schedule", "1f1b",
                 "--devices", "cpu:2", "--epochs", "1", "--metrics-json", str(metrics)]) == 0
    out = capsys.readouterr().out
    assert "2 stages" in out and "each replica holding all 4 experts of 2 MoE layers" in out
    routed = json.loads(metrics.read_text())[0]["experts"]
    # 64 examples x 17 tokens, each through 2 MoE layers (top-1): every choice counted once a layer
    assert [sum(layer) for layer in routed["tokens"]] == [64 * 17] * 2 and routed["aux_loss"] > 0
    assert main([*common, "--expert-parallel", "2", "--zero", "3", "--devices", "cpu:2", "--epochs", "2",
                 "--resume"]) == 0
    out = capsys.readouterr().out
    assert "epoch 2," in out and "a member's experts over the 1 replica holding them" in out
    assert main([*common, "--tensor", "2", "--expert-parallel", "2", "--zero", "3", "--devices", "cpu:4", "--epochs",
                 "3", "--resume"]) == 0
    out = capsys.readouterr().out
    assert "epoch 3," in out and "2 replicas x 2 tensor ranks" in out and "ZeRO-3: each context keeps 1/2" in out


@pytest.mark.parametrize("flags, says", [
    (["--experts", "4", "--model", "lenet"], "use --model vit or transformer, not lenet"),
    (["--top-k", "2"], "--top-k applies to a mixture of experts"),
    (["--experts", "1"], "--experts must be at least 2"),
    (["--experts", "4", "--top-k", "5"], "--top-k must be between 1 and --experts 4"),
    (["--experts", "4", "--expert-parallel", "3", "--devices", "cpu:3"], "--expert-parallel must divide"),
    (["--experts", "4", "--expert-parallel", "2", "--devices", "cpu:3"], "cannot group 3"),
    (["--experts", "4", "--export", "out"], "leave --export out with --experts"),
    (["--experts", "4", "--capacity-factor", "nan"], "--capacity-factor"),
    (["--gate-scale", "4"], "--gate-scale applies to a mixture of experts"),
    (["--experts", "4", "--gate-scale", "0"], "--gate-scale must be a finite number > 0, got 0.0"),
])
def test_bad_expert_flags_get_one_line_and_status_2(flags, says, easy_dir, capsys):
    status = main(["--model", "vit", "--data-dir", str(easy_dir), "--epochs", "1", "--no-progress", *flags])
    assert_refused(status, capsys, says)


# ---- what it learns (slow tier) -------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_the_moe_vit_learns_the_digits_with_balanced_loads(tmp_path, capsys):
    """The digits run of tests/test_vit.py (AdamW, 20 epochs) with 4 experts spread over 2 contexts: at least the
    dense ViT's bar (0.90), and the auxiliary loss keeps every layer's busiest expert within 2x of the mean load in
    each of the last ten epochs (measured: at most 1.96 in any epoch of eight runs with it, up to 2.7 without)."""
    from conftest import load_benchmark
    from test_vit import DIGITS_ACCURACY, DIGITS_RUN
    digits = load_benchmark("digits_dataset").digits_dataset(num_train=1500, seed=0)
    data_dir = write_idx_files(str(tmp_path), digits)
    path = tmp_path / "m.json"
    run = [flag for flag in DIGITS_RUN if flag != "cpu:1"]
    run[run.index("--devices") + 1:run.index("--devices") + 1] = ["cpu:2"]
    assert main([*run, "--experts", "4", "--expert-parallel", "2", "--data-dir", data_dir,
                 "--metrics-json", str(path)]) == 0
    history = json.loads(path.read_text())
    loads = [[max(layer) * len(layer) / sum(layer) for layer in m["experts"]["tokens"]] for m in history]
    print(f"MoE ViT on the digits: test accuracy {[m['test_acc'] for m in history]}, loads {loads}")
    assert history[-1]["test_acc"] >= DIGITS_ACCURACY, history[-1]
    assert all(load <= 2 for epoch in loads[10:] for load in epoch), loads


def test_without_auxiliary_losses_the_experts_train_and_record_their_routing(small_dir, tmp_path, capsys):
    """``--aux-loss-weight 0`` (and no z-loss): no auxiliary loss for backward to start from, the routing still
    recorded, and an auxiliary loss of 0; with ``--gate-scale 4``, which the header names."""
    metrics = tmp_path / "m.json"
    assert main(["--model", "vit", "--experts", "4", "--aux-loss-weight", "0", "--gate-scale", "4", "--devices",
                 "cpu:2", "--expert-parallel", "2", "--data-dir", str(small_dir), "--epochs", "1", "--batch-size",
                 "32", "--no-progress", "--metrics-json", str(metrics)]) == 0
    assert "training ViT (4 experts, top-1, gates x 4)" in capsys.readouterr().out
    experts = json.loads(metrics.read_text())[0]["experts"]
    assert experts["aux_loss"] == 0 and np.array(experts["tokens"]).sum() == 2 * 64 * 17


@pytest.mark.parametrize("zero", fast_only([0, 3], fast={1}))
def test_two_workers_with_their_own_expert_groups_train_the_one_context_model(zero, threads_reduce_at_once):
    """A job of two workers (threads standing in for ps-lite's servers), each an expert-parallel group of its own 2
    contexts; rank 1 starts from another model (rank 0's wins). An expert group lives in one process: each worker
    routes its slice, so with a capacity that drops nothing and no auxiliary loss (both per worker) the job trains
    the one-context model; the experts' gradients are summed over the workers as the rest are (with ZeRO-3, each
    member's experts sharded over its replicas of every worker)."""
    from parallel import Reducer
    from conftest import in_threads

    def moe(seed):
        return init_vit(seed, dtype="float64", experts=Experts(E, top_k=2, capacity_factor=E / 2, aux_weight=0.0))
    batches = [(X.astype("float64"), y) for X, y in _batches()]
    want, _ = _train(make_strategy("data", moe(0), contexts(1)), batches)

    def work(job, rank):
        strategy = make_strategy(Layout(expert_parallel=2, zero=zero), moe(0 if rank == 0 else 5),
                                 [mx.cpu(2 * rank + i) for i in range(2)], reducer=Reducer(job=job))
        return _train(strategy, batches, zero=zero)[0]
    first, second = in_threads(2, work)[0]
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)
    assert_close_to_scale(first, want, 1e-12)


def test_the_routing_reaches_tensorboard(small_dir, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    logdir = tmp_path / "board"
    assert main(["--model", "vit", "--experts", "4", "--devices", "cpu:2", "--expert-parallel", "2", "--data-dir",
                 str(small_dir), "--epochs", "2", "--batch-size", "64", "--no-progress", "--logdir", str(logdir),
                 "--metrics-json", str(tmp_path / "m.json")]) == 0
    events = EventAccumulator(str(logdir))
    events.Reload()
    history = json.loads((tmp_path / "m.json").read_text())
    aux = [e.value for e in events.Scalars("experts/aux_loss")]
    assert aux == pytest.approx([m["experts"]["aux_loss"] for m in history], rel=1e-6)
    loads = [e.value for e in events.Scalars("experts/max_load")]
    assert loads == pytest.approx([max(max(l) * 4 / sum(l) for l in m["experts"]["tokens"]) for m in history],
                                  rel=1e-6)
    assert len(events.Scalars("experts/dropped")) == 2


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_one_epoch_of_digits_with_a_capacity_that_drops_drops_as_one_context(tmp_path):
    """The MoE ViT (4 experts, top-2), one epoch of the digits, momentum SGD, float32, the experts spread over 2 and
    4 contexts, with a capacity that drops a quarter of the choices (with one that drops nothing, every layout's
    epoch is one context's within 1e-5: the conformance matrix's one-epoch column, test_layouts.py). The same
    tokens are dropped step by step while the routers' probabilities are the same (the fast tier's three steps);
    over many steps the data-parallel sums' float32 rounding (1e-7) can move a choice across a tie or its expert's
    capacity, and one moved choice moves the model by more than 1e-5 (9e-5 was measured): the fraction dropped is
    checked to agree within 1e-3. The epoch is 608 of the digits' 1500 training pictures (19 steps): one choice
    moved is a fraction of 5e-5."""
    from parallel.checkpoint import load_checkpoint
    from conftest import load_benchmark
    digits = load_benchmark("digits_dataset").digits_dataset(num_train=1500)
    digits = digits._replace(train_images=digits.train_images[:608], train_labels=digits.train_labels[:608])
    data_dir = write_idx_files(tmp_path, digits)

    def epoch(name, factor, *flags):
        assert main(["--model", "vit", "--experts", "4", "--top-k", "2", "--capacity-factor", str(factor),
                     "--data-dir", str(data_dir), "--epochs", "1", "--batch-size", "32", "--lr", "0.05", "--momentum",
                     "0.9", "--no-progress", "--checkpoint-dir", str(tmp_path / name), "--metrics-json",
                     str(tmp_path / f"{name}.json"), *flags]) == 0
        dropped = json.loads((tmp_path / f"{name}.json").read_text())[0]["experts"]["dropped"]
        return [p.asnumpy() for p in load_checkpoint(str(tmp_path / name)).params], dropped
    _, dropped = epoch("one", 1.0, "--devices", "cpu:1")
    assert dropped > 0.1
    for k in (2, 4):
        _, theirs = epoch(f"p{k}", 1.0, "--devices", f"cpu:{k}", "--expert-parallel", str(k))
        print(f"experts over {k} contexts: dropped {theirs} against {dropped}")
        assert abs(theirs - dropped) < 1e-3
