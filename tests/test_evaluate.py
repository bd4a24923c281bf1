import mxnet as mx
import numpy as np
import pytest

from parallel import evaluate_accuracy, get_params, init_lenet_params, lenet
from conftest import contexts


def test_accuracy_uses_every_context_and_matches_single_context():
    rng = np.random.RandomState(0)
    params = init_lenet_params(seed=0)
    params[-1][:] = mx.nd.array(rng.randn(10))   # make predictions depend on the bias
    batches = [(mx.nd.array(rng.rand(n, 1, 28, 28)), mx.nd.array(rng.randint(0, 10, n))) for n in (5, 3)]
    labels = np.concatenate([y.asnumpy() for _, y in batches])
    predicted = np.concatenate([lenet(X, params).argmax(axis=1).asnumpy() for X, _ in batches])
    expected = (predicted == labels).mean()
    for k in (1, 2, 3):
        ctx_list = contexts(k)
        device_params = [get_params(params, c) for c in ctx_list]
        assert evaluate_accuracy(batches, device_params, ctx_list) == pytest.approx(expected)

    # the shards really run on their own replicas: with labels equal to the predictions (accuracy 1),
    # force the replica on cpu(1) to a class nobody predicts; only cpu(0)'s shards (3 + 2 of 8) stay right
    relabelled = [(X, mx.nd.array(lenet(X, params).argmax(axis=1))) for X, _ in batches]
    ctx_list = contexts(2)
    device_params = [get_params(params, c) for c in ctx_list]
    assert evaluate_accuracy(relabelled, device_params, ctx_list) == 1.0
    unused = sorted(set(range(10)) - set(predicted.tolist()))[0]
    device_params[1][-1][:] = mx.nd.array(np.eye(10)[unused] * 1e6)
    assert evaluate_accuracy(relabelled, device_params, ctx_list) == pytest.approx(5 / 8)


def test_empty_iterator_and_mismatch():
    ctx_list = contexts(2)
    device_params = [get_params(init_lenet_params(), c) for c in ctx_list]
    with pytest.raises(ValueError, match="no examples"):
        evaluate_accuracy([], device_params, ctx_list)
    with pytest.raises(ValueError, match="2 replicas but ctx_list has 1"):
        evaluate_accuracy([], device_params, contexts(1))
