"""Model, pipeline and hybrid parallelism of a gluon HybridSequential cut at its children: each equals
train_batch on one context (but a pipeline with BatchNorm, which normalises each micro-batch)."""
import mxnet as mx
import numpy as np
import pytest
from mxnet import gluon
from mxnet.gluon import nn

from conftest import assert_same_parameters, contexts, small_cnn
from parallel import evaluate_accuracy, get_params, init_lenet_params, init_resnet18, train_batch
from parallel.comm import block_state
from parallel.strategies import Hybrid, ModelParallel, Pipeline

LR = 0.1


def batches(sizes, dtype="float64", seed=0, shape=(1, 8, 8)):
    rng = np.random.RandomState(seed)
    return [(mx.nd.array(rng.randn(n, *shape), dtype=dtype), mx.nd.array(rng.randint(0, 10, n), dtype=dtype))
            for n in sizes]


def one_context(block, data):
    """The reference: the block's replica after train_batch on one context, and the losses."""
    params = get_params(block, mx.cpu(0))
    losses = [train_batch(X, y, [params], [mx.cpu(0)], LR, net=block).asscalar() for X, y in data]
    return params, losses


def train(model, data, **kwargs):
    return [model.train_step(X, y, LR, **kwargs)[0].asscalar() for X, y in data]


def assert_same_model(params, aux, want, dtype="float64"):
    """``params``/``aux`` (lists in the block's order) equal the replica ``want`` to rtol 1e-5.

    A bias directly followed by BatchNorm has zero gradient: it stays at 0 up to rounding (~1e-16), which no
    relative tolerance compares, so those are compared absolutely. MXNet's BatchNorm keeps its running
    statistics to float32 precision whatever the dtype.
    """
    assert len(params) == len(want) and len(aux) == len(want.aux)
    for got, w in zip(params, want):
        got, w = got.asnumpy(), w.asnumpy()
        assert got.dtype == np.dtype(dtype)
        if np.abs(w).max() > 1e-10:
            assert_same_parameters([got], [w], dtype)
        else:
            np.testing.assert_allclose(got, w, rtol=0, atol=1e-12)
    assert_same_parameters([a.asnumpy() for a in aux], [a.asnumpy() for a in want.aux], "float32")


SIZES = [7, 1, 13, 5]   # indivisible by 2 and 3; a batch of 1 leaves hybrid replicas idle


@pytest.mark.parametrize("batchnorm", [False, True])
@pytest.mark.parametrize("k, layout", [(2, {"stages": 2}), (3, {"stages": 3}), (2, {"boundaries": [1]}),
                                       (3, {"boundaries": [1, 4]})])
def test_model_parallel_of_a_block_equals_one_context(k, layout, batchnorm):
    """The whole batch goes through every stage: BatchNorm too trains the one-context model."""
    data = batches(SIZES)
    block = small_cnn(batchnorm)
    want, want_losses = one_context(block, data)
    model = ModelParallel(block, contexts(k), **layout)
    assert [params[0].context for params in model.stage_params] == contexts(k)
    losses = train(model, data)
    assert_same_model(model.params(), model.aux(), want)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-10)
    assert not np.allclose(want[0].asnumpy(), block_state(block)[1][0].asnumpy())   # training moved it


@pytest.mark.parametrize("k, m", [(2, 1), (2, 3), (3, 2), (3, 5)])
def test_pipeline_of_a_block_without_batchnorm_equals_one_context(k, m):
    data = batches([7, 13, 5])
    block = small_cnn()
    want, want_losses = one_context(block, data)
    model = Pipeline(block, contexts(k), stages=k, micro_batches=m)
    losses = train(model, data)
    assert_same_model(model.params(), model.aux(), want)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-10)


def test_pipeline_with_batchnorm_normalises_each_micro_batch():
    """What the docstring says: with M > 1 micro-batches BatchNorm is not the one-context model (different
    weights, running statistics updated M times a step); with one micro-batch it is."""
    data = batches([7, 13])
    block = small_cnn(batchnorm=True)
    want, _ = one_context(block, data)
    model = Pipeline(block, contexts(2), micro_batches=2)
    train(model, data)
    with pytest.raises(AssertionError):
        assert_same_parameters([model.params()[0].asnumpy()], [want[0].asnumpy()], "float64")
    assert not np.allclose(model.aux()[0].asnumpy(), want.aux[0].asnumpy(), rtol=1e-5)
    exact = Pipeline(block, contexts(2), micro_batches=1)
    train(exact, data)
    assert_same_model(exact.params(), exact.aux(), want)


@pytest.mark.parametrize("batchnorm", [False, True])
@pytest.mark.parametrize("k, stages", [(4, 2), (4, 1), (3, 3), (2, 2)])
def test_hybrid_of_a_block_equals_one_context(k, stages, batchnorm, strict_contexts):
    """BatchNorm's statistics are summed across the replicas holding a stage (2 replicas of 2 stages, 4 of
    one): the one-context model, with the very same running statistics on every replica."""
    data = batches(SIZES)
    block = small_cnn(batchnorm)
    want, want_losses = one_context(block, data)
    model = Hybrid(block, contexts(k), stages=stages)
    assert len(model.replicas) == k // stages
    losses = train(model, data)
    for d in range(len(model.replicas)):
        assert_same_model(model.replica_params(d), model.aux(d), want)
        for a, b in zip(model.aux(d), model.aux()):
            np.testing.assert_array_equal(a.asnumpy(), b.asnumpy())
    np.testing.assert_allclose(losses, want_losses, rtol=1e-10)


def test_hybrid_without_synchronization_would_differ():
    """The premise of the lockstep forward: two replicas normalising their own halves train another model."""
    data = batches([8, 6])
    block = small_cnn(batchnorm=True)
    want, _ = one_context(block, data)
    model = Hybrid(block, contexts(4), stages=2)
    for chunk in model.chunks:
        for segment in chunk.blocks.segments:
            segment.net.sync_batchnorm = False
    train(model, data)
    with pytest.raises(AssertionError):
        assert_same_parameters([model.params()[0].asnumpy()], [want[0].asnumpy()], "float64")


@pytest.mark.parametrize("build", [
    lambda block: ModelParallel(block, contexts(3), stages=3),
    lambda block: Pipeline(block, contexts(3), boundaries=[2, 5], micro_batches=2),
    lambda block: Hybrid(block, contexts(4), boundaries=[3]),
])
def test_params_and_aux_follow_the_block_order_on_their_stage_contexts(build):
    block = small_cnn(batchnorm=True)
    names, arrays, aux_names, aux_arrays = block_state(block)
    model = build(block)
    assert model.names() == names and model.aux_names() == aux_names
    assert len(model.params()) == len(names) == 10 and len(model.aux()) == len(aux_names) == 4
    for got, want in zip(model.params() + model.aux(), arrays + aux_arrays):
        np.testing.assert_array_equal(got.asnumpy(), want.asnumpy())
    context_of = {name: params[0].context for params in model.stage_params
                  for name in params.names + params.aux_names}
    assert [p.context for p in model.params()] == [context_of[name] for name in names]
    assert [a.context for a in model.aux()] == [context_of[name] for name in aux_names]
    assert len(set(context_of.values())) == len(model.stage_params)
    params = model.params()   # live arrays: training changes them in place
    before = params[0].asnumpy()
    model.train_step(*batches([5])[0], LR)
    assert not np.allclose(params[0].asnumpy(), before)


def test_lenet_keeps_its_eight_params_and_has_no_aux():
    for model in (ModelParallel(init_lenet_params(), contexts(2)), Hybrid(init_lenet_params(), contexts(2))):
        assert len(model.params()) == 8 and model.aux() == [] and model.names() == [] and model.aux_names() == []


def test_describe_names_the_children_ranges():
    block = small_cnn(batchnorm=True)   # 7 children
    assert repr(ModelParallel(block, contexts(2), boundaries=[3])) == \
        "ModelParallel(2 stages: children 0-2 @ cpu(0) | 3-6 @ cpu(1))"
    assert ModelParallel(block, contexts(3), boundaries=[1, 6]).describe() == \
        "3 stages: children 0 @ cpu(0) | 1-5 @ cpu(1) | 6 @ cpu(2)"
    assert Pipeline(block, contexts(2), micro_batches=3).describe() == \
        "2 stages: children 0-3 @ cpu(0) | 4-6 @ cpu(1), 3 micro-batches, schedule gpipe"
    assert Hybrid(block, contexts(4), stages=2).describe() == \
        "2 replicas x 2 stages: children 0-3 @ cpu(0),cpu(2) | 4-6 @ cpu(1),cpu(3); gradients summed with the " \
        "fused allreduce in buckets of 25 MiB"


@pytest.mark.parametrize("build", [
    lambda block: ModelParallel(block, contexts(2)),
    lambda block: Pipeline(block, contexts(3), stages=3, micro_batches=3),
    lambda block: Hybrid(block, contexts(4), stages=2),
])
def test_evaluate_uses_the_running_statistics_as_one_context(build):
    data = batches([9, 6])
    block = small_cnn(batchnorm=True)
    model = build(block)
    train(model, data)
    params = get_params(block, mx.cpu(0))   # the strategy's trained model as one replica
    for array, trained in zip(list(params) + params.aux, model.params() + model.aux()):
        trained.copyto(array)
    test = batches([10, 7], seed=1)
    want = evaluate_accuracy(test, [params], [mx.cpu(0)], net=block)
    assert model.evaluate(test) == pytest.approx(want, abs=1e-12)


def test_labels_are_checked_against_the_block_outputs():
    block = small_cnn()
    X, _ = batches([4])[0]
    for model in (ModelParallel(block, contexts(2)), Pipeline(block, contexts(2), micro_batches=2),
                  Hybrid(block, contexts(2))):
        before = model.params()[0].asnumpy()
        with pytest.raises(ValueError, match="label y\\[1\\] = 10 is not one of the network's 10 classes"):
            model.train_step(X, mx.nd.array([0, 10, 1, 2], dtype="float64"), LR)
        np.testing.assert_array_equal(model.params()[0].asnumpy(), before)   # nothing updated


def _deferred():
    block = nn.HybridSequential()
    block.add(nn.Dense(3), nn.Dense(2))
    block.initialize()
    return block


def _sequential():
    block = nn.Sequential()
    block.add(nn.Dense(3, in_units=2), nn.Dense(2, in_units=3))
    block.initialize()
    return block


@pytest.mark.parametrize("make, kwargs, error, message", [
    (_sequential, {}, TypeError, "must be a gluon HybridSequential, got Sequential"),
    (lambda: small_cnn()[0], {}, TypeError, "must be a gluon HybridSequential, got Conv2D"),
    (lambda: "resnet", {}, TypeError, "LeNet's list of parameters .* or an initialized gluon HybridSequential"),
    (_deferred, {}, ValueError, "run the block once on an example batch"),
    (nn.HybridSequential, {"stages": 1}, ValueError, "no children"),
    (small_cnn, {"boundaries": [5]}, ValueError,
     "stage boundary 5 is outside the block's 5 children; a boundary b cuts before child b, so use values in 1..4"),
    (small_cnn, {"boundaries": [0, 2]}, ValueError, "stage boundary 0 is outside the block's 5 children"),
    (small_cnn, {"boundaries": [3, 2]}, ValueError, r"boundaries \[3, 2\] must be strictly increasing"),
    (small_cnn, {"stages": 6}, ValueError, "6 stages cannot split the block's 5 children; use 1 to 5 stages"),
    (small_cnn, {"boundaries": [1, 2, 3, 4]}, ValueError, "5 stages need 5 contexts, got 4"),
])
def test_bad_blocks_and_layouts(make, kwargs, error, message):
    for strategy in (ModelParallel, Pipeline, Hybrid):
        with pytest.raises(error, match=message):
            strategy(make(), contexts(4), **kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["model", "pipeline", "hybrid"])
def test_resnet18_smoke(name):
    """The textbook's ResNet-18 (7 children) cut in two, one step of 6 examples of 28x28: the stages hold the
    whole model and training moves it. Model parallelism takes the one-context step; hybrid, with 2 replicas,
    the step of train_batch over 2 contexts (in float32, at this initialization, the summed BatchNorm
    statistics move the first convolution by ~1e-3 of its scale from the one-context step, as they do for
    data parallelism)."""
    block = init_resnet18(seed=0)
    (X, y), = batches([6], dtype="float32", shape=(1, 28, 28))
    model = {"model": lambda: ModelParallel(block, contexts(2)),
             "pipeline": lambda: Pipeline(block, contexts(2), micro_batches=2),
             "hybrid": lambda: Hybrid(block, contexts(4), stages=2)}[name]()
    extra = (",cpu(2)", ",cpu(3)") if name == "hybrid" else ("", "")
    assert f"children 0-3 @ cpu(0){extra[0]} | 4-6 @ cpu(1){extra[1]}" in model.describe()
    assert model.names() == block_state(block)[0] and len(model.params()) == 76
    loss = model.train_step(X, y, LR)[0].asscalar()
    assert np.isfinite(loss)
    moved = [not np.array_equal(p.asnumpy(), w.asnumpy()) for p, w in zip(model.params(), block_state(block)[1])]
    assert sum(moved) >= 70
    if name != "pipeline":
        replicas = 2 if name == "hybrid" else 1
        device_params = [get_params(block, ctx) for ctx in contexts(replicas)]
        want_loss = train_batch(X, y, device_params, contexts(replicas), LR, net=block).asscalar()
        np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
        got, want = model.params(), device_params[0]
        assert_same_parameters([got[0].asnumpy(), got[-2].asnumpy()], [want[0].asnumpy(), want[-2].asnumpy()],
                               "float32")


def test_a_block_is_not_modified():
    block = small_cnn(batchnorm=True)
    _, arrays, _, aux = block_state(block)
    before = [a.asnumpy() for a in arrays + aux]
    train(Hybrid(block, contexts(4), stages=2), batches([6]))
    for a, b in zip(arrays + aux, before):
        np.testing.assert_array_equal(a.asnumpy(), b)
    assert isinstance(block, gluon.nn.HybridSequential) and len(block) == 7   # still its children
