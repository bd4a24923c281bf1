"""Every cross-context transfer in the package is an explicit copy: what GPUs demand, checked on CPUs."""
import mxnet as mx
import numpy as np
import pytest

from parallel import (ALLREDUCE_ALGORITHMS, evaluate_accuracy, get_params, init_lenet_params, lenet,
                      lenet_cached, train_batch)
from conftest import contexts, easy_dataset


def test_the_guard_catches_a_mix(strict_contexts):
    a, b = mx.nd.ones(2, ctx=mx.cpu(0)), mx.nd.ones(2, ctx=mx.cpu(1))
    with pytest.raises(AssertionError, match="mixes contexts"):
        a + b
    with pytest.raises(AssertionError, match="mixes contexts"):
        mx.nd.add_n(a, b)
    with pytest.raises(AssertionError, match="mixes contexts"):
        mx.nd.add_n(a, a, out=b)
    assert (a + b.copyto(a.context)).asnumpy().tolist() == [2, 2]


@pytest.mark.parametrize("net", [lenet, lenet_cached], ids=["imperative", "cached"])
@pytest.mark.parametrize("algorithm", sorted(ALLREDUCE_ALGORITHMS))
def test_train_batch_copies_explicitly(strict_contexts, algorithm, net):
    ctx_list = contexts(3)
    device_params = [get_params(init_lenet_params(seed=0), c) for c in ctx_list]
    rng = np.random.RandomState(0)
    for n in (7, 2):   # an indivisible batch, and one smaller than K (an idle replica)
        X, y = mx.nd.array(rng.rand(n, 1, 28, 28)), mx.nd.array(rng.randint(0, 10, n))
        train_batch(X, y, device_params, ctx_list, 0.1, net=net, reducer=algorithm).asscalar()


def test_textbook_path_and_evaluation_copy_explicitly(strict_contexts):
    ctx_list = contexts(2)
    plain = []
    for ctx in ctx_list:
        params = [p.copyto(ctx) for p in init_lenet_params(seed=0)]
        for p in params:
            p.attach_grad()
        plain.append(params)
    X, y = mx.nd.random.uniform(shape=(5, 1, 28, 28)), mx.nd.array([1, 2, 3, 4, 5])
    train_batch(X, y, plain, ctx_list, 0.1, reducer="naive").asscalar()
    assert 0 <= evaluate_accuracy([(X, y)], plain, ctx_list) <= 1


def test_fit_copies_explicitly(strict_contexts):
    from parallel import RunConfig, fit, init_model, make_strategy
    strategy = make_strategy("data", init_model("lenet"), contexts(2))
    history, _ = fit(easy_dataset(num_train=40, num_test=10), strategy, 0.1, RunConfig(epochs=1, batch_size=16))
    assert history[0]["epoch"] == 1
