"""No stale gradient: a parameter a step does not use gets a zero gradient on every context and worker (MXNet's
backward writes only what it reaches, so it would otherwise keep, and apply again, the last step's), on every path
that trains a user's network; gluon's Trainer with AllreduceKVStore refuses, naming the parameter (its own check).

Each test trains a network whose second branch is used on odd steps only, on 2 contexts, against one context
computing the same steps by hand (float64: only rounding can differ)."""
import re

import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd, gluon

from parallel import AllreduceKVStore, Reducer, get_params, train_batch
from parallel.models.lenet import softmax_cross_entropy
from parallel.step import may_skip_parameters
from parallel.strategies import DataParallel
from conftest import assert_same_parameters, contexts, in_threads

STEPS, LR = 4, 0.5


def _batch(t, n=6):
    rng = np.random.RandomState(t)
    return mx.nd.array(rng.normal(size=(n, 4)), dtype="float64"), mx.nd.array(rng.randint(0, 3, n), dtype="float64")


def _initial():
    rng = np.random.RandomState(0)
    return [mx.nd.array(rng.normal(size=shape), dtype="float64") for shape in ((3, 4), (3,), (3, 4), (3,))]


def _branchy(X, params, use_b):
    a_w, a_b, b_w, b_b = params
    out = mx.nd.FullyConnected(X, a_w, a_b, num_hidden=3)
    return out + mx.nd.FullyConnected(X, b_w, b_b, num_hidden=3) if use_b else out


class Alternating:
    """``net(X, params)`` that uses its second layer on odd steps only (the test sets ``step``)."""

    def __init__(self):
        self.step = 0

    def __call__(self, X, params):
        return _branchy(X, params, self.step % 2 == 1)


def _by_hand(initial):
    """One context, plain SGD, an unused parameter's gradient zero."""
    params = [p.copy() for p in initial]
    for p in params:
        p.attach_grad()
    for t in range(STEPS):
        X, y = _batch(t)
        with autograd.record():
            loss = softmax_cross_entropy(_branchy(X, params, t % 2 == 1), y)
        loss.backward()
        for i, p in enumerate(params):
            used = i < 2 or t % 2 == 1
            p[:] = p - LR * (p.grad if used else mx.nd.zeros_like(p)) / X.shape[0]
    return [p.asnumpy() for p in params]


def test_only_cached_graphs_are_known_to_reach_every_parameter():
    from parallel.models.lenet import lenet, lenet_cached
    assert not may_skip_parameters(lenet_cached)
    assert may_skip_parameters(lenet) and may_skip_parameters(Alternating())


@pytest.mark.parametrize("path", ["train_batch", "DataParallel.train_step"])
def test_a_function_that_skips_a_parameter_gives_it_a_zero_gradient(path):
    ctx_list, net = contexts(2), Alternating()
    device_params = [get_params(_initial(), ctx) for ctx in ctx_list]
    dp = DataParallel(net, ctx_list, params=_initial()) if path != "train_batch" else None
    for t in range(STEPS):
        net.step = t
        X, y = _batch(t)
        if dp is None:
            train_batch(X, y, device_params, ctx_list, lr=LR, net=net)
        else:
            dp.train_step(X, y, lr=LR)
    replicas = device_params if dp is None else dp.device_params
    want = _by_hand(_initial())
    for replica in replicas:
        assert_same_parameters([p.asnumpy() for p in replica], want, "float64")


def test_every_worker_of_a_job_gives_an_unused_parameter_a_zero_gradient(threads_reduce_at_once):
    """Two workers (threads, a kvstore that sums as ps-lite's servers do) of one context each, the global batch
    split between them: the same steps as one context by hand."""
    def work(job, rank):
        ctx_list, net = [mx.cpu(rank)], Alternating()
        device_params = [get_params(_initial(), ctx) for ctx in ctx_list]
        reducer = Reducer(job=job)
        for t in range(STEPS):
            net.step = t
            X, y = _batch(t)
            train_batch(X, y, device_params, ctx_list, lr=LR, net=net, reducer=reducer)
        return [p.asnumpy() for p in device_params[0]]

    results, _ = in_threads(2, work)
    want = _by_hand(_initial())
    for got in results:
        assert_same_parameters(got, want, "float64")


class BranchyBlock(gluon.Block):
    def __init__(self):
        super().__init__()
        self.a, self.b = gluon.nn.Dense(3, in_units=4), gluon.nn.Dense(3, in_units=4)
        self.use_b = False

    def forward(self, X):
        return self.a(X) + self.b(X) if self.use_b else self.a(X)


def _block(ctx_list):
    block = BranchyBlock()
    block.cast("float64")
    block.initialize(ctx=ctx_list)
    for param, value in zip(block.collect_params().values(), _initial()):
        param.set_data(value)
    return block


@pytest.mark.parametrize("path", ["train_step", "forward, backward, step"])
def test_a_gluon_block_whose_branch_skips_a_step_gives_its_parameters_a_zero_gradient(path):
    ctx_list = contexts(2)
    block = _block(ctx_list)
    dp = DataParallel(block, ctx_list)
    for t in range(STEPS):
        block.use_b = t % 2 == 1
        X, y = _batch(t)
        if path == "train_step":
            dp.train_step(X, y, lr=LR)
        else:
            with autograd.record():
                out = dp(X)
                loss = softmax_cross_entropy(out, y.as_in_context(out.context))
            loss.backward()
            dp.step(LR, X.shape[0])
    want = _by_hand(_initial())
    for ctx in ctx_list:
        assert_same_parameters([p.data(ctx).asnumpy() for p in block.collect_params().values()], want, "float64")


def test_gluon_trainer_with_allreduce_kvstore_refuses_a_stale_gradient_naming_the_parameter():
    ctx_list = contexts(2)
    block = _block(ctx_list)
    trainer = gluon.Trainer(block.collect_params(), "sgd", {"learning_rate": LR}, kvstore=AllreduceKVStore())
    names = "|".join(re.escape(p.name) for p in (block.b.weight, block.b.bias))
    with pytest.raises(UserWarning, match=rf"Gradient of Parameter `({names})` on context cpu\(0\) has not been "
                                          r"updated by backward"):
        for t in range(STEPS):
            block.use_b = t % 2 == 1   # steps 0, 2 skip b: at step 2 its gradient is step 1's
            X, y = _batch(t)
            with autograd.record():
                losses = [softmax_cross_entropy(block(Xs), ys) for Xs, ys in
                          zip(gluon.utils.split_and_load(X, ctx_list), gluon.utils.split_and_load(y, ctx_list))]
            autograd.backward(losses)
            trainer.step(X.shape[0])
    assert t == 0   # step 0 already: b was never reached
