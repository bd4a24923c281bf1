"""The Reducer (``parallel.comm.reducer``): gradients summed in buckets, the last layers first, each bucket's sum
queued while the backward pass runs. Bucketing changes when bytes move, never what is summed: every bucket size
trains bitwise the same model; the trace shows the sums overlapping the backward pass on every context's lane;
a communication hook of the user's own reduces each bucket; a codec's error feedback is the same whatever the
buckets; a cross barrier lets each layer wait for its own bucket's update alone and sends the first layers' sums
first, bitwise the same model."""
import json
import threading

import mxnet as mx
import numpy as np
import pytest

from parallel import GluonNet, Reducer, get_params, init_lenet_params, trace, train_batch, train_step
from parallel.comm import ALGORITHMS, allreduce
from parallel.comm.reducer import GradBucket, allreduce_hook, as_reducer
from parallel.comm.replica import bucket_ranges
from parallel.models.lenet import LENET_SHAPES
from parallel.optim import SGD, Adam
from parallel.strategies import DataParallel
from parallel.train import main
from conftest import contexts, fast_only, in_threads, labels_hold, make_batches, small_cnn

#: Bucket sizes in MiB: one bucket (None, and 25 for LeNet's 0.5 MiB), three, a parameter a bucket.
BUCKET_SIZES = [None, 25, 0.1, 1e-6]


@pytest.mark.parametrize("sizes, limit, expected", [
    ([4, 4, 4], None, [(0, 3)]),
    ([4, 4, 4], 1000, [(0, 3)]),
    ([4, 4, 4], 32, [(1, 3), (0, 1)]),          # 16 bytes each: two fit in 32
    ([4, 4, 4], 1, [(2, 3), (1, 2), (0, 1)]),   # each larger than the bound: a bucket of its own
    ([100, 1, 1], 16, [(1, 3), (0, 1)]),
    ([], 16, [(0, 0)]),
])
def test_buckets_take_the_last_parameters_first(sizes, limit, expected):
    assert bucket_ranges(sizes, 4, limit) == expected


def test_a_replica_lays_its_gradients_out_in_buckets():
    replica = Reducer(bucket_mb=0.1).replicate(init_lenet_params(seed=0), [mx.cpu(0)])[0]
    assert [(b.first, b.stop) for b in replica.buckets] == [(5, 8), (4, 5), (0, 4)]
    assert [g.size for g in replica.grads] == [b.end - b.start for b in replica.buckets]
    assert sum(g.size for g in replica.grads) == replica.data.size
    with pytest.raises(AttributeError, match="3 buckets"):
        replica.grad
    single = get_params(init_lenet_params(seed=0), mx.cpu(0))
    assert single.grad is single.grads[0] and len(single.buckets) == 1


def _lenet_run(k, algorithm, bucket_mb, optimizer, steps=3, sizes=(17, 9, 17)):
    ctx = contexts(k)
    reducer = Reducer(algorithm, bucket_mb)
    device_params = reducer.replicate(init_lenet_params(seed=1), ctx)
    for X, y in make_batches(list(sizes)[:steps], seed=2):
        train_batch(X, y, device_params, ctx, optimizer=optimizer(), reducer=reducer)
    return [[p.asnumpy() for p in replica] for replica in device_params]


def _stateful(make):
    """A factory returning the same optimizer at every call (its state carries over)."""
    optimizer = make()
    return lambda: optimizer


@pytest.mark.parametrize("k, algorithm", fast_only([(2, a) for a in ALGORITHMS] + [(3, "fused"), (3, "naive"),
                                                                                  (3, "tree")],
                                                  fast={0, len(ALGORITHMS)}))
def test_every_bucket_size_trains_bitwise_the_same_model(k, algorithm):
    """LeNet, 3 steps of shards of unequal size (17 and 9 examples), SGD with momentum: every bucket size gives
    every replica the very bits of one bucket. (The ring on 3 contexts cuts each bucket in chunks of its own, so
    an element's sum starts at another context: another order, equal to float32 rounding.)"""
    runs = {mb: _lenet_run(k, algorithm, mb, _stateful(lambda: SGD(0.05, momentum=0.9))) for mb in BUCKET_SIZES}
    want = runs[None]
    for mb, got in runs.items():
        for replica in got:
            for g, w in zip(replica, want[0]):
                np.testing.assert_array_equal(g, w, err_msg=f"bucket_mb={mb}")


@pytest.mark.parametrize("options", [{"zero": 1}, {"zero": 2}, {"clip_norm": 0.5}],
                         ids=["zero1", "zero2", "clip"])
def test_sharded_state_and_clipping_are_bitwise_across_bucket_sizes_on_two_contexts(options):
    runs = {mb: _lenet_run(2, "fused", mb, _stateful(lambda: Adam(0.01, **options))) for mb in BUCKET_SIZES}
    for mb, got in runs.items():
        for g, w in zip(got[1], runs[None][0]):
            np.testing.assert_array_equal(g, w, err_msg=f"bucket_mb={mb}")


def test_a_gluon_block_in_buckets_trains_bitwise_the_same_model():
    def run(bucket_mb):
        block = small_cnn(dtype="float32", seed=3)
        ctx = contexts(2)
        reducer = Reducer("ring", bucket_mb)
        device_params = reducer.replicate(block, ctx)
        optimizer = SGD(0.1, momentum=0.9)
        for X, y in make_batches([12, 12], seed=4):
            train_step(X[:, :, :8, :8], y, device_params, ctx, net=GluonNet(block), reducer=reducer,
                       optimizer=optimizer)
        return [p.asnumpy() for p in device_params[1]]
    want = run(None)
    assert len(Reducer(bucket_mb=1e-6).replicate(small_cnn(dtype="float32"), [mx.cpu(0)])[0].buckets) == 6
    for g, w in zip(run(1e-6), want):
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("spec", ["fp16", "2bit", "2bit:0.001"])
def test_an_elementwise_codec_is_bitwise_across_bucket_sizes_and_its_state_is_layout_free(spec):
    """fp16 and 2bit encode each element on its own (2bit with its tensor's scale, and a bucket holds whole
    tensors): a bucket of the buffer is compressed as the whole buffer's part, so every bucket size gives the same
    model, and the residuals, laid out as the flat buffer, agree."""
    def run(bucket_mb):
        ctx = contexts(2)
        reducer = Reducer("fused", bucket_mb, compression=spec)
        device_params = reducer.replicate(init_lenet_params(seed=1), ctx)
        for X, y in make_batches([16] * 3, seed=2):
            train_batch(X, y, device_params, ctx, 0.1, reducer=reducer)
        return [p.asnumpy() for p in device_params[0]], reducer.state(device_params)
    want, want_state = run(None)
    got, got_state = run(0.1)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    assert sorted(got_state) == sorted(want_state) == ["residual/c0", "residual/c1"]
    for name in want_state:
        np.testing.assert_array_equal(got_state[name].asnumpy(), want_state[name].asnumpy())


def test_a_codec_state_saved_in_buckets_loads_into_one_bucket_and_back():
    ctx = contexts(2)
    reducer = Reducer("fused", 0.1, compression="powersgd:2")
    device_params = reducer.replicate(init_lenet_params(seed=1), ctx)
    for X, y in make_batches([16] * 2, seed=2):
        train_batch(X, y, device_params, ctx, 0.1, reducer=reducer)
    state = reducer.state(device_params)
    assert {name.split("/")[0] for name in state} == {"residual", "query"}
    assert all(state[f"residual/c{k}"].shape == device_params[0].data.shape for k in range(2))
    assert sorted(int(name.rsplit("/", 1)[1]) for name in state if name.startswith("query/c0/")) == [0, 2, 4, 6]
    other = Reducer("fused", None, compression="powersgd:2")
    other_params = other.replicate(init_lenet_params(seed=1), ctx)
    other.load_state({name: value.asnumpy() for name, value in state.items()}, other_params)
    again = other.state(other_params)
    for name in state:
        np.testing.assert_array_equal(again[name].asnumpy(), state[name].asnumpy())


# ---- communication hooks ----------------------------------------------------------------------------------------

def half_precision(bucket, comm):
    """A hook of the user's own (docs/reducer.md): the bucket summed in float16, without error feedback."""
    halves = [grad.astype("float16") for grad in bucket.grads]
    comm.allreduce(halves)
    for grad, half in zip(bucket.grads, halves):
        half.astype(grad.dtype).copyto(grad)


def test_a_hook_gets_every_bucket_the_last_layers_first_and_its_sum_is_applied():
    ctx = contexts(2)
    reducer = Reducer("fused", 0.1)
    seen = []
    reducer.register_comm_hook(lambda bucket, comm: seen.append(bucket) or half_precision(bucket, comm))
    device_params = reducer.replicate(init_lenet_params(seed=1), ctx)
    plain = [get_params(init_lenet_params(seed=1), c) for c in ctx]
    (X, y), = make_batches([16], seed=2)
    train_batch(X, y, device_params, ctx, 0.1, reducer=reducer)
    train_batch(X, y, plain, ctx, 0.1)
    assert [(b.index, b.num_buckets, b.first, len(b.shapes)) for b in seen] == [(0, 3, 5, 3), (1, 3, 4, 1),
                                                                              (2, 3, 0, 4)]
    assert [s for b in seen for s in b.shapes] == LENET_SHAPES[5:] + LENET_SHAPES[4:5] + LENET_SHAPES[:4]
    for got, want in zip(device_params[1], plain[1]):   # float16 sums: close, not equal
        np.testing.assert_allclose(got.asnumpy(), want.asnumpy(), rtol=0, atol=2e-3 * np.abs(want.asnumpy()).max())
    assert any((got.asnumpy() != want.asnumpy()).any() for got, want in zip(device_params[1], plain[1]))
    for got, other in zip(device_params[0], device_params[1]):
        np.testing.assert_array_equal(got.asnumpy(), other.asnumpy())


def test_bad_reducer_arguments_name_themselves():
    with pytest.raises(ValueError, match="bucket_mb"):
        Reducer(bucket_mb=0)
    with pytest.raises(TypeError, match="bucket_mb"):
        Reducer(bucket_mb="25")
    with pytest.raises(ValueError, match="algorithm"):
        Reducer("butterfly")
    with pytest.raises(ValueError, match="compression"):
        Reducer(compression="gzip")
    with pytest.raises(TypeError, match="hook"):
        Reducer().register_comm_hook("fp16")
    with pytest.raises(TypeError, match="job must be a parallel.job.Job"):
        Reducer(job=object())
    assert Reducer(compression="fp16").codec is not None and Reducer().register_comm_hook(max).codec is None
    with pytest.raises(TypeError, match="reducer"):
        as_reducer(3)
    assert isinstance(GradBucket(0, 1, [mx.nd.zeros(3)], [(3,)]).tensors(0)[0], mx.nd.NDArray)


# ---- gradients an array a tensor: replicas that are plain lists (gluon's go through AllreduceKVStore) -----------

def plain_replicas(ctx, dtype="float32"):
    """The textbook's replicas of LeNet: copies with gradients attached, a plain list a context."""
    replicas = []
    for c in ctx:
        params = [p.copyto(c) for p in init_lenet_params(seed=1, dtype=dtype)]
        for p in params:
            p.attach_grad()
        replicas.append(params)
    return replicas


def counting(reducer, seen):
    """``reducer`` with a hook that records each bucket it gets, then sums it as the default hook does."""
    return reducer.register_comm_hook(lambda bucket, comm: seen.append(bucket) or allreduce_hook(bucket, comm))


def test_a_hook_reaches_replicas_that_are_plain_lists():
    """Plain lists go through the reducer's buckets and hook as flat replicas do (they were summed a tensor at a
    time, and a hook was refused): the flat replica's buckets, the last layers first, each at most 0.1 MiB but for
    a larger tensor alone, and bitwise the model the flat replicas train."""
    ctx, seen = contexts(2), []
    reducer = counting(Reducer("fused", 0.1), seen)
    plain = plain_replicas(ctx)
    flat = Reducer("fused", 0.1).replicate(init_lenet_params(seed=1), ctx)
    for X, y in make_batches([16, 16], seed=2):
        train_batch(X, y, plain, ctx, 0.1, reducer=reducer)
        train_batch(X, y, flat, ctx, 0.1, reducer=Reducer("fused", 0.1))
    assert [(b.index, b.num_buckets, b.first, len(b.shapes)) for b in seen] == [(0, 3, 5, 3), (1, 3, 4, 1),
                                                                              (2, 3, 0, 4)] * 2
    assert [b.grads[0].size for b in seen] == [grad.size for grad in flat[0].grads] * 2
    assert all(len(b.shapes) == 1 or b.grads[0].size * 4 <= 0.1 * 2 ** 20 for b in seen)
    assert [s for b in seen[:3] for s in b.shapes] == LENET_SHAPES[5:] + LENET_SHAPES[4:5] + LENET_SHAPES[:4]
    for replica in plain:
        for got, want in zip(replica, flat[0]):
            np.testing.assert_array_equal(got.asnumpy(), want.asnumpy())


@pytest.mark.parametrize("bucket_mb, ranges", [
    (None, [(0, 8)]),                                   # one bucket
    (25, [(0, 8)]),                                     # LeNet's 0.5 MiB in one
    (0.1, [(5, 8), (4, 5), (0, 4)]),                    # as a flat replica's
    (1e-6, [(i, i + 1) for i in reversed(range(8))]),   # a tensor a bucket, summed in place
])
def test_plain_lists_are_laid_out_in_the_buckets_of_a_flat_replica(bucket_mb, ranges):
    """(``bucket_mb=0`` is refused: ``test_bad_reducer_arguments_name_themselves``.)"""
    ctx, seen = contexts(2), []
    reducer = counting(Reducer("fused", bucket_mb), seen)
    plain = plain_replicas(ctx)
    rng = np.random.RandomState(0)
    for replica in plain:
        for param in replica:
            param.grad[:] = rng.standard_normal(param.shape)
    want = [sum(replica[j].grad.asnumpy() for replica in plain) for j in range(8)]
    reducer.reduce(plain)
    assert [(b.first, b.first + len(b.shapes)) for b in seen] == ranges
    assert [(b.first, b.stop) for b in reducer.replicate(init_lenet_params(), ctx[:1])[0].buckets] == ranges
    for replica in plain:
        for param, w in zip(replica, want):
            np.testing.assert_allclose(param.grad.asnumpy(), w, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("k, algorithm", [(2, a) for a in ALGORITHMS] + [(3, a) for a in ALGORITHMS if a != "ring"])
def test_a_bucket_of_lists_sums_bitwise_as_a_tensor_at_a_time(k, algorithm):
    """LeNet's eight float32 gradients in one packed bucket: the very bits of an allreduce a tensor. (Not the ring
    on 3 contexts: it cuts the bucket in chunks of its own, so an element's sum starts at another context.)"""
    ctx = contexts(k)
    rng = np.random.RandomState(0)
    values = [[rng.standard_normal(shape).astype("float32") for _ in ctx] for shape in LENET_SHAPES]
    grads = [[mx.nd.array(v, ctx=c) for v, c in zip(vs, ctx)] for vs in values]
    want = [[mx.nd.array(v, ctx=c) for v, c in zip(vs, ctx)] for vs in values]
    seen = []
    counting(Reducer(algorithm, None), seen).reduce_arrays(grads)
    for arrays in want:
        allreduce(arrays, algorithm)
    assert len(seen) == 1 and len(seen[0].shapes) == 8
    for got, expected in zip(grads, want):
        for g, w in zip(got, expected):
            np.testing.assert_array_equal(g.asnumpy(), w.asnumpy())


def test_a_bucket_ends_where_the_dtype_changes():
    """Tensors of two dtypes: each run of one dtype in buckets of its own, in reduction order; each summed."""
    ctx, seen = contexts(2), []
    dtypes = ["float32", "float32", "float64", "float32"]
    grads = [[mx.nd.full((3,), 1 + i + c, ctx=ctx[c], dtype=d) for c in range(2)] for i, d in enumerate(dtypes)]
    counting(Reducer("fused", None), seen).reduce_arrays(grads, names="abcd")
    assert [(b.first, len(b.shapes), b.grads[0].dtype) for b in seen] == [(3, 1, np.float32), (2, 1, np.float64),
                                                                          (0, 2, np.float32)]
    for i, arrays in enumerate(grads):
        for array in arrays:
            assert array.dtype == np.dtype(dtypes[i]) and (array.asnumpy() == 3 + 2 * i).all()
    with pytest.raises(ValueError, match="names has 2 entries but grads 4 tensors"):
        Reducer().reduce_arrays(grads, names="ab")


def dense_block(seed=5):
    """Two dense layers (float32, no BatchNorm), the same initial weights at every call."""
    block = mx.gluon.nn.Sequential()
    block.add(mx.gluon.nn.Dense(16, in_units=12, activation="relu"), mx.gluon.nn.Dense(10, in_units=16))
    block.initialize(mx.init.Xavier(), ctx=mx.cpu(0))
    rng = np.random.RandomState(seed)
    for param in block.collect_params().values():
        param.set_data(mx.nd.array(rng.uniform(-0.3, 0.3, param.shape)))
    return block


@pytest.mark.parametrize("spec", ["fp16", "2bit"])
def test_a_codec_reaches_a_gluon_block_in_data_parallel(spec):
    """``DataParallel(block, ctx_list, reducer=Reducer(compression=...))`` (refused before): the gluon gradients,
    new NDArray objects at every read, are compressed in the reducer's buckets. An elementwise codec trains bitwise
    the same model in one bucket and in a bucket a tensor, whose residuals follow each step's new arrays, and its
    residuals, laid out as a flat buffer, agree; the compressed model is not the uncompressed one."""
    def run(bucket_mb, compression):
        reducer = Reducer("fused", bucket_mb, compression=compression)
        model = DataParallel(dense_block(), contexts(2), reducer=reducer)
        loss = mx.gluon.loss.SoftmaxCrossEntropyLoss()
        rng = np.random.RandomState(3)
        for _ in range(3):
            X, y = mx.nd.array(rng.standard_normal((10, 12))), mx.nd.array(rng.randint(0, 10, 10))
            with mx.autograd.record():
                value = loss(model(X), y).sum()
            value.backward()
            model.step(0.5, 10)
        return [p.asnumpy() for p in model.device_params[1]], reducer.state(model.device_params)
    want, want_state = run(None, spec)
    got, got_state = run(1e-6, spec)
    plain, _ = run(None, None)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    assert any((w != p).any() for w, p in zip(want, plain))
    assert sorted(got_state) == sorted(want_state) == ["residual/c0", "residual/c1"]
    assert want_state["residual/c0"].shape == (16 * 12 + 16 + 10 * 16 + 10,)
    for name in want_state:
        np.testing.assert_array_equal(got_state[name].asnumpy(), want_state[name].asnumpy())


# ---- overlap, as the trace shows it -----------------------------------------------------------------------------

def steps_by_lane(events):
    """``{lane: [step, ...]}``: each lane's events of a trace (operators and issued brackets), cut into steps where
    each ``update`` bracket ends."""
    found = {}
    for lane in sorted({e["pid"] for e in events if e.get("ph") == "X"}):
        spans = sorted((e for e in events if e.get("ph") == "X" and e["pid"] == lane), key=lambda e: e["ts"])
        ends = sorted(e["ts"] + e["dur"] for e in spans if e["tid"] == 1 and e["cat"] == "update")
        found[lane] = [[e for e in spans if (i == 0 or e["ts"] >= ends[i - 1]) and e["ts"] < end]
                       for i, end in enumerate(ends)]
    return found


def overlapping_lanes(events):
    """For every lane and every step in ``events`` (a trace's): ``(bracket, operator)``: whether a bucket's
    reduction started there (its ``issued`` bracket opened) before the lane's last backward operator started, and
    whether an operator named allreduce ran there before it: ``{lane: [(bool, bool) a step]}``."""
    found = {}
    for lane, steps in steps_by_lane(events).items():
        found[lane] = []
        for step in steps:
            last = max(e["ts"] for e in step if e["tid"] == 0 and e["cat"] == "backward")
            found[lane].append((any(e["tid"] == 1 and e["cat"] == "allreduce" and e["ts"] < last for e in step),
                                any(e["tid"] == 0 and e["cat"] == "allreduce" and e["ts"] < last for e in step)))
    return found


def test_bucket_sums_start_while_backward_runs_on_every_lane(tmp_path):
    """LeNet on 2 contexts, dense2 a bucket of its own: its sum starts on both lanes before conv1's backward ends."""
    ctx = contexts(2)
    reducer = Reducer("fused", 0.004)
    device_params = reducer.replicate(init_lenet_params(seed=1), ctx)
    assert (device_params[0].buckets[0].first, device_params[0].buckets[0].stop) == (7, 8)
    batches = make_batches([256] * 4, seed=2)
    optimizer = SGD(0.05, momentum=0.9)
    train_batch(*batches[0], device_params, ctx, optimizer=optimizer, reducer=reducer)
    with trace(tmp_path / "steps.json", contexts=ctx):
        for X, y in batches[1:]:
            train_batch(X, y, device_params, ctx, optimizer=optimizer, reducer=reducer)
        mx.nd.waitall()
    found = overlapping_lanes(json.load(open(tmp_path / "steps.json"))["traceEvents"])
    assert len(found) == 2 and all(len(steps) == 3 for steps in found.values()), found
    assert all(bracket for steps in found.values() for bracket, _ in steps), found   # every lane, every step
    # and a reduction's own operator ran before it (one a metrics copy might also be is named by itself: not always)
    assert any(operator for steps in found.values() for _, operator in steps), found


def no_reduction_before_backward_ends(events):
    """For every lane and step: whether every allreduce there (bracket or operator) started after the lane's last
    backward operator ended."""
    found = {}
    for lane, steps in steps_by_lane(events).items():
        found[lane] = []
        for step in steps:
            end = max(e["ts"] + e["dur"] for e in step if e["tid"] == 0 and e["cat"] == "backward")
            found[lane].append(all(e["ts"] >= end for e in step if e["cat"] == "allreduce"))
    return found


def test_one_bucket_starts_no_reduction_before_backward_ends(tmp_path):
    """The trace named any copy or add_n after the first backward operator allreduce: one bucket, which no sum can
    start before the whole backward pass is done, showed an allreduce before the last backward event on every lane.
    Names now come from the Reducer's brackets: with one bucket, none on any lane of any step."""
    ctx = contexts(2)
    reducer = Reducer("fused", None)
    device_params = reducer.replicate(init_lenet_params(seed=1), ctx)
    assert len(device_params[0].buckets) == 1
    batches = make_batches([256] * 4, seed=2)
    optimizer = SGD(0.05, momentum=0.9)
    train_batch(*batches[0], device_params, ctx, optimizer=optimizer, reducer=reducer)
    with trace(contexts=ctx) as recorded:
        for X, y in batches[1:]:
            train_batch(X, y, device_params, ctx, optimizer=optimizer, reducer=reducer)
    found = no_reduction_before_backward_ends(recorded.result.events)
    assert len(found) == 2 and all(len(steps) == 3 and all(steps) for steps in found.values()), found
    assert all(not bracket for steps in overlapping_lanes(recorded.result.events).values() for bracket, _ in steps)


@pytest.mark.slow
def test_the_cli_trace_of_resnet18_tells_one_bucket_from_small_ones(tmp_path, capsys):
    """ResNet-18 on 2 contexts (the issue's case, BatchNorm, residual sums that autograd adds): with one bucket
    (--bucket-mb 1000) no reduction starts before the backward pass ends on any lane of any traced step (the order
    allows none); with 1 MiB buckets one does on every lane, in at least one of its three traced steps (the order
    allows one in each, and whether the host issues a bucket before a lane's backward has run out depends on the
    machine's load: a CI run with four busy processes on 2 cores saw one lane's first traced step without)."""
    from conftest import easy_dataset, write_idx_files
    data_dir = write_idx_files(tmp_path, easy_dataset(num_train=128, num_test=16))   # 4 steps: steps 2-4 traced
    for mb, overlaps in (("1000", False), ("1", True)):
        path = tmp_path / f"t{mb}.json"
        status = main(["--data-dir", str(data_dir), "--model", "resnet18", "--devices", "cpu:2", "--epochs", "1",
                       "--batch-size", "32", "--bucket-mb", mb, "--trace", str(path), "--no-progress"])
        assert status == 0, capsys.readouterr().err
        events = json.load(open(path))["traceEvents"]
        started = overlapping_lanes(events)
        assert len(started) == 2 and all(len(steps) == 3 for steps in started.values()), started
        if overlaps:
            assert all(any(bracket for bracket, _ in steps) for steps in started.values()), (mb, started)
        else:
            assert not any(bracket for steps in started.values() for bracket, _ in steps), (mb, started)
            assert all(all(steps) for steps in no_reduction_before_backward_ends(events).values())


def test_the_cli_trace_shows_the_overlap(tmp_path, capsys):
    """``--trace`` with ``--bucket-mb``: every lane's traced steps sum a bucket before their backward ends."""
    from conftest import easy_dataset, write_idx_files
    data_dir = write_idx_files(tmp_path, easy_dataset(num_train=1024, num_test=64))
    status = main(["--data-dir", str(data_dir), "--devices", "cpu:2", "--epochs", "1", "--batch-size", "256",
                   "--bucket-mb", "0.004", "--trace", str(tmp_path / "t.json"), "--no-progress"])
    assert status == 0, capsys.readouterr().err
    assert "in buckets of 0.004 MiB" in capsys.readouterr().out
    found = overlapping_lanes(json.load(open(tmp_path / "t.json"))["traceEvents"])
    assert len(found) == 2 and all(steps and all(b for b, _ in steps) for steps in found.values()), found


def test_a_bucket_size_the_cli_cannot_take_is_refused(capsys):
    assert main(["--bucket-mb", "0", "--dataset", "synthetic"]) == 2
    assert capsys.readouterr().err.startswith("error: --bucket-mb must be a finite number > 0")


@pytest.mark.parametrize("hosts, flags, said", [
    ("2", [], "in buckets of 5 MiB (the default for a job across 2 hosts; --bucket-mb overrides)"),
    ("2", ["--bucket-mb", "25"], "in buckets of 25 MiB;"),    # the user's size, with no note
    (None, [], "in buckets of 25 MiB;"),                       # one host (no launcher): DDP's 25
])
def test_the_cli_sizes_buckets_for_the_hosts_its_job_spans_and_says_why(hosts, flags, said, tmp_path, capsys,
                                                                        monkeypatch):
    """The launcher tells every process how many hosts its job spans (``PARALLEL_HOSTS``; tests/test_launch.py):
    across hosts the CLI's default buckets are ``HOSTS_BUCKET_MB``, inside one its 25 MiB, and the header says
    which and why; ``--bucket-mb`` always wins."""
    from conftest import easy_dataset, write_idx_files
    if hosts is None:
        monkeypatch.delenv("PARALLEL_HOSTS", raising=False)
    else:
        monkeypatch.setenv("PARALLEL_HOSTS", hosts)
    data_dir = write_idx_files(tmp_path, easy_dataset(num_train=64, num_test=16))
    assert main(["--data-dir", str(data_dir), "--devices", "cpu:2", "--epochs", "1", "--batch-size", "32",
                 "--no-progress", *flags]) == 0
    out = capsys.readouterr().out
    assert said in out, out
    assert ("default for a job across" in out) == (hosts is not None and not flags)


def test_the_bucket_size_is_described_in_mib_as_bucket_mb_counts_it():
    """``bucket_mb`` counts MiB (2**20 bytes, as DDP's bucket_cap_mb), and the header says so, not MB."""
    from parallel.comm.replica import bucket_bytes
    assert bucket_bytes(0.1) == int(0.1 * 2 ** 20)
    assert Reducer(bucket_mb=0.1).describe(2) == "gradients summed with the fused allreduce in buckets of 0.1 MiB"


def test_a_bucket_is_checked_once_as_it_is_laid_out_and_other_arrays_at_every_sum():
    """The reducer checks a group's bucket buffers when it lays the buckets out (one shape and dtype, distinct
    contexts) and then sums those very lists unchecked; any other list a hook hands the transport is checked."""
    reducer = Reducer("fused", bucket_mb=0.1)
    ctx = contexts(2)
    group = reducer.replicate(init_lenet_params(seed=0), ctx)
    assert all(bucket.checked for bucket in reducer.buckets(group))
    params = init_lenet_params(seed=0)
    mismatched = [get_params(params, ctx[0]), get_params([p.astype("float64") for p in params], ctx[1])]
    with pytest.raises(ValueError, match=r"the group's gradient buffers\[1\] has dtype float64"):
        reducer.buckets(mismatched)
    tried = []

    def hook(bucket, comm):   # a hook that sums arrays of its own: of two shapes, refused
        with pytest.raises(ValueError, match=r"arrays\[1\] has shape"):
            comm.allreduce_contexts([mx.nd.ones((3,), ctx=ctx[0]), mx.nd.ones((4,), ctx=ctx[1])])
        tried.append(bucket.index)
        allreduce_hook(bucket, comm)

    reducer.register_comm_hook(hook).reduce(group)
    assert tried == [0, 1, 2]


# ---- a cross barrier: each layer's next forward waits for its own bucket's update alone ---------------------------

@pytest.mark.parametrize("cross", [True, False])
def test_with_a_cross_barrier_a_layer_waits_for_its_own_bucket_s_update_alone(cross):
    """LeNet on one context, its gradients in buckets; the last layers' bucket (backward's first) is held back by an
    engine operation on another context that writes its gradient buffer until released. With a cross barrier the
    first layers' weights (their own piece) are updated and readable while it is held: what the next forward reads
    first. Without one every weight is a view of one buffer, one array to MXNet's engine, and cannot be read before
    the held bucket's update: the reader stays blocked until the release."""
    from parallel.engine import ENGINE_SYNC_FUNC, push_sync
    from parallel.optim.zero import update_groups
    ctx = [mx.cpu(0)]
    reducer = Reducer("fused", 0.004, cross_barrier=cross)
    replica = reducer.replicate(init_lenet_params(seed=1), ctx)[0]
    assert (replica.pieces is not None) == cross and len(replica.buckets) >= 2
    optimizer = SGD(0.05, momentum=0.9)
    X, y = make_batches([64], seed=2)[0]
    train_batch(X, y, [replica], ctx, optimizer=optimizer, reducer=reducer)
    mx.nd.waitall()
    before = replica[0].asnumpy()
    release, read = threading.Event(), threading.Event()

    def hold(run_context, param):   # in cpu(5)'s engine thread: the held bucket's sum, not landed yet
        release.wait(120)
    held = ENGINE_SYNC_FUNC(hold)
    push_sync(held, mx.cpu(5), writes=[replica.grads[0]])
    update_groups(optimizer, [[replica]], 64, reducer)
    reader = threading.Thread(target=lambda: (replica[0].wait_to_read(), read.set()))
    reader.start()
    try:
        # with a cross barrier this waits for conv1's update alone; without, it cannot end before the release
        assert read.wait(60 if cross else 1) == cross
    finally:
        release.set()
        reader.join(120)
        mx.nd.waitall()
    assert read.is_set() and not np.array_equal(replica[0].asnumpy(), before)   # updated, in both
    for b, layout in enumerate(replica.buckets if cross else ()):   # the flat buffer kept equal to the pieces
        np.testing.assert_array_equal(replica.data[layout.start:layout.end].asnumpy(), replica.pieces[b].asnumpy())


def test_in_a_job_a_cross_barrier_sends_the_first_layers_sums_first_once_backward_ends(threads_reduce_at_once):
    """Two workers in threads, LeNet in 7 buckets: with a cross barrier a step's sums leave in the order the next
    forward needs them once backward has ended (the first CROSS_HOLD buckets in backward's order as soon as they are
    written, then the first layers' first); without, in backward's order. The same model either way, bitwise: the
    same sums, updated bucket by bucket in place of all at once."""
    from parallel.comm.reducer import CROSS_HOLD
    from parallel.job import bucket_key

    def run(cross):
        def work(job, rank):
            ctx = [mx.cpu(rank)]
            reducer = Reducer("fused", 0.002, job=job, cross_barrier=cross)
            params = reducer.replicate(init_lenet_params(seed=1), ctx)
            optimizer = SGD(0.05, momentum=0.9)
            for X, y in make_batches([32, 32], seed=2):
                train_batch(X, y, params, ctx, optimizer=optimizer, reducer=reducer)
            return len(params[0].buckets), [p.asnumpy() for p in params[0]]
        results, servers = in_threads(2, work)
        n = results[0][0]
        keys = {bucket_key(b): b for b in range(n)}
        pushed = [keys[key] for key, _ in servers.pushed if key in keys]   # both workers', as they pushed
        orders = [list(dict.fromkeys(step)) for step in (pushed[:2 * n], pushed[2 * n:])]   # first push of each
        for a, b in zip(results[0][1], results[1][1]):
            np.testing.assert_array_equal(a, b)
        return n, orders, results[0][1]
    n, crossed, got = run(True)
    m, plain, want = run(False)
    assert n == m == 7, (n, m)
    assert crossed == [[0, 1, 6, 5, 4, 3, 2]] * 2 and plain == [list(range(7))] * 2, (crossed, plain)
    assert CROSS_HOLD == 2   # the first two leave as backward writes them
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def test_a_cross_barrier_s_timeline_labels_hold_and_its_updates_are_bracketed_a_bucket_each():
    """A traced step of LeNet on 2 contexts with a cross barrier: every label holds (``labels_hold``), and each
    lane has one update bracket a bucket, named after it."""
    ctx = contexts(2)
    reducer = Reducer("fused", 0.004, cross_barrier=True)
    device_params = reducer.replicate(init_lenet_params(seed=1), ctx)
    optimizer = SGD(0.05, momentum=0.9)
    X, y = make_batches([64], seed=2)[0]
    train_batch(X, y, device_params, ctx, optimizer=optimizer, reducer=reducer)
    with trace(contexts=ctx) as recorded:
        train_batch(X, y, device_params, ctx, optimizer=optimizer, reducer=reducer)
    labels_hold(recorded.result)
    n = len(device_params[0].buckets)
    names = sorted(e["name"] for e in recorded.result.events if e.get("cat") == "update" and e["name"].startswith(
        "update bucket"))
    assert names == sorted(f"update bucket {b}" for b in range(n) for _ in ctx), names


def test_a_cross_barrier_is_refused_with_zero_s_shards_and_needs_a_bool(capsys):
    reducer = Reducer("fused", 0.004, cross_barrier=True)
    group = reducer.replicate(init_lenet_params(seed=1), contexts(2))
    with pytest.raises(ValueError, match="zero=1 shards the flat buffer.*cross_barrier"):
        train_batch(*make_batches([8], seed=2)[0], group, contexts(2), optimizer=SGD(0.05, zero=1), reducer=reducer)
    from parallel import Layout, init_model, make_strategy
    for zero in (1, 3):   # a layout that shards: refused as it is laid out
        with pytest.raises(ValueError, match=rf"zero={zero}.*shards the flat buffers.*cross barrier"):
            make_strategy(Layout("data", zero=zero), init_model("lenet", 0), contexts(2), reducer=reducer)
    with pytest.raises(TypeError, match="cross_barrier must be a bool"):
        Reducer(cross_barrier=1)
    assert "a cross barrier" in reducer.describe(2) and "cross barrier" not in Reducer().describe(2)
    assert main(["--dataset", "synthetic", "--train-size", "64", "--batch-size", "32", "--epochs", "1",
                 "--devices", "cpu:2", "--bucket-mb", "0.004", "--cross-barrier", "--no-progress"]) == 0
    assert "a cross barrier" in capsys.readouterr().out
