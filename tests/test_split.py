import mxnet as mx
import numpy as np
import pytest

from parallel import shard_sizes, split_and_load
from conftest import contexts


@pytest.mark.parametrize("n", list(range(1, 20)) + [255, 256, 257])
@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 6])
def test_shards_cover_batch_in_order_and_differ_by_at_most_one(n, k):
    data = mx.nd.arange(n * 2).reshape((n, 2))
    shards = split_and_load(data, contexts(k))
    sizes = [s.shape[0] for s in shards]
    assert len(shards) == min(n, k)
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1
    assert sizes == shard_sizes(n, k)
    for i, shard in enumerate(shards):
        assert shard.context == mx.cpu(i) and shard.shape[1:] == (2,)
    np.testing.assert_array_equal(np.concatenate([s.asnumpy() for s in shards]), data.asnumpy())


def test_six_contexts_batch_256_is_not_an_error():
    assert shard_sizes(256, 6) == [43, 43, 43, 43, 42, 42]


def test_numpy_input_keeps_dtype():
    shards = split_and_load(np.arange(5, dtype=np.int32), contexts(2))
    assert [s.dtype for s in shards] == [np.int32, np.int32]
    assert shards[0].asnumpy().tolist() == [0, 1, 2]


def test_bad_input():
    with pytest.raises(ValueError, match="empty batch"):
        split_and_load(np.zeros((0, 3), dtype=np.float32), contexts(2))
    with pytest.raises(ValueError, match="ctx_list is empty"):
        split_and_load(mx.nd.zeros((4, 3)), [])
    with pytest.raises(TypeError, match="NDArray or numpy"):
        split_and_load([1, 2, 3], contexts(2))


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("shape", [(3, 0), (2, 4, 0), (1, 0, 2)])
def test_examples_without_values_raise_value_error_not_mxnet_error(shape, k):
    # Before: an MXNetError from _copyto's shape inference for K >= 2, and a silent view for K = 1.
    for data in (np.zeros(shape, dtype=np.float32), mx.nd.array(np.zeros(shape, dtype=np.float32))):
        with pytest.raises(ValueError, match=r"holds no values"):
            split_and_load(data, contexts(k))


def test_empty_batch_is_refused_before_any_mxnet_call(monkeypatch):
    def no_mxnet(*args, **kwargs):
        raise AssertionError("split_and_load called MXNet on an empty batch")
    monkeypatch.setattr(mx.nd, "array", no_mxnet)
    with pytest.raises(ValueError, match=r"empty batch: data has shape \(0, 3\)"):
        split_and_load(np.zeros((0, 3), dtype=np.float32), contexts(2))


def test_empty_ndarray_batch_names_its_shape():
    with mx.util.np_shape(True):   # legacy shapes read a 0 as unknown: mx.nd.zeros((0, 5)) fails there
        data = mx.nd.zeros((0, 5))
        with pytest.raises(ValueError, match=r"empty batch: data has shape \(0, 5\)"):
            split_and_load(data, contexts(3))


def test_ctx_list_must_be_a_list_of_contexts():
    data = mx.nd.ones((4, 2))
    with pytest.raises(TypeError, match=r"single context cpu\(0\); write \[cpu\(0\)\]"):
        split_and_load(data, mx.cpu(0))
    with pytest.raises(TypeError, match=r"ctx_list\[1\] must be an mxnet Context"):
        split_and_load(data, [mx.cpu(0), "cpu(1)"])


def test_shard_sizes_needs_a_context():
    with pytest.raises(ValueError, match="at least one context"):
        shard_sizes(5, 0)
