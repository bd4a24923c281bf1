import mxnet as mx
import numpy as np
import pytest

from parallel import ALLREDUCE_ALGORITHMS, allreduce, get_params, init_lenet_params
from conftest import contexts

ALGORITHMS = sorted(ALLREDUCE_ALGORITHMS)


def test_get_params_copies_to_context_with_zero_grad():
    params = init_lenet_params(seed=3)
    copies = get_params(params, mx.cpu(2))
    assert len(copies) == len(params)
    for original, copy in zip(params, copies):
        assert copy.context == mx.cpu(2)
        np.testing.assert_array_equal(copy.asnumpy(), original.asnumpy())
        assert copy.grad is not None and not copy.grad.asnumpy().any()
    copies[0][:] = 7   # a copy, not a view of the original
    assert not (params[0].asnumpy() == 7).any()


def test_get_params_rejects_bad_ctx_and_params():
    with pytest.raises(TypeError, match="Context"):
        get_params(init_lenet_params(), "cpu")
    with pytest.raises(TypeError, match=r"params\[1\]"):
        get_params([mx.nd.ones(2), np.ones(2)], mx.cpu())


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("shape", [(1,), (7,), (3, 5), (20, 1, 3, 3), (1001,)])
def test_allreduce_leaves_the_sum_everywhere(algorithm, k, shape, rng):
    values = [rng.randn(*shape).astype("float32") for _ in range(k)]
    arrays = [mx.nd.array(v, ctx=c) for v, c in zip(values, contexts(k))]
    assert allreduce(arrays, algorithm) is arrays
    expected = np.sum(values, axis=0)
    for i, array in enumerate(arrays):
        assert array.context == mx.cpu(i)
        np.testing.assert_allclose(array.asnumpy(), expected, rtol=1e-5, atol=1e-6)
    first = arrays[0].asnumpy()
    for array in arrays[1:]:   # every context holds the very same bits
        np.testing.assert_array_equal(array.asnumpy(), first)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_allreduce_integer_exact_and_idempotent_shape(algorithm):
    arrays = [mx.nd.full((4, 3), i + 1, ctx=c, dtype="int32") for i, c in enumerate(contexts(4))]
    allreduce(arrays, algorithm)
    for array in arrays:
        assert array.dtype == np.int32 and array.shape == (4, 3)
        assert (array.asnumpy() == 10).all()


def test_allreduce_rejects_mismatches_naming_the_index():
    ctxs = contexts(3)
    with pytest.raises(ValueError, match=r"arrays\[2\] has shape \(3,\)"):
        allreduce([mx.nd.ones(2, ctx=ctxs[0]), mx.nd.ones(2, ctx=ctxs[1]), mx.nd.ones(3, ctx=ctxs[2])])
    with pytest.raises(ValueError, match=r"arrays\[1\] has dtype float64"):
        allreduce([mx.nd.ones(2, ctx=ctxs[0]), mx.nd.ones(2, ctx=ctxs[1], dtype="float64")])
    with pytest.raises(ValueError, match=r"arrays\[1\] and arrays\[0\] are both on cpu\(0\)"):
        allreduce([mx.nd.ones(2, ctx=ctxs[0]), mx.nd.ones(2, ctx=ctxs[0])])
    with pytest.raises(ValueError, match="arrays is empty"):
        allreduce([])
    with pytest.raises(TypeError, match=r"arrays\[1\] must be an NDArray"):
        allreduce([mx.nd.ones(2), np.ones(2)])
    with pytest.raises(ValueError, match="algorithm must be one of naive, fused, ring, tree; got 'bogus'"):
        allreduce([mx.nd.ones(2, ctx=ctxs[0]), mx.nd.ones(2, ctx=ctxs[1])], "bogus")


def test_get_params_puts_one_replica_in_one_flat_buffer():
    from parallel import FlatReplica
    replica = get_params(init_lenet_params(seed=1), mx.cpu(1))
    assert isinstance(replica, FlatReplica) and isinstance(replica, list)
    total = sum(int(np.prod(s)) for s in [p.shape for p in replica])
    assert replica.data.shape == replica.grad.shape == (total,)
    assert replica.data.context == replica.grad.context == mx.cpu(1)
    replica.data[:] = 3            # the members are views of the buffer, not copies
    assert all((p.asnumpy() == 3).all() for p in replica)
    replica[1][:] = 5
    assert (replica.data.asnumpy() == 5).sum() == replica[1].size
    replica.grad[:] = 2
    assert all((p.grad.asnumpy() == 2).all() for p in replica)


def test_mixed_dtypes_give_a_plain_list():
    from parallel import FlatReplica
    replica = get_params([mx.nd.ones(2), mx.nd.ones(3, dtype="float64")], mx.cpu())
    assert not isinstance(replica, FlatReplica)
    assert [p.dtype for p in replica] == [np.float32, np.float64] and replica[1].grad is not None


# ---- ring, tree and the bytes they move ------------------------------------------------------------

from parallel.comm import algorithms as comm   # noqa: E402
from parallel.comm import bytes_moved   # noqa: E402

#: Distinct contexts in no particular order: algorithms must not assume arrays[i] is on cpu(i).
SCRAMBLED = [mx.cpu(3), mx.cpu(1), mx.cpu(4), mx.cpu(0), mx.cpu(7)]


def random_values(rng, shape, dtype, k):
    if dtype == "int32":
        return [rng.randint(-1000, 1000, shape).astype(dtype) for _ in range(k)]
    # mixed magnitudes, so that summing in another order would change the bits
    return [(rng.randn(*shape) * 10.0 ** rng.randint(-3, 4, shape)).astype(dtype) for _ in range(k)]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("dtype", ["float32", "float64", "int32"])
@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("shape", [(1,), (2,), (3,), (4,), (6,), (2, 3, 2), (1001,)])
def test_allreduce_awkward_sizes_dtypes_and_contexts(algorithm, dtype, k, shape, rng):
    """Sizes below K, not divisible by K, one element; three dtypes; contexts in scrambled order."""
    ctx_list = SCRAMBLED[:k]
    values = random_values(rng, shape, dtype, k)
    arrays = [mx.nd.array(v, ctx=c, dtype=dtype) for v, c in zip(values, ctx_list)]
    assert allreduce(arrays, algorithm) is arrays
    expected = np.sum(np.array(values, dtype="float64"), axis=0)
    results = [array.asnumpy() for array in arrays]
    for array, result, ctx in zip(arrays, results, ctx_list):
        assert array.context == ctx and array.shape == shape and result.dtype == np.dtype(dtype)
        if dtype == "int32":
            np.testing.assert_array_equal(result, expected.astype(dtype))
        else:
            rtol = 1e-5 if dtype == "float32" else 1e-12
            np.testing.assert_allclose(result, expected, rtol=rtol, atol=rtol * np.abs(values).max())
    for result in results[1:]:   # bit-identical everywhere, not merely close
        np.testing.assert_array_equal(result.view(np.uint8), results[0].view(np.uint8))


def ring_reference(values):
    """Ring order: chunk c starts on context c and collects c+1, c+2, ... (each adds into its own copy)."""
    k = len(values)
    flats = [v.reshape(-1) for v in values]
    bounds = comm.chunk_bounds(flats[0].size, k)
    out = np.empty_like(flats[0])
    for c in range(k):
        a, b = bounds[c], bounds[c + 1]
        acc = flats[c][a:b].copy()
        for step in range(1, k):
            acc = flats[(c + step) % k][a:b] + acc
        out[a:b] = acc
    return out.reshape(values[0].shape)


def tree_reference(values):
    """Tree order: in round r, value i += value i + 2**r for i a multiple of 2**(r+1)."""
    values, stride = [v.copy() for v in values], 1
    while stride < len(values):
        for i in range(0, len(values) - stride, 2 * stride):
            values[i] = values[i] + values[i + stride]
        stride *= 2
    return values[0]


@pytest.mark.parametrize("algorithm, reference", [("ring", ring_reference), ("tree", tree_reference)])
@pytest.mark.parametrize("k", [2, 3, 4, 5])
@pytest.mark.parametrize("size", [1, 3, 7, 10, 1001])
def test_ring_and_tree_sum_in_their_documented_order(algorithm, reference, k, size, rng):
    """float32 bits equal a numpy re-enactment of the documented schedule: each chunk summed once."""
    values = random_values(rng, (size,), "float32", k)
    arrays = [mx.nd.array(v, ctx=c) for v, c in zip(values, SCRAMBLED)]
    allreduce(arrays, algorithm)
    want = reference(values)
    for array in arrays:
        np.testing.assert_array_equal(array.asnumpy(), want)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_allreduce_writes_through_views_into_a_larger_buffer(algorithm):
    """Gradients are views into a flat buffer: the sum lands in the buffer, the rest is untouched."""
    buffers = [mx.nd.full((12,), -7, ctx=c) for c in SCRAMBLED[:3]]
    views = [buffer[2:8].reshape((3, 2)) for buffer in buffers]
    for i, view in enumerate(views):
        view[:] = mx.nd.arange(6, ctx=view.context).reshape((3, 2)) * (i + 1)
    allreduce(views, algorithm)
    for buffer in buffers:
        got = buffer.asnumpy()
        np.testing.assert_array_equal(got[2:8], np.arange(6) * 6)
        np.testing.assert_array_equal(np.r_[got[:2], got[8:]], -7)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_allreduce_only_queues_work(algorithm, monkeypatch):
    """No algorithm waits for the engine: every way to block raises while allreduce runs."""
    arrays = [mx.nd.ones((5, 3), ctx=c) for c in SCRAMBLED[:4]]
    mx.nd.waitall()

    def blocked(*args, **kwargs):
        raise AssertionError("allreduce blocked on the engine")
    with monkeypatch.context() as m:
        for name in ("asnumpy", "asscalar", "wait_to_read"):
            m.setattr(mx.nd.NDArray, name, blocked)
        m.setattr(mx.nd, "waitall", blocked)
        allreduce(arrays, algorithm)
    assert all((array.asnumpy() == 4).all() for array in arrays)


def count_copies(monkeypatch):
    """Wrap ``comm.copy_to``; returns the list of (source context, destination context, bytes)."""
    copies, copy = [], comm.copy_to

    def counting_copy(src, dst):
        dst_ctx = dst if isinstance(dst, mx.Context) else dst.context
        copies.append((src.context, dst_ctx, src.size * src.dtype(0).itemsize))
        return copy(src, dst)
    monkeypatch.setattr(comm, "copy_to", counting_copy)
    return copies


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("size, dtype", [(1, "float32"), (3, "float32"), (7, "float64"), (8, "int32"),
                                         (1001, "float32"), (1002, "float64")])
def test_bytes_moved_matches_the_copies_made(algorithm, k, size, dtype, monkeypatch):
    copies = count_copies(monkeypatch)
    ctx_list = SCRAMBLED[:k]
    arrays = [mx.nd.full((size,), i + 1, ctx=c, dtype=dtype) for i, c in enumerate(ctx_list)]
    allreduce(arrays, algorithm)
    assert all((array.asnumpy() == k * (k + 1) // 2).all() for array in arrays)   # still correct
    assert all(src != dst for src, dst, _ in copies), "a copy that stays on its context is not traffic"
    sent = {ctx: sum(n for src, _, n in copies if src == ctx) for ctx in ctx_list}
    received = {ctx: sum(n for _, dst, n in copies if dst == ctx) for ctx in ctx_list}
    itemsize = np.dtype(dtype).itemsize
    predicted = bytes_moved(algorithm, size * itemsize, k, itemsize=itemsize)
    assert predicted.total == sum(n for _, _, n in copies)
    assert predicted.per_context_max == max(max(sent[c], received[c]) for c in ctx_list)


def test_bytes_moved_closed_forms():
    n = 4000   # 1000 float32, divisible by 2, 4, 5, 8
    assert bytes_moved("naive", n, 4) == bytes_moved("fused", n, 4) == (6 * n, 3 * n)
    assert bytes_moved("ring", n, 4) == (6 * n, 6 * n // 4)              # 2 (K-1)/K n per context
    assert bytes_moved("ring", n, 5) == (8 * n, 8 * n // 5)
    assert bytes_moved("ring", n, 2) == bytes_moved("naive", n, 2) == (2 * n, n)
    assert bytes_moved("tree", n, 5) == (8 * n, 3 * n) and bytes_moved("tree", n, 8) == (14 * n, 3 * n)
    assert bytes_moved("ring", n, 1) == (0, 0)
    moved = bytes_moved("ring", 12, 3, itemsize=4)
    assert moved.total == 48 and moved.per_context_max == 16            # namedtuple fields
    assert bytes_moved("ring", 4 * 7, 3).per_context_max == 4 * (2 * 7 - 2 - 2)   # chunks 3, 2, 2


def test_bytes_moved_rejects_bad_arguments():
    with pytest.raises(ValueError, match="algorithm must be one of naive, fused, ring, tree; got 'bogus'"):
        bytes_moved("bogus", 8, 2)
    with pytest.raises(ValueError, match="k must be >= 1, got 0"):
        bytes_moved("ring", 8, 0)
    with pytest.raises(ValueError, match="nbytes must be >= 0, got -4"):
        bytes_moved("ring", -4, 2)
    with pytest.raises(TypeError, match="nbytes must be an int, got 8.0"):
        bytes_moved("ring", 8.0, 2)
    with pytest.raises(TypeError, match="k must be an int, got True"):
        bytes_moved("ring", 8, True)
    with pytest.raises(ValueError, match="nbytes=10 is not a whole number of 4-byte elements"):
        bytes_moved("ring", 10, 2)


def test_the_cli_offers_exactly_the_algorithms_that_exist():
    from parallel.comm import ALGORITHMS, DEFAULT_ALGORITHM
    from parallel.train import build_parser
    choices = build_parser().option("allreduce").choices
    assert tuple(ALLREDUCE_ALGORITHMS) == ALGORITHMS == tuple(choices) and DEFAULT_ALGORITHM in ALGORITHMS


# ---- persistent receive buffers --------------------------------------------------------------------

@pytest.fixture
def fresh_buffers():
    """An empty receive-buffer cache with the default limit, emptied and restored afterwards."""
    comm.free_buffers()
    limit = comm.set_buffer_limit(comm.DEFAULT_BUFFER_LIMIT)
    yield
    comm.set_buffer_limit(limit)
    comm.free_buffers()


def cached():
    """The cached buffers, by key."""
    return dict(comm.BUFFERS.buffers)


def full_arrays(shape, ctx_list, dtype="float32", scale=1):
    return [mx.nd.full(shape, scale * (i + 1), ctx=c, dtype=dtype) for i, c in enumerate(ctx_list)]


@pytest.mark.parametrize("algorithm, k, entries", [
    ("naive", 2, 1), ("naive", 4, 1), ("fused", 2, 1), ("fused", 4, 3), ("ring", 2, 2), ("ring", 4, 4),
    ("tree", 4, 2), ("tree", 5, 2), ("tree", 3, 1)])
def test_buffers_are_reused_across_calls(algorithm, k, entries, fresh_buffers, monkeypatch):
    """The second call with the same shapes allocates nothing: it copies into the first call's buffers."""
    copies, copy = [], comm.copy_to

    def recording_copy(src, dst):
        copies.append(dst)
        return copy(src, dst)
    monkeypatch.setattr(comm, "copy_to", recording_copy)
    ctx_list = SCRAMBLED[:k]
    allreduce(full_arrays((1000,), ctx_list), algorithm)
    first, info = cached(), comm.buffer_info()
    assert len(first) == info.entries == info.allocations == entries and info.evictions == 0
    # the documented memory cost: fused keeps K-1 arrays, naive 1, tree 1 per receiver, ring a chunk each
    whole = 1000 * 4
    assert info.nbytes == {"naive": whole, "fused": (k - 1) * whole, "tree": entries * whole,
                           "ring": whole}[algorithm]
    handles = {key: buffer.handle.value for key, buffer in first.items()}
    for scale in (10, 100):
        copies.clear()
        arrays = full_arrays((1000,), ctx_list, scale=scale)
        allreduce(arrays, algorithm)
        assert all((a.asnumpy() == scale * k * (k + 1) // 2).all() for a in arrays)
        assert comm.buffer_info() == info                     # nothing allocated, nothing dropped
        now = cached()
        assert set(now) == set(first) and all(now[key] is first[key] for key in first)
        assert {key: b.handle.value for key, b in now.items()} == handles
        # every copy lands in an existing array: a cached buffer (receive) or a caller's array (send back)
        assert all(isinstance(dst, mx.nd.NDArray) for dst in copies)
        received = [dst for dst in copies if any(dst is b for b in first.values())]
        assert len(received) == (k * (k - 1) if algorithm == "ring" else k - 1)


def test_algorithms_share_buffers_of_one_shape(fresh_buffers):
    """fused's first slot is naive's and tree's: four algorithms over K=4 keep 3 + 1 + 4 buffers."""
    ctx_list = contexts(4)
    for algorithm in ALGORITHMS:
        allreduce(full_arrays((64,), ctx_list), algorithm)
    info = comm.buffer_info()
    # cpu(0): fused slots 0-2 (naive and tree use slot 0); cpu(2): tree; ring: a chunk on each context
    assert info.entries == 3 + 1 + 4 and info.nbytes == (4 * 64 + 4 * 16) * 4


def test_the_cache_stays_within_its_limit(fresh_buffers):
    """Many shapes: least recently used buffers go, the total never exceeds the limit, sums stay right."""
    assert comm.set_buffer_limit(10_000) == comm.DEFAULT_BUFFER_LIMIT
    ctx_list, sizes = contexts(3), range(100, 1300, 100)   # 400 .. 4,800 bytes per buffer, 2 per call
    for size in sizes:
        arrays = full_arrays((size,), ctx_list)
        allreduce(arrays, "fused")
        assert all((a.asnumpy() == 6).all() for a in arrays)
        info = comm.buffer_info()
        assert info.nbytes <= 10_000 and info.limit == 10_000
        assert info.nbytes == sum(b.size * 4 for b in cached().values())
    assert info.evictions > 0 and info.allocations == 2 * len(sizes)
    # the most recent call's two buffers are the ones kept (first-context slots 0 and 1)
    assert sorted((key[2], key[4]) for key in cached()) == [((1200,), 0), ((1200,), 1)]
    # lowering the limit drops buffers at once; a buffer larger than the limit is never kept
    comm.set_buffer_limit(4000)
    assert comm.buffer_info().nbytes <= 4000
    arrays = full_arrays((1001,), ctx_list)
    allreduce(arrays, "naive")
    assert all((a.asnumpy() == 6).all() for a in arrays)
    assert all(key[2] != (1001,) for key in cached())
    comm.set_buffer_limit(0)                     # no cache at all: still right
    assert comm.buffer_info().entries == 0
    for algorithm in ALGORITHMS:
        arrays = full_arrays((7,), ctx_list)
        allreduce(arrays, algorithm)
        assert all((a.asnumpy() == 6).all() for a in arrays)
    assert comm.buffer_info().entries == 0


def test_set_buffer_limit_rejects_bad_values(fresh_buffers):
    with pytest.raises(ValueError, match="nbytes must be >= 0, got -1"):
        comm.set_buffer_limit(-1)
    with pytest.raises(TypeError, match="nbytes must be an int, got 1.5"):
        comm.set_buffer_limit(1.5)
    with pytest.raises(TypeError, match="nbytes must be an int, got True"):
        comm.set_buffer_limit(True)
    assert comm.buffer_info().limit == comm.DEFAULT_BUFFER_LIMIT


def test_free_buffers_empties_the_cache(fresh_buffers):
    ctx_list = contexts(4)
    allreduce(full_arrays((100,), ctx_list), "fused")
    assert comm.buffer_info().entries == 3
    comm.free_buffers()
    assert comm.buffer_info() == (0, 0, comm.DEFAULT_BUFFER_LIMIT, 0, 0)
    arrays = full_arrays((100,), ctx_list)
    allreduce(arrays, "fused")
    assert all((a.asnumpy() == 10).all() for a in arrays) and comm.buffer_info().allocations == 3


def naive_reference(values):
    """The textbook's order: ((a0 + a1) + a2) + ..."""
    total = values[0].copy()
    for value in values[1:]:
        total = total + value
    return total


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_interleaved_shapes_and_dtypes_give_the_same_bits_as_a_fresh_cache(algorithm, fresh_buffers, rng):
    """Shapes and dtypes interleaved, buffers reused between them: every result is bit-identical to the
    one computed with an empty cache (and to the documented order, where numpy can re-enact it)."""
    k, cases = 4, []
    for shape in [(3,), (1001,), (20, 1, 3, 3), (1001,), (3,), (4, 5)]:
        for dtype in ["float32", "float64", "int32"]:
            cases.append(random_values(rng, shape, dtype, k))
    references = {"naive": naive_reference, "ring": ring_reference, "tree": tree_reference}

    def run(values):
        arrays = [mx.nd.array(v, ctx=c, dtype=v.dtype) for v, c in zip(values, SCRAMBLED)]
        return allreduce(arrays, algorithm)
    fresh = []
    for values in cases:
        comm.free_buffers()
        fresh.append(run(values)[0].asnumpy())
    results = [run(values) for values in cases * 2]           # queued back to back, the cache warm
    for values, want, arrays in zip(cases * 2, fresh * 2, results):
        for array in arrays:
            got = array.asnumpy()
            assert got.dtype == want.dtype
            np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
        if algorithm in references and values[0].dtype == np.float32:
            np.testing.assert_array_equal(want, references[algorithm](values))


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_back_to_back_calls_do_not_corrupt_the_buffers(algorithm, fresh_buffers, monkeypatch):
    """Calls queued without waiting (MXNet's engine is asynchronous) share the buffers; each call's adds
    still read its own copies: the engine runs a buffer's next copy only after this call has read it."""
    ctx_list, n = SCRAMBLED[:4], 1 << 20      # 4 MB per array: slow enough for the calls to overlap
    calls = [full_arrays((n,), ctx_list, scale=10 ** j) for j in range(4)]
    algorithms = [algorithm, algorithm, "fused", algorithm]   # another algorithm in between, same buffers
    mx.nd.waitall()

    def blocked(*args, **kwargs):
        raise AssertionError("allreduce blocked on the engine")
    with monkeypatch.context() as m:
        for name in ("asnumpy", "asscalar", "wait_to_read"):
            m.setattr(mx.nd.NDArray, name, blocked)
        m.setattr(mx.nd, "waitall", blocked)
        for arrays, name in zip(calls, algorithms):
            allreduce(arrays, name)
        for arrays in calls:                  # then overwrite the inputs while the work may still run
            for array in arrays:
                array += 0
    for j, arrays in enumerate(calls):
        for array in arrays:
            got = array.asnumpy()
            assert got.min() == got.max() == 10 * 10 ** j, f"call {j} read another call's buffer"


def test_threads_calling_allreduce_at_once_do_not_mix_their_buffers(fresh_buffers):
    """Two threads reduce arrays of one shape on the same contexts: their calls queue one at a time."""
    import threading
    ctx_list, errors = contexts(3), []

    def work(scale):
        try:
            for _ in range(20):
                arrays = full_arrays((50_000,), ctx_list, scale=scale)
                allreduce(arrays, "naive")
                results = [array.asnumpy() for array in arrays]
                assert all(r.min() == r.max() == 6 * scale for r in results)
        except Exception as e:   # noqa: BLE001 - reported below
            errors.append(e)
    threads = [threading.Thread(target=work, args=(scale,)) for scale in (1, 1000)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
