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
    with pytest.raises(TypeError, match="non-empty list"):
        allreduce([])
    with pytest.raises(TypeError, match=r"arrays\[1\] must be an NDArray"):
        allreduce([mx.nd.ones(2), np.ones(2)])
    with pytest.raises(ValueError, match="unknown allreduce algorithm 'bogus'"):
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
