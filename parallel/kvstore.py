"""Joining a distributed job, and the cross-process level of the allreduce (MXNet's kvstore, ps-lite).

Run under ``python -m parallel.launch``, each worker process joins the job, takes rank 0's parameters, and
trains on its slice of every global batch: its own contexts first sum their gradients with the package's
allreduce, then one push and pull of the flat gradient buffer sums the workers' through the kvstore's
servers, and the sum is copied back to the worker's contexts (a hierarchical allreduce, as Horovod and
NCCL do it). W workers of K contexts then train the same model as one context.

>>> from parallel.kvstore import worker_slice
>>> [worker_slice(13, 2, rank, 3) for rank in range(3)]   # 13 examples over 3 workers x 2 contexts
[(0, 5), (5, 9), (9, 13)]
"""
from .comm import FlatReplica
from .split import shard_sizes

__all__ = ["Job", "join", "worker_slice", "broadcast_params", "allreduce_across", "PARAMS_KEY", "GRADS_KEY"]

#: kvstore keys: the flat parameter buffer (broadcast once from rank 0) and the flat gradient buffer.
PARAMS_KEY, GRADS_KEY = 0, 1


class Job:
    """This worker's place in a distributed job: the kvstore, its rank and the number of workers.

    Parameters
    ----------
    kv : mxnet.kvstore.KVStore
        A distributed kvstore (``mx.kv.create('dist_sync')``), or any object with ``rank``,
        ``num_workers``, ``init``, ``push`` and ``pull``.
    """

    def __init__(self, kv):
        self.kv, self.rank, self.num_workers = kv, kv.rank, kv.num_workers
        self._grads_ready = False

    def __repr__(self):
        return f"Job(rank {self.rank} of {self.num_workers}, {self.kv.type})"


def join(kvstore="dist_sync"):
    """Join the job this process was launched into (``python -m parallel.launch``); blocks until every
    worker and server has registered (the launcher's ``--start-timeout`` bounds that wait).

    Parameters
    ----------
    kvstore : str
        ``"dist_sync"`` (CPU contexts), or ``"dist_device_sync"`` (GPUs: the workers' sums are reduced on
        the device before they travel).
    """
    import os
    import mxnet as mx
    if kvstore not in ("dist_sync", "dist_device_sync"):
        raise ValueError(f"kvstore {kvstore!r} is not a synchronous distributed kvstore; use 'dist_sync' or "
                         "'dist_device_sync'")
    if "DMLC_ROLE" not in os.environ:
        raise ValueError("this process was not started by a launcher (no DMLC_ROLE in its environment); run it "
                         "as: python -m parallel.launch -n 2 python ...")
    return Job(mx.kv.create(kvstore))


def worker_slice(n, k, rank, num_workers):
    """The examples ``[start, stop)`` of a global batch of ``n`` that worker ``rank`` trains on.

    The batch is split over all ``num_workers * k`` contexts as ``split_and_load`` splits it (sizes differ by
    at most one, larger first); a worker takes the run of its ``k`` contexts, so its slice, split again over
    its own contexts, gives every context the shard it has in the global split. A worker whose contexts all
    fall beyond ``n`` gets an empty slice (``start == stop``) and must still take part in the step.
    """
    sizes = shard_sizes(n, num_workers * k) if n else []
    sizes += [0] * (num_workers * k - len(sizes))
    start = sum(sizes[:rank * k])
    return start, start + sum(sizes[rank * k:(rank + 1) * k])


def _flat(device_params):
    if not all(isinstance(params, FlatReplica) for params in device_params):
        raise TypeError("a distributed step needs flat replicas: build device_params with get_params, whose "
                        "parameters share one dtype")
    return device_params


def broadcast_params(job, device_params):
    """Give every worker rank 0's parameters, in place (``kv.init`` keeps rank 0's value); then every replica
    of this worker holds them. Call once, before training, on every worker."""
    replicas = _flat(device_params)
    job.kv.init(PARAMS_KEY, replicas[0].data)
    job.kv.pull(PARAMS_KEY, out=replicas[0].data)
    for params in replicas[1:]:
        replicas[0].data.copyto(params.data)


def allreduce_across(job, device_params):
    """Sum the gradient buffer over the workers, in place, after this worker's contexts have summed theirs:
    every replica of every worker then holds the global sum. One push and one pull of the flat buffer (the
    servers split big buffers between them, ``MXNET_KVSTORE_BIGARRAY_BOUND``)."""
    replicas = _flat(device_params)
    grad = replicas[0].grad
    if not job._grads_ready:   # every worker makes the same calls in the same order
        job.kv.init(GRADS_KEY, grad.zeros_like())
        job._grads_ready = True
    job.kv.push(GRADS_KEY, grad)
    job.kv.pull(GRADS_KEY, out=grad)   # without an optimizer on the servers, the value is the sum of the pushes
    for params in replicas[1:]:
        grad.copyto(params.grad)
