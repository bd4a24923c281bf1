"""Gluon blocks on the from-scratch path: flat replicas, the K-contexts invariant, synchronized BatchNorm."""
import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd, gluon
from mxnet.gluon import nn

from conftest import assert_same_parameters, contexts, small_cnn
from parallel import GluonNet, evaluate_accuracy, get_params, set_block_params, train_batch, train_step
from parallel.comm import FlatReplica
from parallel.split import split_and_load


def batches(sizes, dtype="float64", seed=0):
    rng = np.random.RandomState(seed)
    return [(mx.nd.array(rng.randn(n, 1, 8, 8), dtype=dtype), mx.nd.array(rng.randint(0, 10, n), dtype=dtype))
            for n in sizes]


def train(block, k, data, lr=0.1, net=None, steps=1):
    ctx_list = contexts(k)
    device_params = [get_params(block, ctx) for ctx in ctx_list]
    net = block if net is None else net
    for _ in range(steps):
        for X, y in data:
            train_batch(X, y, device_params, ctx_list, lr, net=net)
    return device_params


def assert_same_model(got, want, dtype="float64"):
    """Trained parameters equal to rtol 1e-5; running statistics too (MXNet's BatchNorm accumulates its
    statistics in float32 whatever the dtype, so those are compared to 1e-5 of their scale)."""
    # A bias followed by BatchNorm has a zero gradient in exact arithmetic: it stays at its initial 0 up to
    # rounding (~1e-16), which no relative tolerance can compare; those are compared absolutely.
    keep = [i for i, w in enumerate(want) if np.abs(w.asnumpy()).max() > 1e-10]
    assert len(keep) >= len(want) - 2
    assert_same_parameters([got[i].asnumpy() for i in keep], [want[i].asnumpy() for i in keep], dtype)
    for i in set(range(len(want))) - set(keep):
        np.testing.assert_allclose(got[i].asnumpy(), want[i].asnumpy(), rtol=0, atol=1e-12)
    assert_same_parameters([a.asnumpy() for a in got.aux], [a.asnumpy() for a in want.aux], "float32")


def test_get_params_of_a_block_is_a_flat_replica_of_its_values():
    block = small_cnn(batchnorm=True)
    params = get_params(block, mx.cpu(1))
    assert isinstance(params, FlatReplica)
    trainable = [p for p in block.collect_params().values() if p.grad_req != "null"]
    assert params.names == [p.name for p in trainable]
    assert params.aux_names == [p.name for p in block.collect_params().values() if p.grad_req == "null"]
    assert len(params.aux) == 4 and all(a.context == mx.cpu(1) for a in params.aux)
    for array, p in zip(params, trainable):
        assert array.context == mx.cpu(1)
        np.testing.assert_array_equal(array.asnumpy(), p.data().asnumpy())
    assert params.data.size == sum(p.data().size for p in trainable)
    params[0][:] = 7   # a copy: the block is not touched
    assert not (trainable[0].data().asnumpy() == 7).all()


def test_a_block_gives_the_same_outputs_as_gluon():
    block = small_cnn(batchnorm=True)
    X = batches([5])[0][0]
    params = get_params(block, mx.cpu(0))
    np.testing.assert_allclose(GluonNet(block)(X, params).asnumpy(), block(X).asnumpy(), rtol=1e-12)


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_k_contexts_train_the_same_cnn_as_one(k):
    data = batches([10, 7, 3])
    want = train(small_cnn(), 1, data, steps=2)[0]
    for params in train(small_cnn(), k, data, steps=2):
        assert_same_model(params, want)


def test_the_same_step_as_gluon_trainer_sgd():
    """From the same initial weights, train_batch on a block takes gluon.Trainer's SGD step."""
    data = batches([8, 6], dtype="float32")
    block = small_cnn(dtype="float32")
    initial = next(iter(block.collect_params().values())).data().asnumpy()
    params = train(block, 2, data, lr=0.3)[0]
    trainer = gluon.Trainer(block.collect_params(), "sgd", {"learning_rate": 0.3})
    loss = gluon.loss.SoftmaxCrossEntropyLoss()
    for X, y in data:
        with autograd.record():
            l = loss(block(X), y)
        l.backward()
        trainer.step(X.shape[0])
    trained = [p.data().asnumpy() for p in block.collect_params().values() if p.grad_req != "null"]
    assert_same_parameters([p.asnumpy() for p in params], trained, "float32")
    assert not np.allclose(trained[0], initial)   # it did train


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_synchronized_batchnorm_trains_the_same_model_as_one_context(k):
    """Shards of unequal size (10 over 3 or 4 contexts; 7; 3 over 4 leaves one context idle)."""
    data = batches([10, 7, 3])
    want = train(small_cnn(batchnorm=True), 1, data, steps=2)[0]
    got = train(small_cnn(batchnorm=True), k, data, steps=2)
    for params in got:
        assert_same_model(params, want)
    for params in got[1:]:   # every replica holds the very same running statistics
        for a, b in zip(params.aux, got[0].aux):
            np.testing.assert_array_equal(a.asnumpy(), b.asnumpy())


def _batchnorm_variant(variant):
    """Small blocks whose BatchNorm takes the other paths of the synchronized version: a 3-D input (NCW),
    no learned scale (fix_gamma), and channels on another axis than 1."""
    mx.random.seed(3)
    net = nn.HybridSequential()
    if variant == "conv1d, fixed gamma":
        net.add(nn.Conv2D(4, 3), nn.HybridLambda(lambda F, x: F.reshape(x, (0, 0, -1))),   # (N, 4, 36)
                nn.BatchNorm(scale=False), nn.Activation("relu"), nn.Dense(10))
    else:   # "axis 2": normalise each of the 6 rows of (N, 4, 6, 6)
        net.add(nn.Conv2D(4, 3), nn.BatchNorm(axis=2), nn.Activation("relu"), nn.Dense(10))
    net.initialize(mx.init.Xavier())
    net.cast("float64")
    net(mx.nd.zeros((1, 1, 8, 8), dtype="float64"))
    return net


@pytest.mark.parametrize("variant", ["conv1d, fixed gamma", "axis 2"])
def test_synchronized_batchnorm_equals_mxnets_batchnorm_on_one_context(variant):
    """K=1 runs MXNet's own BatchNorm operator in the cached graph; K=3 the synchronized one, shards 4, 3, 3."""
    data = batches([10, 7])
    want = train(_batchnorm_variant(variant), 1, data, steps=2)[0]
    got = train(_batchnorm_variant(variant), 3, data, steps=2)
    for params in got:
        assert_same_model(params, want)


def test_evaluation_agrees_on_every_context_after_synchronized_training():
    block = small_cnn(batchnorm=True)
    got = train(block, 3, batches([10, 9]), steps=2)
    X, y = batches([12], seed=1)[0]
    net = GluonNet(block)
    outputs = [net(X.as_in_context(params[0].context), params).asnumpy() for params in got]
    for out in outputs[1:]:
        np.testing.assert_array_equal(out, outputs[0])
    scores = [evaluate_accuracy([(X, y)], [params], [params[0].context], net=block) for params in got]
    assert scores == [evaluate_accuracy([(X, y)], got, contexts(3), net=block)] * 3


def test_without_synchronization_batchnorm_is_not_the_one_context_model():
    """What the README says: each context normalises its own shard; models and running statistics differ."""
    data = batches([10, 7])
    want = train(small_cnn(batchnorm=True), 1, data)[0]
    block = small_cnn(batchnorm=True)
    got = train(block, 2, data, net=GluonNet(block, sync_batchnorm=False))
    with pytest.raises(AssertionError):
        assert_same_parameters([got[0][0].asnumpy()], [want[0].asnumpy()], "float64")
    assert not np.array_equal(got[0].aux[0].asnumpy(), got[1].aux[0].asnumpy())   # per-replica statistics


def test_forward_all_outputs_and_gradients_equal_one_context():
    """The lockstep forward of synchronized BatchNorm: outputs and summed gradients of one context."""
    block = small_cnn(batchnorm=True)
    net = GluonNet(block)
    (X, y), = batches([11])
    loss = gluon.loss.SoftmaxCrossEntropyLoss()
    results = {}
    for k in (1, 4):
        ctx_list = contexts(k)
        device_params = [get_params(block, ctx) for ctx in ctx_list]
        with autograd.record():
            outputs = net.forward_all(split_and_load(X, ctx_list), device_params)
            losses = [loss(out, y_shard) for out, y_shard in zip(outputs, split_and_load(y, ctx_list))]
        autograd.backward(losses)
        grads = [sum(params[i].grad.asnumpy() for params in device_params) for i in range(len(net.names))]
        results[k] = np.concatenate([out.asnumpy() for out in outputs]), grads
    np.testing.assert_allclose(results[4][0], results[1][0], rtol=1e-10)
    for g4, g1 in zip(results[4][1], results[1][1]):
        np.testing.assert_allclose(g4, g1, rtol=1e-8, atol=1e-12 * max(np.abs(g1).max(), 1))


def test_set_block_params_hands_the_trained_model_to_gluon():
    block = small_cnn(batchnorm=True)
    params = train(block, 2, batches([10]))[0]
    X = batches([4], seed=2)[0][0]
    before = block(X).asnumpy()
    set_block_params(block, params)
    after = block(X).asnumpy()
    assert not np.allclose(before, after)
    np.testing.assert_allclose(after, GluonNet(block)(X, params).asnumpy(), rtol=1e-12)
    with pytest.raises(ValueError, match="not a replica of this block"):
        set_block_params(small_cnn(), params)


def test_train_step_returns_loss_and_correct_for_a_block():
    block = small_cnn(dtype="float32")
    ctx_list = contexts(2)
    device_params = [get_params(block, ctx) for ctx in ctx_list]
    X, y = batches([9], dtype="float32")[0]
    loss, correct = train_step(X, y, device_params, ctx_list, 0.1, net=block)
    assert 0 <= correct.asscalar() <= 9 and loss.asscalar() > 0


def test_training_a_block_writes_nothing_onto_it_and_reuses_its_graph_function():
    """The block is the user's: training through it (``as_net``, which makes its ``GluonNet``) adds no attribute
    to it, and its ``GluonNet`` is made once, not once a step."""
    from parallel.models.gluon import as_net
    block = small_cnn(dtype="float32")
    before = set(vars(block))
    ctx_list = contexts(2)
    device_params = [get_params(block, ctx) for ctx in ctx_list]
    for X, y in batches([9, 9], dtype="float32"):
        train_step(X, y, device_params, ctx_list, 0.1, net=block)
    assert set(vars(block)) == before
    assert as_net(block) is as_net(block) and isinstance(as_net(block), GluonNet)
    assert as_net(block, sync_batchnorm=False).sync_batchnorm is False


def test_blocks_without_values_or_graph_are_refused():
    deferred = nn.HybridSequential()
    deferred.add(nn.Dense(3))
    deferred.initialize()
    with pytest.raises(ValueError, match="run the block once on an example batch"):
        get_params(deferred, mx.cpu())
    uninitialized = nn.Dense(3, in_units=4)
    with pytest.raises(ValueError, match="call block.initialize"):
        get_params(uninitialized, mx.cpu())

    class Imperative(gluon.Block):
        def forward(self, X):
            return X

    with pytest.raises(TypeError, match="HybridBlock"):
        GluonNet(Imperative())
    with pytest.raises(TypeError, match="sync_batchnorm must be True or False"):
        GluonNet(small_cnn(), sync_batchnorm="yes")
    net = GluonNet(small_cnn())
    with pytest.raises(ValueError, match="replica of another block"):
        net(mx.nd.zeros((1, 1, 8, 8), dtype="float64"), get_params(small_cnn(batchnorm=True), mx.cpu()))
