"""The package's allreduce as an MXNet kvstore, so that ``gluon.Trainer`` trains with it.

``gluon.Trainer(params, "sgd", {...}, kvstore=AllreduceKVStore("ring"))`` sums each parameter's gradients over
its contexts with ``parallel.comm.allreduce`` (``algorithm``), or as compressed payloads with error feedback
(``compression``, see ``parallel.compress``), and updates on the contexts as gluon does with
``update_on_kvstore=False``. Importing this module registers the class with MXNet, so that
``mx.kv.create("allreducekvstore")`` makes one with the defaults (the ``fused`` allreduce, no compression).

One process only: the package's cross-process path is ``python -m parallel.launch`` with ``parallel.kvstore``.
"""
import mxnet as mx

from .comm import ALGORITHMS, DEFAULT_ALGORITHM
from .comm.algorithms import allreduce
from .compress.compressors import as_compressor, compressed_allreduce
from .validate import check_choice

__all__ = ["AllreduceKVStore"]


@mx.kvstore.KVStoreBase.register
class AllreduceKVStore(mx.kvstore.KVStoreBase):
    """A single-process kvstore whose ``pushpull`` is the package's allreduce.

    Parameters
    ----------
    algorithm : str
        One of ``parallel.comm.ALGORITHMS``: how each parameter's gradients are summed over its contexts.
    compression : str or parallel.compress.Compressor
        ``"none"`` (default), or a compressor spec (``"fp16"``, ``"2bit"``, ``"topk:0.01"``, ``"powersgd:4"``):
        each parameter's gradients are then compressed on their own, with a residual per parameter and context.
    """

    def __init__(self, algorithm=DEFAULT_ALGORITHM, compression="none"):
        self.algorithm = check_choice(algorithm, "algorithm", ALGORITHMS)
        self.compressor = as_compressor(compression)
        self._flat = {}   # key -> (the arrays last reduced under it, their flat views), for the residuals

    def __repr__(self):
        spec = "none" if self.compressor is None else self.compressor.spec
        return f"AllreduceKVStore({self.algorithm!r}, compression={spec!r})"

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
        """Copy ``value`` into every array of ``out`` (gluon's initial parameters, from its first context)."""
        for array in out if isinstance(out, (list, tuple)) else [out]:
            if array is not value:
                value.copyto(array)

    def pushpull(self, key, value, out=None, priority=0):
        """Sum ``value`` (one array, or one per context) over the contexts, into ``out`` (default: in place)."""
        arrays = list(value) if isinstance(value, (list, tuple)) else [value]
        if len(arrays) > 1:
            if self.compressor is None:
                allreduce(arrays, self.algorithm)
            else:
                compressed_allreduce(self._views(key, arrays), self.compressor, self.algorithm, [arrays[0].shape])
        if out is not None:
            outs = list(out) if isinstance(out, (list, tuple)) else [out]
            for source, target in zip(arrays * len(outs) if len(arrays) == 1 else arrays, outs):
                if target is not source:
                    source.copyto(target)

    def _views(self, key, arrays):
        """Flat views of ``arrays``, the same objects for the same arrays step after step (residuals follow them)."""
        found = self._flat.get(key)
        if found is None or len(found[0]) != len(arrays) or any(a is not b for a, b in zip(found[0], arrays)):
            found = self._flat[key] = (arrays, [array.reshape((-1,)) for array in arrays])
        return found[1]
