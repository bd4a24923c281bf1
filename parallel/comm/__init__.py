"""Communication between contexts: replicas of a model on each context, and the allreduce that sums them.

- ``replica``: ``get_params`` copies a model's parameters (a list of arrays, or a gluon block) to a context, with
  gradients, as views into one flat buffer (a ``FlatReplica``), the gradients in buckets (``bucket_ranges``);
  ``block_state`` reads a block's arrays by role.
- ``algorithms``: ``allreduce(arrays, algorithm)`` leaves the elementwise *sum* in every array, by one of the
  ``ALGORITHMS``; its persistent receive buffers (``free_buffers``, ``set_buffer_limit``, ``buffer_info``,
  ``buffer_bytes``); and ``bytes_moved``, what each algorithm copies between contexts; ``reduce_scatter`` and
  ``all_gather``, an allreduce's two halves (``shard_range`` tells which shard each context owns between them);
  ``receive``, ``scratch`` and ``exclusive``, the buffers a communication hook moves payloads through.
- ``tensor``: Megatron's f and g for the ranks of a tensor-parallel group, and the tape that runs a group's
  backward pass through them: ``SegmentTape`` (a segment between two collectives at a time, what
  ``parallel.models.layers.run_ranks`` records on).
- ``reducer``: the ``Reducer`` (algorithm, buckets, the job, one communication hook: ``allreduce_hook``, a codec's
  ``CompressionHook`` or the user's), ``allreduce_grads`` and ``compressed_allreduce``.

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

#: The most MiB of gradients a bucket of a ``Reducer`` holds unless told otherwise: PyTorch DDP's ``bucket_cap_mb``.
DEFAULT_BUCKET_MB = 25

#: The bucket size ``python -m parallel.train`` uses by default in a job whose processes span several hosts
#: (``bucket_mb_for``): across a network link smaller buckets start travelling sooner, so less of the sum is left
#: to travel after the backward pass ends (benchmarks/README.md, "Buckets across hosts").
HOSTS_BUCKET_MB = 5


def bucket_mb_for(hosts):
    """The default bucket size for a job across ``hosts`` hosts, and why, in words ("" for one host):
    ``DEFAULT_BUCKET_MB`` inside one machine, ``HOSTS_BUCKET_MB`` across several.

    >>> bucket_mb_for(1), bucket_mb_for(3)
    ((25, ''), (5, 'the default for a job across 3 hosts'))
    """
    if hosts > 1:
        return HOSTS_BUCKET_MB, f"the default for a job across {hosts} hosts"
    return DEFAULT_BUCKET_MB, ""

#: The algorithms that split into a reduce-scatter and an all-gather (``reduce_scatter``, ``all_gather``), which
#: sharded optimizer state with ``zero=2`` needs.
SHARDED_ALGORITHMS = ("fused", "ring")

_SOURCES = {
    "replica": ["Replica", "FlatReplica", "Bucket", "get_params", "bucket_ranges", "bucket_bytes", "block_state",
                "grads_of", "names_of", "aux_of", "aux_names_of"],
    "algorithms": ["allreduce", "reduce_scatter", "all_gather", "shard_range", "check_same_arrays",
                   "ALLREDUCE_ALGORITHMS", "bytes_moved", "BytesMoved", "free_buffers", "set_buffer_limit",
                   "buffer_info", "buffer_bytes", "BufferInfo", "DEFAULT_BUFFER_LIMIT", "receive", "scratch", "exclusive"],
    "reducer": ["Reducer", "GradBucket", "BucketComm", "allreduce_hook", "CompressionHook", "as_reducer",
                "allreduce_grads", "compressed_allreduce"],
    "tensor": ["SegmentTape"],
}
__all__ = ["ALGORITHMS", "DEFAULT_ALGORITHM", "SHARDED_ALGORITHMS", "DEFAULT_BUCKET_MB", "HOSTS_BUCKET_MB",
           "bucket_mb_for"] + [name for names in _SOURCES.values() for name in names]
__getattr__, __dir__ = lazy_exports(__name__, _SOURCES)
