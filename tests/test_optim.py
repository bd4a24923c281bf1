"""Optimizers with state on K contexts against MXNet itself: gluon.Trainer with the same optimizer on one context.

Every comparison starts from the same weights and trains on the same batches for at least 20 steps, in float32,
within a relative 1e-5 of each array's scale (``assert_same_parameters``). The batch of 7 gives unequal shards on
2 and 3 contexts.
"""
import math
import sys

import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd, gluon

import parallel.comm.reducer
import parallel.models.gluon
from parallel import get_params, init_lenet_params, train_batch, train_step
from parallel.comm.algorithms import shard_range
from parallel.optim import (SGD, Adam, AdamW, Constant, Cosine, Step, gather_state, load_state, make_optimizer,
                            memory_per_context, optimizer_step)
from conftest import assert_same_parameters, contexts, diagonal, make_batches, small_cnn

LOSS = gluon.loss.SoftmaxCrossEntropyLoss()
STEPS = 20


def batches(n=STEPS, size=7, seed=0):
    rng = np.random.RandomState(seed)
    return [(mx.nd.array(rng.rand(size, 1, 8, 8)), mx.nd.array(rng.randint(0, 10, size))) for _ in range(n)]


@mx.optimizer.register
class ReferenceAdamW(mx.optimizer.Optimizer):
    """AdamW written with plain NDArray operations (MXNet 1.9.1 has no AdamW optimizer): the oracle of the fused
    ``contrib.adamw_update`` the package uses. Decoupled decay, bias correction in the rate, as ``AdamW``."""

    def __init__(self, beta1=0.9, beta2=0.999, epsilon=1e-8, **kwargs):
        super().__init__(**kwargs)
        self.beta1, self.beta2, self.epsilon = beta1, beta2, epsilon

    def create_state(self, index, weight):
        return mx.nd.zeros_like(weight), mx.nd.zeros_like(weight)

    def update(self, index, weight, grad, state):
        self._update_count(index)
        lr, wd, t = self._get_lr(index), self._get_wd(index), self._index_update_count[index]
        mean, var = state
        g = grad * self.rescale_grad
        mean[:] = self.beta1 * mean + (1 - self.beta1) * g
        var[:] = self.beta2 * var + (1 - self.beta2) * g * g
        correction = math.sqrt(1 - self.beta2 ** t) / (1 - self.beta1 ** t)
        weight[:] = weight - lr * (correction * mean / (mx.nd.sqrt(var) + self.epsilon) + wd * weight)


#: (the package's optimizer, gluon.Trainer's name and arguments): each pair the same update.
CASES = {
    "sgd": (lambda **kw: SGD(0.3, **kw), "sgd", {"learning_rate": 0.3}),
    "sgd-wd": (lambda **kw: SGD(0.3, wd=0.01, **kw), "sgd", {"learning_rate": 0.3, "wd": 0.01}),
    "momentum": (lambda **kw: SGD(0.1, momentum=0.9, **kw), "sgd", {"learning_rate": 0.1, "momentum": 0.9}),
    "momentum-wd": (lambda **kw: SGD(0.1, momentum=0.9, wd=0.001, **kw), "sgd",
                    {"learning_rate": 0.1, "momentum": 0.9, "wd": 0.001}),
    "nesterov-wd": (lambda **kw: SGD(0.1, momentum=0.9, nesterov=True, wd=0.001, **kw), "nag",
                    {"learning_rate": 0.1, "momentum": 0.9, "wd": 0.001}),
    "adam": (lambda **kw: Adam(0.01, **kw), "adam", {"learning_rate": 0.01}),
    "adam-wd": (lambda **kw: Adam(0.01, beta1=0.8, beta2=0.99, wd=0.001, **kw), "adam",
                {"learning_rate": 0.01, "beta1": 0.8, "beta2": 0.99, "wd": 0.001}),
    "adamw": (lambda **kw: AdamW(0.01, wd=0.05, **kw), "referenceadamw", {"learning_rate": 0.01, "wd": 0.05}),
}


def trainer_reference(name, args, data, clip_norm=None, seed=0):
    """Train ``small_cnn`` on one context with gluon.Trainer; returns its trained arrays (trainable ones)."""
    net = small_cnn(dtype="float32", seed=seed)
    trainer = gluon.Trainer(net.collect_params(), name, dict(args))
    params = [p for p in net.collect_params().values() if p.grad_req != "null"]
    for X, y in data:
        with autograd.record():
            loss = LOSS(net(X), y)
        loss.backward()
        if clip_norm is None:
            trainer.step(X.shape[0])
        else:   # the gradient of the mean loss, clipped by its global norm, then a step of batch size 1
            grads = [p.grad() for p in params]
            for g in grads:
                g /= X.shape[0]
            gluon.utils.clip_global_norm(grads, clip_norm)
            trainer.step(1)
    return [p.data().asnumpy() for p in params]


def package_run(optimizer, k, data, seed=0, algorithm="fused", accumulate=1):
    """Train the same ``small_cnn`` on k contexts with the package's step; returns every replica's arrays."""
    block = small_cnn(dtype="float32", seed=seed)
    ctx_list = contexts(k)
    device_params = [get_params(block, ctx) for ctx in ctx_list]
    for X, y in data:
        train_step(X, y, device_params, ctx_list, net=block, reducer=algorithm, optimizer=optimizer,
                   accumulate=accumulate)
    return [[p.asnumpy() for p in replica] for replica in device_params]


def assert_replicas_identical(replicas):
    for replica in replicas[1:]:
        for a, b in zip(replica, replicas[0]):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("case, k", diagonal(sorted(CASES), [1, 2, 3]))
def test_every_optimizer_on_k_contexts_matches_gluon_trainer_on_one(case, k):
    make, name, args = CASES[case]
    data = batches()
    want = trainer_reference(name, args, data)
    got = package_run(make(), k, data)
    assert_replicas_identical(got)
    assert_same_parameters(got[0], want, "float32")
    assert not np.allclose(got[0][0], small_cnn(dtype="float32")[0].weight.data().asnumpy())   # it trained


@pytest.mark.parametrize("case", ["momentum", "adam"])
def test_a_schedule_with_warmup_matches_gluon_trainer_with_mxnets_scheduler(case):
    make, name, args = CASES[case]
    data = batches(24)
    scheduler = mx.lr_scheduler.CosineScheduler(max_update=24, base_lr=args["learning_rate"], warmup_steps=5)
    want = trainer_reference(name, {**args, "lr_scheduler": scheduler}, data)
    got = package_run(make(schedule=Cosine(24, warmup_steps=5)), 3, data)
    assert_same_parameters(got[0], want, "float32")


def test_plain_sgd_through_an_optimizer_is_bitwise_the_textbook_lr_step():
    data = batches(5)
    block = small_cnn(dtype="float32")
    ctx_list = contexts(2)
    by_lr = [get_params(block, ctx) for ctx in ctx_list]
    by_optimizer = [get_params(block, ctx) for ctx in ctx_list]
    sgd = SGD(0.3)
    for X, y in data:
        train_step(X, y, by_lr, ctx_list, 0.3, net=block)
        train_step(X, y, by_optimizer, ctx_list, net=block, optimizer=sgd)
    for a, b in zip(by_lr[0], by_optimizer[0]):
        np.testing.assert_array_equal(a.asnumpy(), b.asnumpy())


# ---- schedules: MXNet's own schedulers are the oracle, step by step -------------------------------------------

def test_schedules_give_mxnets_rates_at_every_step():
    base, steps = 0.4, 60
    pairs = [
        (Constant(), lambda t: base),
        (Constant(warmup_steps=7), mx.lr_scheduler.FactorScheduler(step=10 ** 6, factor=1.0, base_lr=base,
                                                                     warmup_steps=7)),
        (Step([10, 25, 40], factor=0.5), mx.lr_scheduler.MultiFactorScheduler([10, 25, 40], 0.5, base_lr=base)),
        (Step([20, 30], factor=0.1, warmup_steps=8),
         mx.lr_scheduler.MultiFactorScheduler([20, 30], 0.1, base_lr=base, warmup_steps=8)),
        (Cosine(50), mx.lr_scheduler.CosineScheduler(50, base_lr=base)),
        (Cosine(50, final_lr=0.01, warmup_steps=10),
         mx.lr_scheduler.CosineScheduler(50, base_lr=base, final_lr=0.01, warmup_steps=10)),
    ]
    for ours, mxnets in pairs:
        for t in range(1, steps + 1):   # MXNet's are stateful: called in order, as its optimizer calls them
            assert ours(t, base) == pytest.approx(mxnets(t), rel=1e-12, abs=1e-15), (ours, t)


def test_a_long_cosines_last_steps_keep_a_rate_above_final_lr():
    """(1 + cos) / 2 rounded a long cosine's last step to 0 exactly (from about 2e8 steps on), and the check of
    the rates refused a rate that is not 0: the steps left keep it positive, as it is, up to 2**53 steps."""
    for total in (10 ** 9, 10 ** 12, 2 ** 53):
        cosine = Cosine(total)
        last = cosine(total - 1, 0.2)
        assert last == pytest.approx(0.2 * math.sin(math.pi / 2 / total) ** 2, rel=1e-12), total
        SGD(0.2, schedule=cosine)   # its rates all float32's: no refusal
        assert cosine(total, 0.2) == 0.0


def test_the_schedule_counts_optimizer_steps_not_contexts_or_micro_batches():
    data = batches(6)
    for k, accumulate in ((1, 1), (3, 1), (2, 3)):
        optimizer = SGD(0.1, momentum=0.9, schedule=Step([2, 4], factor=0.5))
        package_run(optimizer, k, data, accumulate=accumulate)
        assert optimizer.num_update == 6
        assert optimizer.lr_at(optimizer.num_update) == 0.1 * 0.25


# ---- ZeRO: the same model, whatever the stage -----------------------------------------------------------------

@pytest.mark.parametrize("case, k", diagonal(["momentum-wd", "nesterov-wd", "adam-wd", "adamw"], [1, 2, 3, 4]))
def test_zero_stages_train_the_same_model_as_replicated_state(case, k):
    make = CASES[case][0]
    data = batches(STEPS, size=9)
    replicated = {alg: package_run(make(), k, data, algorithm=alg) for alg in ("ring", "fused")}
    for zero in (1, 2):
        for algorithm in ("ring", "fused"):
            got = package_run(make(zero=zero), k, data, algorithm=algorithm)
            assert_replicas_identical(got)
            for a, b in zip(got[0], replicated[algorithm][0]):   # the same sums in the same order: the same bits
                np.testing.assert_array_equal(a, b)


def test_zero_1_and_2_with_the_naive_and_tree_allreduces_are_bitwise_zero_0():
    """An allreduce without a reduce-scatter half serves ZeRO-2 too: the Reducer's reduce-scatter is then the whole
    allreduce (every context's shard holds its sum), the same additions as zero=0."""
    data = batches(3)
    for algorithm in ("naive", "tree"):
        want = package_run(SGD(0.1, momentum=0.9), 3, data, algorithm=algorithm)
        for zero in (1, 2):
            got = package_run(SGD(0.1, momentum=0.9, zero=zero), 3, data, algorithm=algorithm)
            for a, b in zip(got[0], want[0]):
                np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("zero", [0, 1, 2])
def test_each_context_holds_its_share_of_the_state(zero):
    block = small_cnn(dtype="float32")
    k = 4
    ctx_list = contexts(k)
    device_params = [get_params(block, ctx) for ctx in ctx_list]
    optimizer = Adam(0.01, zero=zero)
    X, y = batches(1)[0]
    train_step(X, y, device_params, ctx_list, net=block, optimizer=optimizer)
    n = device_params[0].data.size
    use = memory_per_context(optimizer, [device_params])
    for i, ctx in enumerate(ctx_list):
        owned = n if zero == 0 else (lambda r: r[1] - r[0])(shard_range(n, k, i))
        assert use[ctx].params == use[ctx].grads == 4 * n
        assert use[ctx].state == 2 * 4 * owned   # Adam: a mean and a variance per owned element
    assert sum(u.state for u in use.values()) == (k if zero == 0 else 1) * 8 * n


# ---- clipping by the global norm of the summed gradient --------------------------------------------------------

@pytest.mark.parametrize("k, zero", diagonal([1, 2, 3], [0, 1, 2]))
def test_clipping_by_global_norm_matches_gluon_clip_global_norm_on_one_context(k, zero):
    data = batches()
    want = trainer_reference("sgd", {"learning_rate": 0.1, "momentum": 0.9}, data, clip_norm=0.05)
    got = package_run(SGD(0.1, momentum=0.9, clip_norm=0.05, zero=zero), k, data)
    assert_replicas_identical(got)
    assert_same_parameters(got[0], want, "float32")
    unclipped = trainer_reference("sgd", {"learning_rate": 0.1, "momentum": 0.9}, data)
    assert not np.allclose(unclipped[0], want[0], rtol=1e-3)   # the clipping acted


def test_clipping_each_shard_separately_is_another_model():
    """The classic mistake: each context clips its own shard's gradient by that shard's norm, then the clipped
    gradients are summed. A shard's norm is not the batch's, so the step is not one context's; the package clips
    the summed gradient, and K contexts stay one context."""
    data = batches(10)
    block = small_cnn(dtype="float32")
    net = parallel.models.gluon.as_net(block)
    ctx_list = contexts(2)
    wrong = [get_params(block, ctx) for ctx in ctx_list]
    optimizer = SGD(0.1)
    for X, y in data:
        for (a, b), replica, ctx in zip([(0, 4), (4, 7)], wrong, ctx_list):
            Xs, ys = X[a:b].as_in_context(ctx), y[a:b].as_in_context(ctx)
            with autograd.record():
                loss = LOSS(net(Xs, replica), ys)
            loss.backward()
            norm = float(mx.nd.norm(replica.grad / (b - a)).asscalar())   # this shard's mean gradient
            replica.grad[:] = replica.grad * min(1.0, 0.05 / (norm + 1e-8))
        optimizer_step(optimizer, [wrong], X.shape[0])
    right = package_run(SGD(0.1, clip_norm=0.05), 2, data)
    one = package_run(SGD(0.1, clip_norm=0.05), 1, data)
    assert_same_parameters(right[0], one[0], "float32")
    assert not np.allclose(wrong[0][0].asnumpy(), one[0][0], rtol=1e-3, atol=1e-5)


# ---- gradient accumulation ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("accumulate, k", diagonal([2, 3, 7], [1, 2, 3]))
def test_accumulated_micro_batches_are_the_whole_batch_at_once(accumulate, k):
    data = batches(STEPS, size=7)
    whole = package_run(SGD(0.1, momentum=0.9), 1, data)
    got = package_run(SGD(0.1, momentum=0.9), k, data, accumulate=accumulate)
    assert_replicas_identical(got)
    assert_same_parameters(got[0], whole[0], "float32")


def test_accumulation_reduces_once_per_batch(monkeypatch):
    calls = []
    real = sys.modules["parallel.comm.reducer"].allreduce
    monkeypatch.setattr(sys.modules["parallel.comm.reducer"], "allreduce",
                        lambda arrays, algorithm, **options: calls.append(1) or real(arrays, algorithm, **options))
    package_run(SGD(0.1), 2, batches(3), accumulate=4)
    assert len(calls) == 3


def test_accumulate_refuses_more_micro_batches_than_examples():
    with pytest.raises(ValueError, match="accumulate=8 cannot split a batch of 7"):
        package_run(SGD(0.1), 2, batches(1), accumulate=8)


# ---- the state as a checkpoint stores it: whole, whatever the layout -------------------------------------------

def test_state_gathered_from_one_layout_continues_in_another():
    """State of zero=2 on 2 contexts, gathered, loaded into zero=1 on 3 and zero=0 on 1: the runs continue alike."""
    data = batches(12)
    block = small_cnn(dtype="float32")
    first = Adam(0.01, zero=2)
    ctx2 = contexts(2)
    replicas = [get_params(block, ctx) for ctx in ctx2]
    for X, y in data[:6]:
        train_step(X, y, replicas, ctx2, net=block, optimizer=first)
    state = gather_state(first, [replicas], list(replicas[0]))
    assert sorted(state) == ["mean", "var"] and len(state["mean"]) == len(replicas[0])
    results = []
    for k, zero in ((2, 2), (3, 1), (1, 0)):
        ctx_list = contexts(k)
        copies = [get_params(block, ctx) for ctx in ctx_list]
        for copy in copies:   # the parameters reached after the first 6 steps
            replicas[0].data.copyto(copy.data)
        optimizer = Adam(0.01, zero=zero)
        load_state(optimizer, [copies], list(copies[0]), state)
        optimizer.num_update = first.num_update
        for X, y in data[6:]:
            train_step(X, y, copies, ctx_list, net=block, optimizer=optimizer)
        results.append([p.asnumpy() for p in copies[0]])
    for other in results[1:]:
        assert_same_parameters(other, results[0], "float32")


# ---- arguments --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("make, error, match", [
    (lambda: SGD(0.1, momentum=1.0), ValueError, "momentum must be in"),
    (lambda: SGD(0.1, nesterov=True), ValueError, "nesterov needs a momentum"),
    (lambda: SGD(0.1, nesterov=1), TypeError, "nesterov must be True or False"),
    (lambda: SGD(-1.0), ValueError, "^lr must be"),
    (lambda: SGD(0.1, wd=-0.1), ValueError, "^wd must be >= 0"),
    (lambda: SGD(0.1, wd="0.1"), TypeError, "^wd must be a number"),
    (lambda: SGD(0.1, zero=4), ValueError, "^zero must be one of 0, 1, 2, 3"),
    (lambda: SGD(0.1, clip_norm=0.0), ValueError, "^clip_norm must be"),
    (lambda: SGD(0.1, schedule="cosine"), TypeError, "^schedule must be"),
    (lambda: Adam(beta2=1.0), ValueError, "^beta2 must be in"),
    (lambda: Adam(epsilon=0), ValueError, "^epsilon must be"),
    (lambda: Cosine(10, warmup_steps=10), ValueError, "total_steps"),
    (lambda: Step([5, 5]), ValueError, "strictly increasing"),
    (lambda: Step([5], factor=2.0), ValueError, "factor must be in"),
    (lambda: make_optimizer("rmsprop"), ValueError, "^optimizer must be one of sgd, adam, adamw"),
])
def test_bad_arguments_name_themselves(make, error, match):
    with pytest.raises(error, match=match):
        make()


#: Values each optimizer's own checks once let through, which MXNet's fused operators refuse at the first step
#: ("Out of range value for wd"): every float they take must be 0 or in float32's normal range.
@pytest.mark.parametrize("make, argument", [
    (lambda: Adam(0.001, wd=1e40), "wd"), (lambda: SGD(0.1, wd=1e-46), "wd"), (lambda: SGD(0.1, wd=1e-40), "wd"),
    (lambda: SGD(0.1, momentum=1e-40), "momentum"), (lambda: Adam(beta1=1e-40), "beta1"),
    (lambda: Adam(beta2=1e-45), "beta2"), (lambda: Adam(epsilon=1e-40), "epsilon"), (lambda: AdamW(wd=1e39), "wd"),
    (lambda: SGD(0.1, clip_norm=1e40), "clip_norm"), (lambda: Step([5], factor=1e-45), "factor"),
    (lambda: Cosine(10, final_lr=1e-40), "final_lr"),
    (lambda: Adam(2e-38), "lr"),   # lr * Adam's bias correction (0.15 at step 12) is subnormal
    (lambda: SGD(0.2, schedule=Step([1], factor=1e-40)), "factor"),
    (lambda: SGD(1e-30, schedule=Step([1, 2], factor=1e-5)), "factor"),   # 1e-40 after the second decay
    (lambda: SGD(1e-35, schedule=Constant(warmup_steps=10000)), "lr"),     # the first warm-up step's rate
    (lambda: SGD(1e-33, schedule=Cosine(1000)), "lr"),                      # the cosine's tail
])
def test_values_mxnets_operators_refuse_are_refused_up_front(make, argument):
    with pytest.raises(ValueError, match="float32's normal range") as raised:
        make()
    assert raised.value.argument == argument


@pytest.mark.parametrize("make", [lambda: SGD(0.1, wd=1.2e-38), lambda: Adam(1e-36), lambda: AdamW(1e-37, wd=0),
                                  lambda: SGD(1e-30, schedule=Step([1], factor=1e-5)), lambda: Adam(wd=3.4e38)])
def test_values_at_the_edges_of_float32_take_a_step(make):
    optimizer = make()
    weight, grad = mx.nd.ones(3), mx.nd.ones(3)
    states = optimizer.create_state(weight)
    for t in (1, 2, 3):
        optimizer.update(weight, grad, states, optimizer.lr_at(t) if optimizer.schedule else optimizer.lr, 0.5, t)
    weight.wait_to_read()   # MXNet parsed every parameter


def test_lr_and_optimizer_are_exclusive():
    (X, y), = batches(1)
    block = small_cnn(dtype="float32")
    ctx_list = contexts(1)
    replicas = [get_params(block, ctx_list[0])]
    with pytest.raises(ValueError, match="lr=0.1 and an optimizer were both given"):
        train_step(X, y, replicas, ctx_list, 0.1, net=block, optimizer=SGD(0.1))
    with pytest.raises(TypeError, match="give lr"):
        train_step(X, y, replicas, ctx_list, net=block)
    with pytest.raises(TypeError, match="optimizer must be a parallel.optim.Optimizer"):
        train_step(X, y, replicas, ctx_list, net=block, optimizer="sgd")


# ---- across processes: the same oracle, under the launcher -----------------------------------------------------

#: (case of CASES, the package's extra options, accumulate): stateful optimizers, each ZeRO stage, clipping.
DISTRIBUTED = [("nesterov-wd", {"zero": 0}, 1), ("adam-wd", {"zero": 2}, 1), ("adamw", {"zero": 1}, 2),
               ("momentum", {"zero": 2, "clip_norm": 0.05}, 1)]

JOB_WORKER = """
import sys
import numpy as np
sys.path.insert(0, {tests!r})
import mxnet as mx
from test_optim import CASES, DISTRIBUTED, batches
from conftest import small_cnn
from parallel import Reducer, get_params, train_step
from parallel.job import broadcast_params, join

job = join()
ctx_list = [mx.cpu(i) for i in range({k})]
for n, (case, options, accumulate) in enumerate(DISTRIBUTED):
    block = small_cnn(dtype="float32", seed=0 if job.rank == 0 else 7)   # rank 0's weights must win
    device_params = [get_params(block, ctx) for ctx in ctx_list]
    broadcast_params(job, device_params)
    optimizer = CASES[case][0](**options)
    for X, y in batches():
        train_step(X, y, device_params, ctx_list, net=block, optimizer=optimizer, accumulate=accumulate,
                   reducer=Reducer("ring", job=job))[0].wait_to_read()
    print("trained", case, flush=True)
    np.savez({out!r} + f"-{{n}}-{{job.rank}}.npz", *[p.asnumpy() for p in device_params[-1]])
"""


@pytest.mark.slow
def test_every_optimizer_across_processes_matches_gluon_trainer_on_one_context(tmp_path):
    """2 workers x 2 contexts (batches of 7: unequal shards, one worker with 4 examples, the other 3), each
    optimizer with ZeRO sharding over each worker's contexts, against gluon.Trainer on one context."""
    import os
    import sys
    from conftest import run_process
    workers, k = 2, 2
    out = str(tmp_path / "params")
    script = tmp_path / "worker.py"
    script.write_text(JOB_WORKER.format(tests=os.path.dirname(os.path.abspath(__file__)), k=k, out=out))
    result = run_process([sys.executable, "-m", "parallel.launch", "-n", str(workers), "--stall-timeout", "120",
                          sys.executable, str(script)], timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    data = batches()
    for n, (case, options, accumulate) in enumerate(DISTRIBUTED):
        _, name, args = CASES[case]
        want = trainer_reference(name, args, data, clip_norm=options.get("clip_norm"))
        for rank in range(workers):
            with np.load(f"{out}-{n}-{rank}.npz") as got:
                assert_same_parameters([got[f"arr_{i}"] for i in range(len(want))], want, "float32")


@pytest.mark.parametrize("zero", [0, 1, 2])
@pytest.mark.parametrize("make", [lambda z: SGD(0.1, momentum=0.9, zero=z), lambda z: Adam(0.01, zero=z),
                                  lambda z: SGD(0.1, zero=z)])
def test_memory_table_before_a_step_is_what_the_step_allocates(zero, make):
    """The header's memory line is computed from the layout before the first step; the metrics JSON's is measured on
    the arrays after it: both the same, per context (3 contexts: shards of unequal size)."""
    from parallel.optim import memory_table
    ctx_list = contexts(3)
    device_params = [get_params(init_lenet_params(seed=0), ctx, bucket_mb=0.1) for ctx in ctx_list]
    optimizer = make(zero)
    planned = memory_table(optimizer, [device_params])
    X, y = make_batches([7])[0]
    train_step(X, y, device_params, ctx_list, optimizer=optimizer, reducer="fused")
    assert memory_table(optimizer, [device_params]) == planned
    assert [row["context"] for row in planned] == [str(c) for c in ctx_list]
    total = sum(p.size for p in init_lenet_params(seed=0)) * 4 * len(optimizer.state_names())
    assert sum(row["optimizer_state"] for row in planned) == total * (len(ctx_list) if zero == 0 else 1)


@pytest.mark.parametrize("make", [lambda: Adam(0.01), lambda: AdamW(0.01, wd=0.05)])
def test_stateful_optimizers_step_float64_arrays(make):
    """AdamW's fused update refused float64 weights ('Type inconsistent'): MXNet's adamw_update takes its
    rescale_grad as float32 whatever the weight's dtype. Both Adams now step LeNet in float64, as in float32."""
    results = {}
    for dtype in ("float32", "float64"):
        device_params = [get_params(init_lenet_params(seed=0, dtype=dtype), mx.cpu(0))]
        optimizer = make()
        for X, y in make_batches([8, 8], seed=2, dtype=dtype):
            train_batch(X, y, device_params, [mx.cpu(0)], optimizer=optimizer)
        results[dtype] = [p.asnumpy() for p in device_params[0]]
    assert all(a.dtype == np.float64 for a in results["float64"])
    for a, b in zip(results["float64"], results["float32"]):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-3 * np.abs(b).max())
