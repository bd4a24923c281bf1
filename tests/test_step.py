"""The invariant: training on K contexts is the same computation as training on one."""
import mxnet as mx
import numpy as np
import pytest

from parallel import (ALLREDUCE_ALGORITHMS, get_params, init_lenet_params, train_batch,
                      train_step)
from conftest import assert_same_parameters, contexts, diagonal, make_batches


def train(k, batches, dtype="float32", algorithm="naive", lr=0.2):
    ctx_list = contexts(k)
    device_params = [get_params(init_lenet_params(seed=0, dtype=dtype), c) for c in ctx_list]
    losses = [train_batch(X, y, device_params, ctx_list, lr, reducer=algorithm) for X, y in batches]
    return [[p.asnumpy() for p in params] for params in device_params], [l.asscalar() for l in losses]


def assert_replicas_identical(replicas):
    for replica in replicas[1:]:
        for a, b in zip(replica, replicas[0]):
            np.testing.assert_array_equal(a, b)


# Batch sizes: 1 (smaller than every K > 1), smaller than K, indivisible, divisible, the odd last batch.
SIZES = [1, 2, 3, 4, 5, 7, 12, 13]


@pytest.mark.parametrize("k, algorithm", diagonal([1, 2, 3, 4, 5], sorted(ALLREDUCE_ALGORITHMS)))
def test_k_contexts_equal_one_context_float64(k, algorithm):
    """Elementwise relative tolerance 1e-5 in float64, where only rounding can differ."""
    batches = make_batches(SIZES, dtype="float64")
    reference, ref_losses = train(1, batches, "float64")
    replicas, losses = train(k, batches, "float64", algorithm)
    assert_replicas_identical(replicas)
    assert_same_parameters(replicas[0], reference[0], "float64")
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert not np.allclose(reference[0][0], init_lenet_params(0, dtype="float64")[0].asnumpy())


@pytest.mark.parametrize("k, batch_size", diagonal([2, 3, 4, 5], [1, 2, 3, 5, 6, 17]))
def test_k_contexts_equal_one_context_float32(k, batch_size):
    """float32, several steps of one batch size: relative tolerance 1e-5 of each parameter's scale
    (elementwise, summation order moves values near zero by ~1e-7 absolute)."""
    batches = make_batches([batch_size] * 4, seed=batch_size)
    reference, ref_losses = train(1, batches)
    replicas, losses = train(k, batches)
    assert_replicas_identical(replicas)
    assert_same_parameters(replicas[0], reference[0], "float32")
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)


def test_step_matches_a_numpy_free_reference_update():
    """One step by hand: gradient on one context, param -= lr * grad / n."""
    from mxnet import autograd
    from parallel import lenet, softmax_cross_entropy
    (X, y), = make_batches([6], seed=5)
    params = get_params(init_lenet_params(seed=0), mx.cpu())
    with autograd.record():
        loss = softmax_cross_entropy(lenet(X, params), y)
    loss.backward()
    expected = [(p - 0.2 * p.grad / 6).asnumpy() for p in params]
    replicas, _ = train(3, [(X, y)])
    assert_same_parameters(replicas[1], expected, "float32")


def test_train_step_counts_correct_predictions():
    (X, y), = make_batches([9], seed=2)
    ctx_list = contexts(2)
    device_params = [get_params(init_lenet_params(seed=0), c) for c in ctx_list]
    from parallel import lenet
    predicted = lenet(X, init_lenet_params(seed=0)).argmax(axis=1).asnumpy()
    loss, correct = train_step(X, y, device_params, ctx_list, 0.1)
    assert loss.context == mx.cpu(0) and correct.context == mx.cpu(0)
    assert correct.asscalar() == (predicted == y.asnumpy()).sum()
    assert loss.asscalar() > 0


def test_bad_arguments():
    (X, y), = make_batches([4])
    ctx_list = contexts(2)
    device_params = [get_params(init_lenet_params(), c) for c in ctx_list]
    for lr in (0, -1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="lr must be a finite number > 0"):
            train_batch(X, y, device_params, ctx_list, lr)
    with pytest.raises(TypeError, match="lr must be a number"):
        train_batch(X, y, device_params, ctx_list, "0.1")
    with pytest.raises(ValueError, match="2 replicas but ctx_list has 3"):
        train_batch(X, y, device_params, contexts(3), 0.1)
    with pytest.raises(ValueError, match=r"device_params\[1\]\[0\] is on cpu\(1\)"):
        train_batch(X, y, device_params, [mx.cpu(0), mx.cpu(2)], 0.1)
    with pytest.raises(ValueError, match="4 examples but y has 3"):
        train_batch(X, y[:3], device_params, ctx_list, 0.1)


@pytest.mark.parametrize("algorithm", sorted(ALLREDUCE_ALGORITHMS))
def test_plain_list_replicas_take_the_textbook_path(algorithm):
    """Replicas built by hand (copyto + attach_grad, as in the textbook) are not flat: their gradients summed in the
    reducer's buckets (``Reducer.reduce_arrays``) and the per-tensor SGD step, with the same result as flat
    replicas."""
    batches = make_batches([5, 3], dtype="float64")
    ctx_list = contexts(3)
    plain = []
    for ctx in ctx_list:
        params = [p.copyto(ctx) for p in init_lenet_params(seed=0, dtype="float64")]
        for p in params:
            p.attach_grad()
        plain.append(params)
    for X, y in batches:
        train_batch(X, y, plain, ctx_list, 0.2, reducer=algorithm)
    flat, _ = train(3, batches, "float64", algorithm)
    assert_same_parameters([p.asnumpy() for p in plain[2]], flat[2], "float64")


@pytest.mark.parametrize("bad", [10, 11, -1, 2.5])
def test_labels_outside_the_classes_are_refused_before_any_update(bad):
    """Softmax cross-entropy clips a label >= 10 to class 9 and trains on silently; it must raise instead,
    before any replica changes."""
    ctx_list = contexts(2)
    device_params = [get_params(init_lenet_params(seed=0), c) for c in ctx_list]
    before = [p.asnumpy() for p in device_params[0]]
    X, y = make_batches([6])[0]
    y[3] = bad
    with pytest.raises(ValueError, match=r"label y\[3\] = .* is not one of the network's 10 classes"):
        train_batch(X, y, device_params, ctx_list, lr=0.2)
    for params in device_params:
        for p, b in zip(params, before):
            np.testing.assert_array_equal(p.asnumpy(), b)


def test_strategies_refuse_labels_outside_the_classes():
    from parallel.strategies import Hybrid, ModelParallel, Pipeline
    X, y = make_batches([8])[0]
    y[0] = 12
    for model in (ModelParallel(init_lenet_params(), contexts(2)), Pipeline(init_lenet_params(), contexts(2)),
                  Hybrid(init_lenet_params(), contexts(4))):
        with pytest.raises(ValueError, match=r"label y\[0\] = 12 is not one of the network's 10 classes"):
            model.train_step(X, y, lr=0.1)


def test_evaluation_runs_the_cached_graph_training_uses():
    import inspect
    from parallel import evaluate_accuracy, lenet_cached
    assert inspect.signature(evaluate_accuracy).parameters["net"].default is lenet_cached


def test_a_fence_orders_later_reads_after_the_operations_it_reads():
    """``parallel.engine.fence``: what is queued on its writes waits for what was queued on its reads, here an
    operation that takes 0.3 s; without the fence the read would return at once."""
    import time
    from parallel.engine import ENGINE_SYNC_FUNC, fence, push_sync
    slow, later = mx.nd.zeros((1,), ctx=mx.cpu(0)), mx.nd.zeros((1,), ctx=mx.cpu(1))
    done = []
    work = ENGINE_SYNC_FUNC(lambda run_context, param: (time.sleep(0.3), done.append(True)))
    push_sync(work, mx.cpu(0), writes=[slow])
    fence([slow], [later])
    later.wait_to_read()
    assert done == [True]
    slow.wait_to_read()   # the operation has run: its callback may go


def test_fences_and_marks_run_no_python():
    """Their empty operation was a Python callback, which MXNet's engine thread can run only once it holds the
    interpreter's lock: up to 5 ms while the main thread issues operators (5.1 ms measured against 6 us), during
    which that context ran nothing, at every fence (each step of a network with BatchNorm) and every mark of a
    trace, whose forward then started after backward operators that need none of its values. It is a C function."""
    import ctypes
    from parallel import engine
    address = ctypes.cast(engine.NOTHING, ctypes.c_void_p).value
    assert address == ctypes.cast(ctypes.CDLL(None).pthread_self, ctypes.c_void_p).value


@pytest.mark.parametrize("accumulate", [1, 2])
def test_the_statistics_fence_follows_the_reductions(monkeypatch, accumulate):
    """The fence reads every gradient bucket, and a bucket's reduction writes it: a fence queued before the
    reductions would hold every bucket's reduction back until the whole backward pass had run (measured: on two
    hosts the first bucket's pull waited 330 ms for it). With every replica busy, the step's last fence is queued
    after the reductions, the earlier micro-batches' before the next micro-batch."""
    import parallel.comm.reducer
    import parallel.step
    from conftest import small_cnn
    order = []
    real_fence, real_reduce = parallel.step.fence, parallel.comm.reducer.Reducer.reduce
    monkeypatch.setattr(parallel.step, "fence", lambda reads, writes: order.append("fence") or
                        real_fence(reads, writes))
    monkeypatch.setattr(parallel.comm.reducer.Reducer, "reduce", lambda self, *a, **k: order.append("reduce") or
                        real_reduce(self, *a, **k))
    block = small_cnn(batchnorm=True, dtype="float32")
    ctx = contexts(2)
    device_params = [get_params(block, c, bucket_mb=0.001) for c in ctx]
    (X, y), = make_batches([8])
    train_step(X[:, :, :8, :8], y, device_params, ctx, 0.1, net=block, accumulate=accumulate)
    assert len(device_params[0].buckets) > 1
    assert order == ["fence"] * 2 * (accumulate - 1) + ["reduce"] + ["fence"] * 2


def test_the_step_fences_running_statistics_after_backward(monkeypatch):
    """BatchNorm's backward pass writes the running statistics without telling MXNet's engine: the step orders them
    after every gradient of their replica, so that an idle replica's copy of them (a batch smaller than the
    replicas) reads the updated values (under load it read the old ones: tests/test_strategies_gluon.py)."""
    import parallel.step
    from conftest import small_cnn
    calls = []
    real = parallel.step.fence
    monkeypatch.setattr(parallel.step, "fence", lambda reads, writes: calls.append((reads, writes)) or
                        real(reads, writes))
    block = small_cnn(batchnorm=True, dtype="float32")
    ctx = contexts(2)
    device_params = [get_params(block, c) for c in ctx]
    (X, y), = make_batches([1])
    train_step(X[:, :, :8, :8], y, device_params, ctx, 0.1, net=block)
    # before the idle replica's copy of the statistics, and again once the step's reductions are queued
    assert [(len(reads), len(writes)) for reads, writes in calls] == [(1, 4)] * 4
    assert calls[0][0][0] is device_params[0].grad and calls[0][1] == device_params[0].aux
    mx.nd.waitall()
    for a, b in zip(device_params[0].aux, device_params[1].aux):
        np.testing.assert_array_equal(a.asnumpy(), b.asnumpy())
