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
