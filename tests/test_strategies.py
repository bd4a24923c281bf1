"""Model, pipeline and hybrid parallelism: each is the same computation as train_batch on one context."""
import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd

from parallel import (ALLREDUCE_ALGORITHMS, Dataset, evaluate_accuracy, get_params, init_lenet_params,
                      iterate_batches, lenet, softmax_cross_entropy, train_batch)
from parallel.models.lenet import LenetStage
from parallel.strategies import Hybrid, ModelParallel, Pipeline, bubble_fraction, stage_ranges, Stages
from parallel import RunConfig, fit, init_model, make_strategy
from parallel.optim import SGD, Adam, Cosine
from conftest import assert_same_parameters, contexts, diagonal, make_batches

# Indivisible sizes, a batch of 1 after a larger one (idle hybrid replicas must not reuse stale gradients).
SIZES = [7, 1, 13, 5, 6]


_REFERENCE = {}


def reference(sizes, dtype):
    """Parameters and losses after train_batch on one context (cached: every strategy compares with it)."""
    key = (tuple(sizes), dtype)
    if key not in _REFERENCE:
        ctx_list = contexts(1)
        device_params = [get_params(init_lenet_params(seed=0, dtype=dtype), ctx_list[0])]
        losses = [train_batch(X, y, device_params, ctx_list, 0.2).asscalar()
                  for X, y in make_batches(sizes, dtype=dtype)]
        _REFERENCE[key] = [p.asnumpy() for p in device_params[0]], losses
    return _REFERENCE[key]


def assert_equal_to_one_context(model, sizes, dtype, step=None):
    """Train ``model`` on the batches and compare parameters and losses with one-context train_batch."""
    step = step or model.train_step
    losses = [step(X, y, 0.2)[0].asscalar() for X, y in make_batches(sizes, dtype=dtype)]
    want, want_losses = reference(sizes, dtype)
    for params in [model.replica_params(d) for d in range(model.mesh.replicas)]:
        got = [param.asnumpy() for param in params]
        assert all(g.dtype == np.dtype(dtype) for g in got)
        assert_same_parameters(got, want, dtype)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    assert not np.allclose(want[0], init_lenet_params(0, dtype=dtype)[0].asnumpy())   # training moved it


DTYPES = ["float64", "float32"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k, layout", [
    (2, {"boundaries": [1]}), (2, {"boundaries": [2]}), (2, {"boundaries": [3]}),
    (3, {"stages": 3}), (4, {"stages": 4}), (4, {"boundaries": [1, 2, 3]}),
])
def test_model_parallel_equals_one_context(k, layout, dtype):
    model = ModelParallel(init_lenet_params(seed=0, dtype=dtype), contexts(k), **layout)
    assert [p[0].context for p in model.stage_params] == contexts(k)
    assert_equal_to_one_context(model, SIZES, dtype)


@pytest.mark.parametrize("km, dtype", diagonal([(2, 1), (2, 2), (2, 3), (2, 5), (4, 1), (4, 2), (4, 4), (4, 5)],
                                               DTYPES))
def test_pipeline_equals_one_context(km, dtype):
    k, m = km
    """Any number of micro-batches the batches allow (the smallest batch here has 5 examples)."""
    sizes = [7, 13, 5, 6]
    model = Pipeline(init_lenet_params(seed=0, dtype=dtype), contexts(k), stages=k, micro_batches=m)
    assert_equal_to_one_context(model, sizes, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k, stages", [(2, 1), (2, 2), (4, 1), (4, 2), (4, 4)])
def test_hybrid_equals_one_context(k, stages, dtype):
    model = Hybrid(init_lenet_params(seed=0, dtype=dtype), contexts(k), stages=stages)
    assert len(model.replicas) == model.mesh.replicas == k // stages
    assert_equal_to_one_context(model, SIZES, dtype)


@pytest.mark.parametrize("algorithm", sorted(ALLREDUCE_ALGORITHMS))
def test_hybrid_passes_the_allreduce_algorithm_through(algorithm):
    model = Hybrid(init_lenet_params(seed=0, dtype="float64"), contexts(4), stages=2, reducer=algorithm)
    assert model.reducer.algorithm == algorithm
    assert_equal_to_one_context(model, SIZES, "float64")


def test_hybrid_layout_groups_consecutive_contexts_and_reduces_per_stage():
    """Replica r holds stage s on ctx_list[r*S + s]; after a step stage s's gradient is the same on the R
    contexts holding it (allreduced among them) and differs between stages."""
    ctx_list = contexts(4)
    model = Hybrid(init_lenet_params(seed=0), ctx_list, stages=2)
    assert [[ranks[0].data.context for ranks in replica] for replica in model.replicas] == [ctx_list[0:2],
                                                                                          ctx_list[2:4]]
    for r, replica in enumerate(model.replicas):
        for s, (params,) in enumerate(replica):   # one tensor rank
            assert all(p.context == ctx_list[r * 2 + s] for p in params)
    (X, y), = make_batches([9])
    model.train_step(X, y, 0.2)
    for s in range(2):
        grads = [replica[s][0][0].grad.asnumpy() for replica in model.replicas]
        np.testing.assert_array_equal(grads[0], grads[1])
        assert np.abs(grads[0]).max() > 0
    assert "cpu(0),cpu(2)" in model.describe() and "cpu(1),cpu(3)" in model.describe()


def test_gradients_flow_back_across_contexts():
    """The premise of model parallelism: a copy between contexts inside autograd.record() is recorded,
    so the backward pass sends the gradient back across it (compared with the same net on one context)."""
    (X, y), = make_batches([6], seed=3, dtype="float64")
    params = init_lenet_params(seed=0, dtype="float64")
    one = get_params(params, mx.cpu(0))
    with autograd.record():
        loss = softmax_cross_entropy(lenet(X, one), y)
    loss.backward()
    first, second = get_params(params[:4], mx.cpu(0)), get_params(params[4:], mx.cpu(1))
    with autograd.record():
        # the two stages, each on the context of its arrays: the copy to cpu(1) between them is recorded
        out = LenetStage(2, 4)(LenetStage(0, 2)(X.as_in_context(mx.cpu(0)), first).as_in_context(mx.cpu(1)), second)
        assert out.context == mx.cpu(1)
        loss = softmax_cross_entropy(out, y.as_in_context(mx.cpu(1)))
    loss.backward()
    for got, want in zip(list(first) + list(second), one):
        assert got.grad.context == got.context
        np.testing.assert_allclose(got.grad.asnumpy(), want.grad.asnumpy(), rtol=1e-10, atol=0)
    assert np.abs(first[0].grad.asnumpy()).max() > 0   # reached the first context, not zero


@pytest.mark.parametrize("name, kwargs", [
    ("model", {"stages": Stages(boundaries=[2])}), ("pipeline", {"stages": Stages(2, micro_batches=3)}),
    ("hybrid", {"stages": 2}),
])
def test_evaluate_matches_one_context(name, kwargs):
    strategy = make_strategy(name, init_lenet_params(seed=0), contexts(4), **kwargs)
    for X, y in make_batches([8, 5], seed=4):
        strategy.train_step(X, y, 0.5)
    rng = np.random.RandomState(0)
    images, labels = rng.randint(0, 255, (37, 28, 28)).astype(np.uint8), rng.randint(0, 10, 37)
    params = [p.copyto(mx.cpu(0)) for p in strategy.model.params()]
    want = evaluate_accuracy(iterate_batches(images, labels, 10), [params], contexts(1))
    assert strategy.evaluate(iterate_batches(images, labels, 10)) == pytest.approx(want, abs=1e-12)


def test_pipeline_short_last_batch_uses_one_micro_batch_per_example():
    """A batch with fewer examples than micro-batches (an epoch's short last batch) runs one micro-batch an example,
    the rest empty: the one-context step."""
    strategy = make_strategy("pipeline", init_lenet_params(seed=0, dtype="float64"), contexts(2),
                             Stages(micro_batches=4))
    assert_equal_to_one_context(strategy.model, [7, 3, 1], "float64", step=strategy.train_step)


def test_fit_runs_every_strategy_on_the_same_curve():
    """fit shares one loop: a tiny set whose last batch (2 examples) is shorter than the micro-batches."""
    rng = np.random.RandomState(0)
    data = Dataset(rng.randint(0, 255, (18, 28, 28)).astype(np.uint8), rng.randint(0, 10, 18).astype(np.uint8),
                   rng.randint(0, 255, (7, 28, 28)).astype(np.uint8), rng.randint(0, 10, 7).astype(np.uint8))
    curves = {}
    for name, kwargs in [("data", {}), ("model", {}), ("pipeline", {"stages": Stages(micro_batches=4)}),
                         ("hybrid", {})]:
        strategy = make_strategy(name, init_model("lenet", seed=1), contexts(4), batch_size=8, **kwargs)
        history, model = fit(data, strategy, 0.3, RunConfig(epochs=2, batch_size=8, seed=1))
        assert len(history) == 2
        if name == "data":   # the replicas, one per context, as fit always returned them
            assert [params[0].context for params in model] == contexts(4)
        else:   # the composed strategy, laid out as the name says
            assert isinstance(model, Hybrid) and model.name == name
        curves[name] = [m["train_loss"] for m in history]
    for name in ("model", "pipeline", "hybrid"):
        np.testing.assert_allclose(curves[name], curves["data"], rtol=1e-5)


def test_bubble_fraction():
    assert bubble_fraction(1, 4) == 0
    assert bubble_fraction(2, 4) == pytest.approx(1 / 5)
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert Pipeline(init_lenet_params(), contexts(2), micro_batches=1).bubble_fraction() == pytest.approx(1 / 2)


def test_stage_ranges():
    assert stage_ranges() == [(0, 2), (2, 4)]
    assert stage_ranges(stages=1) == [(0, 4)]
    assert stage_ranges(stages=3) == [(0, 2), (2, 3), (3, 4)]
    assert stage_ranges(stages=4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert stage_ranges(boundaries=[1, 3]) == [(0, 1), (1, 3), (3, 4)]
    assert stage_ranges(boundaries=[]) == [(0, 4)]
    assert stage_ranges(boundaries=(np.int64(2),)) == [(0, 2), (2, 4)]


@pytest.mark.parametrize("kwargs, error, message", [
    ({"stages": 5}, ValueError, "5 stages cannot split LeNet's 4 layers; use 1 to 4 stages"),
    ({"stages": 0}, ValueError, "0 stages cannot split"),
    ({"stages": 2.0}, TypeError, "stages must be an int"),
    ({"stages": True}, TypeError, "stages must be an int"),
    ({"boundaries": [0]}, ValueError, "stage boundary 0 is outside LeNet's 4 layers"),
    ({"boundaries": [4]}, ValueError, "stage boundary 4 is outside LeNet's 4 layers; .* 1..3"),
    ({"boundaries": [-1, 2]}, ValueError, "stage boundary -1 is outside"),
    ({"boundaries": [3, 1]}, ValueError, r"boundaries \[3, 1\] must be strictly increasing"),
    ({"boundaries": [2, 2]}, ValueError, r"boundaries \[2, 2\] must be strictly increasing without repeats"),
    ({"boundaries": ["2"]}, TypeError, r"boundaries\[0\] must be an int"),
    ({"stages": 2, "boundaries": [2]}, ValueError, "stages and boundaries both say where to cut; give one of them"),
])
def test_bad_stage_layouts(kwargs, error, message):
    with pytest.raises(error, match=message):
        stage_ranges(**kwargs)
    with pytest.raises(error, match=message):
        ModelParallel(init_lenet_params(), contexts(4), **kwargs)


@pytest.mark.parametrize("build, error, message", [
    (lambda p: ModelParallel(p, contexts(2), stages=3), ValueError, "3 stages need 3 contexts, got 2"),
    (lambda p: ModelParallel(p, contexts(3), boundaries=[1, 2, 3]), ValueError, "4 stages need 4 contexts, got 3"),
    (lambda p: Pipeline(p, contexts(1)), ValueError, "2 stages need 2 contexts, got 1"),
    (lambda p: Pipeline(p, contexts(2), micro_batches=0), ValueError, "micro_batches must be >= 1, got 0"),
    (lambda p: Pipeline(p, contexts(2), micro_batches="4"), TypeError, "micro_batches must be an int"),
    (lambda p: Hybrid(p, contexts(4), stages=3), ValueError,
     "4 contexts in ctx_list cannot form equal groups of 3 stages; use a multiple of 3 contexts"),
    (lambda p: Hybrid(p, contexts(3), stages=2), ValueError, "3 contexts in ctx_list cannot form equal groups of 2 stages"),
    (lambda p: Hybrid(p, contexts(2), stages=3), ValueError, "3 stages need 3 contexts, got 2"),
    (lambda p: Hybrid(p, contexts(2), reducer="smoke"), ValueError,
     "algorithm must be one of naive, fused, ring, tree; got 'smoke'"),
    (lambda p: ModelParallel(p, [mx.cpu(0), mx.cpu(0)]), ValueError, r"ctx_list\[1\] repeats cpu\(0\)"),
    (lambda p: ModelParallel(p, []), ValueError, "ctx_list is empty"),
    (lambda p: ModelParallel(p, ["cpu(0)", "cpu(1)"]), TypeError, r"ctx_list\[0\] must be an mxnet Context"),
    (lambda p: ModelParallel(p[:6], contexts(2)), ValueError, "params has 6 arrays but LeNet takes 8"),
])
def test_bad_configurations_raise_value_errors(build, error, message):
    with pytest.raises(error, match=message):
        build(init_lenet_params())


def test_bad_batches_and_learning_rates():
    (X, y), = make_batches([4])
    for model in (ModelParallel(init_lenet_params(), contexts(2)), Pipeline(init_lenet_params(), contexts(2)),
                  Hybrid(init_lenet_params(), contexts(2))):
        with pytest.raises(ValueError, match="4 examples but y has 3"):
            model.train_step(X, y[:3], 0.1)
        with pytest.raises(ValueError, match="lr must be a finite number > 0"):
            model.train_step(X, y, 0.0)


@pytest.mark.parametrize("kwargs, message", [
    ({"name": "diagonal"}, "strategy must be one of data, model, pipeline, hybrid; got 'diagonal'"),
    ({"name": "data", "stages": 2}, "stages and boundaries cut the model into pipeline stages; the data strategy "
                                    "keeps it whole"),
    ({"name": "data", "stages": Stages(boundaries=[2])}, "use the hybrid strategy"),
    ({"name": "model", "stages": Stages(2, [2])}, "stages and boundaries both say where to cut"),
    ({"name": "model", "stages": Stages(micro_batches=2)},
     "micro_batches feed a pipeline, not the model strategy's"),
    ({"name": "pipeline", "stages": Stages(micro_batches=9), "batch_size": 8},
     "micro_batches=9 cannot split batches of 8 examples; use at most 8"),
])
def test_make_strategy_refuses_options_that_do_not_apply(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_strategy(params=init_lenet_params(), ctx_list=contexts(2), **kwargs)


# ---- optimizers with state, clipping and accumulation in every strategy ----------------------------------------

def _one_context_with(optimizer_factory, sizes, accumulate=1):
    ctx_list = contexts(1)
    device_params = [get_params(init_lenet_params(seed=0, dtype="float64"), ctx_list[0])]
    optimizer = optimizer_factory()
    for X, y in make_batches(sizes, dtype="float64"):
        train_batch(X, y, device_params, ctx_list, optimizer=optimizer, accumulate=accumulate)
    return [p.asnumpy() for p in device_params[0]]


#: Momentum with Nesterov and weight decay, a warm-up and clipping; and Adam (state of two buffers).
OPTIMIZER_CASES = {
    "nesterov": lambda zero=0: SGD(0.1, momentum=0.9, nesterov=True, wd=1e-3, clip_norm=0.5, zero=zero,
                                   schedule=Cosine(len(SIZES), warmup_steps=2)),
    "adam": lambda zero=0: Adam(0.01, wd=1e-3, zero=zero),
}


@pytest.mark.parametrize("case", sorted(OPTIMIZER_CASES))
@pytest.mark.parametrize("strategy, k, options", [
    ("model", 2, {"stages": Stages(boundaries=[2])}), ("pipeline", 3, {"stages": Stages(3, micro_batches=1)}),
    ("hybrid", 4, {"stages": 2}), ("hybrid", 3, {"stages": 1}),
])
def test_every_strategy_takes_an_optimizer_and_equals_one_context(strategy, k, options, case):
    make = OPTIMIZER_CASES[case]
    want = _one_context_with(make, SIZES)
    for zero in (0, 1, 2):   # one replica (model, pipeline): a group of one, nothing to shard
        model = make_strategy(strategy, init_lenet_params(seed=0, dtype="float64"), contexts(k), **options)
        optimizer = make(zero)
        for X, y in make_batches(SIZES, dtype="float64"):
            model.train_step(X, y, optimizer=optimizer, accumulate=2 if X.shape[0] > 1 else 1)
        for d in range(model.mesh.replicas):
            assert_same_parameters([p.asnumpy() for p in model.replica_params(d)], want, "float64")
