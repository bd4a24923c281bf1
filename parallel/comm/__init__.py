"""Communication between contexts: replicas of a model on each context, and the allreduce that sums them.

- ``replica``: ``get_params`` copies a model's parameters (a list of arrays, or a gluon block) to a context, with
  gradients, as views into one flat buffer (a ``FlatReplica``); ``block_state`` reads a block's arrays by role.
- ``algorithms``: ``allreduce(arrays, algorithm)`` leaves the elementwise *sum* in every array, by one of the
  ``ALGORITHMS``; its persistent receive buffers (``free_buffers``, ``set_buffer_limit``, ``buffer_info``); and
  ``bytes_moved``, what each algorithm copies between contexts; ``reduce_scatter`` and ``all_gather``, an
  allreduce's two halves (``shard_range`` tells which shard each context owns between them).

The algorithms' names are here, without MXNet, so that the CLI offers them before MXNet starts:

>>> ALGORITHMS, DEFAULT_ALGORITHM
(('naive', 'fused', 'ring', 'tree'), 'fused')
"""
from ..lazy import lazy_exports

#: The allreduce algorithms, by name: the textbook's ``naive``, ``fused`` (one ``add_n``), ``ring``
#: (reduce-scatter + all-gather), ``tree`` (pairwise sums in log2 K rounds).
ALGORITHMS = ("naive", "fused", "ring", "tree")

#: The algorithm ``train_batch`` and the CLI use unless told otherwise: the fastest measured
#: (benchmarks/allreduce.py, LeNet's flat gradient: fastest at K=4, within 0.1 ms of tree at K=2);
#: ``allreduce`` itself defaults to the textbook's ``"naive"``.
DEFAULT_ALGORITHM = "fused"

#: The algorithms that split into a reduce-scatter and an all-gather (``reduce_scatter``, ``all_gather``), which
#: sharded optimizer state with ``zero=2`` needs.
SHARDED_ALGORITHMS = ("fused", "ring")

_SOURCES = {
    "replica": ["FlatReplica", "get_params", "block_state", "allreduce_grads", "grads_of"],
    "algorithms": ["allreduce", "reduce_scatter", "all_gather", "shard_range", "check_same_arrays", "ALLREDUCE_ALGORITHMS", "bytes_moved", "BytesMoved",
                  "free_buffers", "set_buffer_limit", "buffer_info", "BufferInfo", "DEFAULT_BUFFER_LIMIT"],
}
__all__ = ["ALGORITHMS", "DEFAULT_ALGORITHM", "SHARDED_ALGORITHMS"] + [name for names in _SOURCES.values() for name in names]
__getattr__, __dir__ = lazy_exports(__name__, _SOURCES)
