"""The package's Reducer as an MXNet kvstore, so that ``gluon.Trainer`` trains with it.

``gluon.Trainer(params, "sgd", {...}, kvstore=AllreduceKVStore("ring"))`` sums the gradients over the contexts
with a ``parallel.comm.Reducer`` (its ``algorithm``, its buckets of at most ``bucket_mb`` MiB, its
``compression``, or a hook registered with ``register_comm_hook``) and updates on the contexts as gluon does with
``update_on_kvstore=False``. Importing this module registers the class with MXNet, so that
``mx.kv.create("allreducekvstore")`` makes one with the defaults (the ``fused`` allreduce, 25 MiB buckets, no
compression).

The store knows every parameter from ``broadcast`` (gluon's first call). At the first ``pushpull`` of a step
(``Trainer.step`` calls it once per parameter, right after ``backward()`` has returned, before the gradients
exist), it hands the whole step's gradients to the reducer (``Reducer.reduce_arrays``), which queues their
reduction bucket by bucket, the last parameters first (gluon numbers its parameters in the order it holds them): a
bucket of one parameter is summed in place, a bucket of several is packed into one flat buffer a context (kept
from step to step, so a codec's residuals follow it), summed, and unpacked. MXNet's engine runs each bucket's sum
as soon as backward has written its gradients. The other parameters' ``pushpull`` calls of the step find their
sums done; a key called a second time starts the next step. So a gradient changed between two ``pushpull`` calls
of one step (no ``Trainer`` method does that) is not seen.

One process only: the package's cross-process path is ``python -m parallel.launch`` with ``parallel.job``.
"""
import mxnet as mx

from .comm import DEFAULT_ALGORITHM, DEFAULT_BUCKET_MB
from .comm.reducer import Reducer

__all__ = ["AllreduceKVStore"]


@mx.kvstore.KVStoreBase.register
class AllreduceKVStore(mx.kvstore.KVStoreBase):
    """A single-process kvstore whose ``pushpull`` is the package's allreduce.

    Parameters
    ----------
    algorithm : str
        One of ``parallel.comm.ALGORITHMS``: how each bucket's gradients are summed over its contexts.
    compression : str or parallel.compress.Codec
        ``"none"`` (default), or a codec spec (``"fp16"``, ``"2bit"``, ``"topk:0.01"``, ``"powersgd:4"``): each
        bucket's gradients are then sent compressed, with a residual per context.
    bucket_mb : float or None
        The most MiB of gradients a bucket holds (``DEFAULT_BUCKET_MB``); None: the whole step in one bucket.

    Attributes
    ----------
    reducer : parallel.comm.Reducer
        What sums each bucket; ``reducer.register_comm_hook(hook)`` sums them with a hook of your own.
    """

    def __init__(self, algorithm=DEFAULT_ALGORITHM, compression="none", bucket_mb=DEFAULT_BUCKET_MB):
        self.reducer = Reducer(algorithm, bucket_mb, compression)
        self._params = {}    # key -> its parameter's arrays, one a context (from broadcast): their .grad
        self._done = set()   # keys whose sums this step's first pushpull already made

    def __repr__(self):
        codec = self.reducer.codec
        return (f"AllreduceKVStore({self.algorithm!r}, compression={'none' if codec is None else codec.spec!r}, "
                f"bucket_mb={self.reducer.bucket_mb!r})")

    @property
    def algorithm(self):
        return self.reducer.algorithm

    @property
    def type(self):
        return "allreducekvstore"

    @property
    def rank(self):
        return 0

    @property
    def num_workers(self):
        return 1

    def is_capable(self, capability):
        """No optimizer on the store: ``gluon.Trainer`` updates on the contexts (``update_on_kvstore=False``)."""
        return False

    def set_optimizer(self, optimizer):
        raise NotImplementedError("AllreduceKVStore does not update on the store; gluon.Trainer updates on the "
                                  "contexts when is_capable('optimizer') is False")

    def save_optimizer_states(self, fname, dump_optimizer=False):
        raise NotImplementedError("AllreduceKVStore holds no optimizer: use Trainer.save_states")

    def load_optimizer_states(self, fname):
        raise NotImplementedError("AllreduceKVStore holds no optimizer: use Trainer.load_states")

    def broadcast(self, key, value, out, priority=0):
        """Copy ``value`` into every array of ``out`` (gluon's initial parameters, from its first context), and
        remember ``out`` as the parameter of ``key``: its gradients are summed with the step's others."""
        outs = list(out) if isinstance(out, (list, tuple)) else [out]
        for array in outs:
            if array is not value:
                value.copyto(array)
        self._params[key] = outs

    def pushpull(self, key, value, out=None, priority=0):
        """Sum ``value`` (one array, or one per context) over the contexts, into ``out`` (default: in place)."""
        arrays = list(value) if isinstance(value, (list, tuple)) else [value]
        if len(arrays) > 1:
            if key in self._done:           # summed with the step's first key
                self._done.discard(key)
            else:
                self._sum_step(key, arrays)
        if out is not None:
            outs = list(out) if isinstance(out, (list, tuple)) else [out]
            for source, target in zip(arrays * len(outs) if len(arrays) == 1 else arrays, outs):
                if target is not source:
                    source.copyto(target)

    def _step_grads(self, key, arrays):
        """``{key: gradients}`` of ``key`` and of every other parameter with dense gradients on the same contexts,
        whatever their dtypes (the reducer buckets each run of one dtype apart)."""
        contexts = [a.context for a in arrays]
        grads = {key: arrays}
        for other, data in self._params.items():
            if other != key and [d.context for d in data] == contexts:
                found = [d.grad for d in data]
                if all(g is not None and g.stype == "default" for g in found):
                    grads[other] = found
        return grads if key in self._params else {key: arrays}   # a key gluon never announced: on its own

    def _sum_step(self, key, arrays):
        """Sum ``arrays`` (``key``'s gradients) and those of every other parameter on the same contexts, bucket by
        bucket through the reducer (``Reducer.reduce_arrays``, in key order: the last keys' bucket first); mark the
        others done for this step."""
        grads = self._step_grads(key, arrays)
        keys = sorted(grads)
        self.reducer.reduce_arrays([grads[k] for k in keys], names=keys)
        self._done = set(keys) - {key}
