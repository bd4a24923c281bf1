"""MXNet's engine from Python: operations pushed through its C API, to run a function in a context's worker thread
or to order reads and writes MXNet was not told of.

MXNet orders the operations on an array by what each declares it reads and writes. One of its operators does not
declare a write: on CPU contexts, BatchNorm's backward pass updates the running mean and variance (inputs it only
declares it reads), so an operation queued after ``backward()`` that reads them (a copy of the statistics to a
replica that computed nothing this step, a checkpoint) could run before they are written, and did, under load
(``tests/test_step.py``). ``fence(reads, writes)`` queues an empty operation that reads ``reads`` and writes
``writes``: whatever is queued after it on ``writes`` waits for everything queued before it on ``reads``.
"""
import ctypes

from .mxnet_compat import mxnet_library

__all__ = ["fence", "mark", "push_sync", "ContextHandle", "ENGINE_SYNC_FUNC", "NOTHING"]


class ContextHandle(ctypes.Structure):
    """``mxnet::Context`` as the C API's ``ContextHandle`` points to it: device type and id, two int32."""
    _fields_ = [("dev_type", ctypes.c_int32), ("dev_id", ctypes.c_int32)]


#: ``EngineSyncFunc`` of MXNet's C API: ``void (*)(void *run_context, void *param)``.
ENGINE_SYNC_FUNC = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p)

def _native_nothing():
    """A C function that changes nothing (libc's ``pthread_self``, which takes no argument: the extra two are
    ignored, as the C calling conventions allow) as an ``ENGINE_SYNC_FUNC``, or None where there is none. MXNet's
    engine thread calls it without Python: a Python callback must take the interpreter's lock first, and while the
    main thread issues operators that took 5.1 ms here against 6 us for this one (the interpreter hands its lock
    over every 5 ms), time in which that context's engine thread ran nothing."""
    try:
        return ENGINE_SYNC_FUNC(ctypes.cast(ctypes.CDLL(None).pthread_self, ctypes.c_void_p).value)
    except (OSError, AttributeError):   # no C library to look in: a Python callback does the same, slower
        return None


#: The fence's and the marks' operation: it does nothing; kept for the life of the process, so MXNet may call it at
#: any time.
NOTHING = _native_nothing() or ENGINE_SYNC_FUNC(lambda run_context, param: None)


def _handles(arrays):
    return (ctypes.c_void_p * len(arrays))(*[array.handle for array in arrays])


def push_sync(callback, ctx, reads=(), writes=(), name=None):
    """Queue ``callback`` (an ``ENGINE_SYNC_FUNC``, which the caller keeps alive until it has run) as an operation
    on ``ctx`` that reads the NDArrays ``reads`` and writes ``writes`` (``MXEnginePushSyncND``), named ``name`` in
    MXNet's profiler. Returns at once."""
    import mxnet as mx
    handle = ContextHandle(ctx.device_typeid, ctx.device_id)
    reads, writes = list(reads), list(writes)
    mx.base.check_call(mxnet_library().MXEnginePushSyncND(
        callback, None, None, ctypes.byref(handle), _handles(reads) if reads else None, len(reads),
        _handles(writes) if writes else None, len(writes), None, 0, None if name is None else name.encode()))


def fence(reads, writes):
    """Order ``writes`` after ``reads``: an empty operation on the context of ``writes[0]`` that reads the NDArrays
    ``reads`` and writes ``writes``, so that whatever is queued later on ``writes`` waits for every operation
    queued earlier on ``reads``. Nothing waits; no value changes."""
    writes = list(writes)
    if writes:
        push_sync(NOTHING, writes[0].context, reads, writes)


def mark(name, ctx, reads=(), writes=()):
    """Queue an empty operation named ``name`` on ``ctx`` once the NDArrays ``reads`` are written (and, with
    ``writes``, once everything queued before on ``writes`` has run; what is queued after on them then waits for
    it): a mark in MXNet's profiler (``parallel.trace``) where that context's work reaches that point. No value
    changes."""
    push_sync(NOTHING, ctx, reads, writes, name=name)
