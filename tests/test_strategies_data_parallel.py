"""DataParallel (PyTorch style): the classic printout, outputs equal to one context, summed gradients."""
import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd, gluon

from parallel import (get_params, init_lenet_params, lenet, softmax_cross_entropy,
                      train_batch)
from parallel import allreduce_grads
from parallel.strategies import DataParallel, data_parallel, gather, replicate
from conftest import contexts


class Model(gluon.nn.Block):
    """PyTorch's DataParallel tutorial model: one dense layer that prints its input and output sizes."""

    def __init__(self, input_size, output_size, **kwargs):
        super().__init__(**kwargs)
        self.fc = gluon.nn.Dense(output_size, in_units=input_size)

    def forward(self, x):
        output = self.fc(x)
        print("\tIn Model: input size", x.shape, "output size", output.shape)
        return output


def test_the_classic_printout(capsys):
    """100 examples of 5 features in batches of 30 over 2 contexts, as in PyTorch's tutorial."""
    model = Model(5, 2)
    model.initialize()
    model = DataParallel(model, contexts(2))
    data = mx.nd.array(np.random.RandomState(0).randn(100, 5))
    for start in range(0, 100, 30):
        X = data[start:start + 30]
        output = model(X)
        print("Outside: input size", X.shape, "output size", output.shape)
    lines = [line.strip() for line in capsys.readouterr().out.splitlines()]
    batch = ["In Model: input size (15, 5) output size (15, 2)"] * 2 + \
            ["Outside: input size (30, 5) output size (30, 2)"]
    last = ["In Model: input size (5, 5) output size (5, 2)"] * 2 + \
           ["Outside: input size (10, 5) output size (10, 2)"]
    assert lines == batch * 3 + last


def dense_net(dtype="float64"):
    net = gluon.nn.Sequential()
    net.add(gluon.nn.Dense(8, in_units=5, activation="relu", dtype=dtype), gluon.nn.Dense(3, in_units=8, dtype=dtype))
    net.initialize(mx.init.Xavier(), ctx=mx.cpu(0))
    return net


def copy_values(src, dst):
    for a, b in zip(src.collect_params().values(), dst.collect_params().values()):
        b.set_data(a.data(a.list_ctx()[0]))


@pytest.mark.parametrize("k", [2, 3, 4])
@pytest.mark.parametrize("n", [1, 3, 7, 30])
def test_block_outputs_equal_one_context(k, n):
    net = dense_net()
    X = mx.nd.array(np.random.RandomState(n).randn(n, 5), dtype="float64")
    want = net(X).asnumpy()
    out = DataParallel(net, contexts(k))(X)
    assert out.context == mx.cpu(0) and out.shape == (n, 3)
    np.testing.assert_allclose(out.asnumpy(), want, rtol=1e-12)
    assert net[0].weight.list_ctx() == contexts(k)   # the block's parameters now live on every context


@pytest.mark.parametrize("k", [2, 4])
def test_function_outputs_equal_one_context(k):
    params = init_lenet_params(seed=0)
    X = mx.nd.array(np.random.RandomState(1).rand(11, 1, 28, 28))
    model = DataParallel(lenet, contexts(k), params=params)
    np.testing.assert_allclose(model(X).asnumpy(), lenet(X, params).asnumpy(), rtol=1e-5, atol=1e-7)
    out = data_parallel(lenet, X, contexts(k), replicate(params, contexts(k)), output_ctx=mx.cpu(1))
    assert out.context == mx.cpu(1)
    np.testing.assert_allclose(out.asnumpy(), lenet(X, params).asnumpy(), rtol=1e-5, atol=1e-7)


def test_gather_keeps_tuples_and_order():
    outs = [(mx.nd.full((2, 1), i, ctx=mx.cpu(i)), mx.nd.full((2,), 10 + i, ctx=mx.cpu(i))) for i in range(3)]
    a, b = gather(outs, mx.cpu(0))
    assert a.context == b.context == mx.cpu(0)
    assert a.asnumpy().ravel().tolist() == [0, 0, 1, 1, 2, 2] and b.asnumpy().tolist() == [10, 10, 11, 11, 12, 12]


def block_step(model, X, y, lr, trainer=None):
    loss_fn = gluon.loss.L2Loss()
    with autograd.record():
        loss = loss_fn(model(X), y.as_in_context(mx.cpu(0)))
    loss.backward()
    if trainer is None:
        model.step(lr, X.shape[0])
    else:
        trainer.step(X.shape[0])


SIZES = [7, 1, 12, 5]   # uneven; a batch of 1 leaves idle replicas whose stale gradients must not count


def block_batches(dtype="float64"):
    rng = np.random.RandomState(7)
    return [(mx.nd.array(rng.randn(n, 5), dtype=dtype), mx.nd.array(rng.randn(n, 3), dtype=dtype)) for n in SIZES]


@pytest.mark.parametrize("k", [2, 4])
def test_block_training_equals_one_context(k):
    """step() = allreduce_grads() + update(): every context ends with the one-context parameters."""
    reference = dense_net()
    model = dense_net()
    copy_values(reference, model)
    start = [p.data().asnumpy() for p in reference.collect_params().values()]
    one, many = DataParallel(reference, contexts(1)), DataParallel(model, contexts(k))
    for X, y in block_batches():
        block_step(one, X, y, 0.1)
        block_step(many, X, y, 0.1)
    for p_one, p_many, initial in zip(reference.collect_params().values(), model.collect_params().values(), start):
        want = p_one.data(mx.cpu(0)).asnumpy()
        assert not np.allclose(want, initial)
        for ctx in contexts(k):
            np.testing.assert_allclose(p_many.data(ctx).asnumpy(), want, rtol=1e-5, atol=0)


@pytest.mark.parametrize("k", [2, 4])
def test_gluon_trainer_sums_the_contexts_itself(k):
    """With gluon's Trainer (which reduces the contexts' gradients itself) the wrapper needs no allreduce."""
    reference, model = dense_net(), dense_net()
    copy_values(reference, model)
    start = reference[0].weight.data().asnumpy()
    one = DataParallel(reference, contexts(1))
    many = DataParallel(model, contexts(k))
    trainers = [gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1}) for net in (reference, model)]
    for X, y in block_batches():
        block_step(one, X, y, None, trainers[0])
        block_step(many, X, y, None, trainers[1])
    want = reference[0].weight.data().asnumpy()
    assert not np.allclose(want, start)
    for ctx in contexts(k):
        np.testing.assert_allclose(model[0].weight.data(ctx).asnumpy(), want, rtol=1e-5, atol=0)


@pytest.mark.parametrize("k", [2, 4])
def test_allreduce_grads_leaves_the_full_batch_gradient_everywhere(k):
    """After backward each context holds its shard's gradient; after allreduce_grads, primary and every
    replica hold the gradient of the whole batch (a sum, not a mean), even for idle contexts."""
    params = init_lenet_params(seed=0, dtype="float64")
    one = get_params(params, mx.cpu(0))
    model = DataParallel(lenet, contexts(k), params=params)
    rng = np.random.RandomState(2)
    for n in (9, 1):   # the second batch leaves k-1 contexts idle with the first batch's gradients
        X = mx.nd.array(rng.rand(n, 1, 28, 28), dtype="float64")
        y = mx.nd.array(rng.randint(0, 10, n), dtype="float64")
        with autograd.record():
            loss = softmax_cross_entropy(lenet(X, one), y)
        loss.backward()
        with autograd.record():
            loss = softmax_cross_entropy(model(X), y)
        loss.backward()
        if n > 1:
            shard = model.device_params[0][0].grad.asnumpy()
            assert not np.allclose(shard, one[0].grad.asnumpy())   # one shard's gradient, not the batch's
        model.allreduce_grads()
        for replica in model.device_params:
            for got, want in zip(replica, one):
                np.testing.assert_allclose(got.grad.asnumpy(), want.grad.asnumpy(), rtol=1e-10, atol=1e-15)


@pytest.mark.parametrize("k", [2, 4])
def test_function_training_equals_train_batch(k):
    """DataParallel over lenet with step() is the same SGD step as train_batch on one context."""
    rng = np.random.RandomState(0)
    batches = [(mx.nd.array(rng.rand(n, 1, 28, 28), dtype="float64"),
                mx.nd.array(rng.randint(0, 10, n), dtype="float64")) for n in (7, 1, 13, 5)]
    device_params = [get_params(init_lenet_params(seed=0, dtype="float64"), mx.cpu(0))]
    for X, y in batches:
        train_batch(X, y, device_params, contexts(1), 0.2)
    model = DataParallel(lenet, contexts(k), params=init_lenet_params(seed=0, dtype="float64"))
    for X, y in batches:
        with autograd.record():
            loss = softmax_cross_entropy(model(X), y)
        loss.backward()
        model.step(0.2, X.shape[0])
    for replica in model.device_params:
        for got, want in zip(replica, device_params[0]):
            np.testing.assert_allclose(got.asnumpy(), want.asnumpy(), rtol=1e-5, atol=0)


def test_allreduce_grads_function_sums_replicas():
    ctx_list = contexts(3)
    device_params = replicate([mx.nd.zeros((2,))], ctx_list)
    for i, params in enumerate(device_params):
        params[0].grad[:] = i + 1
    allreduce_grads(device_params, "naive", active=2)   # the third replica was idle: it counts as zero
    for params in device_params:
        assert params[0].grad.asnumpy().tolist() == [3, 3]


def test_deferred_initialization_and_a_first_batch_smaller_than_the_contexts():
    """A Dense layer without in_units learns its shape on the first call, even one that idles contexts."""
    net = gluon.nn.Dense(2)
    net.initialize(mx.init.One())
    model = DataParallel(net, contexts(3))
    X = mx.nd.ones((1, 4))
    with autograd.record():
        out = model(X)
    out.backward()
    model.step(0.5, 1)
    assert out.asnumpy().tolist() == [[4.0, 4.0]]
    for ctx in contexts(3):   # grad of the sum w.r.t. W is 1 everywhere: W = 1 - 0.5 * 1
        assert net.weight.data(ctx).asnumpy().tolist() == [[0.5] * 4] * 2


def test_bad_arguments():
    with pytest.raises(TypeError, match="is a function: pass its parameters with params="):
        DataParallel(lenet, contexts(2))
    net = dense_net()
    with pytest.raises(TypeError, match="a gluon Block holds its own parameters: drop params="):
        DataParallel(net, contexts(2), params=init_lenet_params())
    with pytest.raises(ValueError, match="is not initialized; call block.initialize"):
        DataParallel(gluon.nn.Dense(2), contexts(2))
    with pytest.raises(TypeError, match="must be a gluon Block or a function"):
        DataParallel(42, contexts(2))
    with pytest.raises(ValueError, match=r"ctx_list\[1\] repeats cpu\(0\)"):
        DataParallel(net, [mx.cpu(0), mx.cpu(0)])
    with pytest.raises(ValueError, match="3 contexts but 2 replicas"):
        data_parallel(lenet, mx.nd.ones((4, 1, 28, 28)), contexts(3), replicate(init_lenet_params(), contexts(2)))
    model = DataParallel(lenet, contexts(2), params=init_lenet_params())
    with pytest.raises(ValueError, match="lr must be a finite number > 0"):
        model.step(-1.0, 4)
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        model.update(0.1, 0)


@pytest.mark.parametrize("k, sync, accumulate, says", [
    (2, True, 1, ", BatchNorm over the whole batch"),
    (2, True, 3, ", BatchNorm over each of the 3 micro-batches alone"),   # not the whole batch any more
    (1, True, 2, ", BatchNorm over each of the 2 micro-batches alone"),
    (2, False, 1, ", BatchNorm per context"),
    (2, False, 2, ", BatchNorm per context and micro-batch"),
    (1, True, 1, None),
])
def test_the_header_says_what_batchnorm_normalises_over(k, sync, accumulate, says):
    """The run's header (describe) under --accumulate: each micro-batch normalises alone, not the whole batch."""
    from conftest import small_cnn
    from parallel import GluonNet
    block = small_cnn(batchnorm=True, dtype="float32")
    line = DataParallel(GluonNet(block, sync_batchnorm=sync), contexts(k), params=block).describe(accumulate)
    if says is None:
        assert "BatchNorm" not in line, line
    else:
        assert line.endswith(says) and line.count("BatchNorm") == 1, line
