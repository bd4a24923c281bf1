"""Operator threads on CPU contexts: how many each operator uses, the CLI's rule before MXNet starts, and
setting it in the engine's worker threads after ``import mxnet``.

Each CPU context runs its operators in its own engine worker thread, and each operator uses that thread's
OpenMP setting, which MXNet fixes when the thread starts (from ``OMP_NUM_THREADS`` if it was set before
``import mxnet``, else half the cores). ``recommended_omp_threads`` is the CLI's rule, ``omp_threads`` reads a
context's setting, ``set_omp_threads`` changes it from the API. Nothing here imports MXNet until called.

>>> recommended_omp_threads(cores=4)
4
"""
import ctypes
import os
import threading

from .engine import ENGINE_SYNC_FUNC, push_sync
from .mxnet_compat import mxnet_library
from .validate import check_int

__all__ = ["recommended_omp_threads", "engine_settings", "omp_threads", "set_omp_threads", "on_worker_threads"]

#: Copies of the CPU scratch memory MXNet keeps (``MXNET_CPU_TEMP_COPY``, 4 by default) for operators that need
#: temporary space: they are shared by every CPU context, each operator of a static graph bound to one, and two
#: operators bound to the same copy never run at once. With 4, K contexts' backward passes mostly ran one after
#: another; with 64 they ran at once (LeNet, batch 128 a context, OMP_NUM_THREADS=1: 75 -> 40 ms a step at K = 2,
#: 152 -> 86 ms at K = 4; at 2 threads, 56 -> 45 ms at K = 2; benchmarks/overlap.py).
CPU_TEMP_COPIES = 64

#: Operators MXNet's imperative backward pass runs as one engine operation
#: (``MXNET_EXEC_BULK_EXEC_MAX_NODE_TRAIN_BWD``, 15 by default): bounded, the gradients appear layer by layer and a
#: bucket's sum can start while the backward of the earlier layers runs (``parallel.comm.reducer``); the package's
#: cached graphs take the same bound as a flag (``parallel.models.lenet.BACKWARD_BULK_SIZE``).
BACKWARD_BULK = 2


def recommended_omp_threads(cores=None):
    """Operator threads (``OMP_NUM_THREADS``) for training on CPU contexts: every core, for any K.

    Each CPU context has its own engine worker thread, and each operator on it runs ``OMP_NUM_THREADS``
    threads. MXNet's default, half the cores, leaves cores idle. Dividing the cores between the K contexts
    (``cores // K``) looks right but measured worse: in a data-parallel step the contexts rarely compute at
    the same instant (the host queues their work one after another, and the allreduce joins them every
    step), so an operator that can use every core wins. On this project's 2-core machine, 2 threads beat 1
    for LeNet at K = 1, 2 and 4, for this package and for gluon's Trainer alike (benchmarks/step_time.py).
    GPU contexts use the CPU only to launch kernels, so the setting hardly matters there.

    MXNet reads ``OMP_NUM_THREADS`` when it is imported, so the value must be in the environment before
    ``import mxnet``; ``python -m parallel.train`` sets it for you, in its own process, unless you set it.
    After ``import mxnet``, ``set_omp_threads`` applies it to the worker threads of given CPU contexts.

    Parameters
    ----------
    cores : int, optional
        Cores to use; defaults to the cores this process may run on.

    Returns
    -------
    int
        Threads per operator, >= 1.

    >>> recommended_omp_threads(cores=8)
    8
    """
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, int(cores))


def engine_settings(cores=None):
    """What ``python -m parallel.train`` puts in the environment before it imports MXNet: ``OMP_NUM_THREADS``
    (``recommended_omp_threads``; MXNet reads it at import), ``MXNET_CPU_TEMP_COPY`` (``CPU_TEMP_COPIES``) and
    ``MXNET_EXEC_BULK_EXEC_MAX_NODE_TRAIN_BWD`` (``BACKWARD_BULK``; MXNet reads these when it first needs them,
    so they must stay set); a variable the user set is left alone. A script of your own sets them the same way,
    before ``import mxnet``.

    >>> sorted(engine_settings(cores=2).items())   # doctest: +NORMALIZE_WHITESPACE
    [('MXNET_CPU_TEMP_COPY', '64'), ('MXNET_EXEC_BULK_EXEC_MAX_NODE_TRAIN_BWD', '2'), ('OMP_NUM_THREADS', '2')]
    """
    return {"OMP_NUM_THREADS": str(recommended_omp_threads(cores)), "MXNET_CPU_TEMP_COPY": str(CPU_TEMP_COPIES),
            "MXNET_EXEC_BULK_EXEC_MAX_NODE_TRAIN_BWD": str(BACKWARD_BULK)}


# ----------------------------------------------------------------------------------------------
# Operator threads after ``import mxnet``: run OpenMP's setting on the engine's worker threads
# ----------------------------------------------------------------------------------------------

#: Seconds a worker thread waits for the context's other worker threads (MXNET_CPU_WORKER_NTHREADS > 1).
_BARRIER_TIMEOUT = 60


def _cpu_worker_threads():
    """Engine threads that run one CPU context's operators, as MXNet read them at import.

    The default engine (``ThreadedEnginePerDevice``) gives each CPU context ``MXNET_CPU_WORKER_NTHREADS``
    threads (default 1); ``NaiveEngine`` runs every operator in the thread that issues it.
    """
    engine = os.environ.get("MXNET_ENGINE_TYPE", "ThreadedEnginePerDevice")
    if engine == "NaiveEngine":
        return 1
    if engine != "ThreadedEnginePerDevice":
        raise RuntimeError(f"MXNET_ENGINE_TYPE={engine} shares one pool of threads between all devices, so the "
                           "threads of a context cannot be reached; set OMP_NUM_THREADS before importing "
                           "mxnet instead, or use the default engine (ThreadedEnginePerDevice)")
    text = os.environ.get("MXNET_CPU_WORKER_NTHREADS", "1")
    try:
        return max(1, int(text))
    except ValueError:
        raise RuntimeError(f"MXNET_CPU_WORKER_NTHREADS={text!r} is not an integer") from None


def on_worker_threads(ctx, fn):
    """Run ``fn()`` once in each engine worker thread of the CPU context ``ctx``; return the results.

    What ``omp_threads`` and ``set_omp_threads`` are made of, public for whatever else must be read or set in the
    threads that run a context's operators (a thread's id, a library's per-thread state).

    Parameters
    ----------
    ctx : mxnet.Context
        A CPU context.
    fn : callable
        Called with no argument in each worker thread; it must not raise into MXNet's thread (an error it
        raises is re-raised here).

    Returns
    -------
    list
        ``fn()``'s results, one per worker thread (``MXNET_CPU_WORKER_NTHREADS`` of them).

    Raises
    ------
    TypeError, ValueError
        For a ``ctx`` that is not a CPU context.

    Pushes one operator per worker thread through MXNet's C API (``MXEnginePushSyncND``), each writing its
    own empty marker array so the engine may run them at once, and waits for the markers. With several
    worker threads, each operator waits at a barrier until all have started, so each lands on a
    different thread. Blocks until the operators already queued on ``ctx`` have run.
    """
    import mxnet as mx

    _check_cpu_context(ctx, "ctx")
    if ctx.device_type == "gpu":
        raise ValueError(f"{ctx} is not a CPU context; no CPU worker thread runs its operators")
    threads = _cpu_worker_threads()
    barrier = threading.Barrier(threads, timeout=_BARRIER_TIMEOUT) if threads > 1 else None
    results, errors = [], []

    def run(run_context, param):   # in an engine worker thread; ctypes takes the GIL for it
        try:
            if barrier is not None:
                barrier.wait()
            results.append((threading.get_native_id(), fn()))
        except BaseException as error:   # nothing may propagate into MXNet's thread
            errors.append(error)

    callback = ENGINE_SYNC_FUNC(run)
    markers = [mx.nd.empty((1,), ctx=ctx) for _ in range(threads)]
    for marker in markers:
        push_sync(callback, ctx, writes=[marker])
    for marker in markers:
        marker.wait_to_read()       # the operator has returned: the callback may be freed now
    if errors:
        if isinstance(errors[0], threading.BrokenBarrierError):
            raise RuntimeError(f"the {threads} operators pushed to {ctx} did not run in {threads} worker "
                               f"threads at once; does MXNET_CPU_WORKER_NTHREADS={threads} still match the "
                               "value mxnet was imported with?") from errors[0]
        raise errors[0]
    return [value for _, value in results]


def _omp_library():
    """libmxnet with its OpenMP runtime's ``omp_get_max_threads`` reachable, or a clear error."""
    import mxnet as mx

    lib = mxnet_library()
    if not mx.runtime.Features().is_enabled("OPENMP") or not hasattr(lib, "omp_get_max_threads"):
        raise RuntimeError("this MXNet build has no OpenMP: every operator runs one thread, there is "
                           "nothing to set")
    return lib


def _check_cpu_context(ctx, name):
    import mxnet as mx

    if not isinstance(ctx, mx.Context):
        raise TypeError(f"{name} must be an mxnet Context such as mx.cpu(0), got {ctx!r}")


def omp_threads(ctx=None):
    """Threads each operator on CPU context ``ctx`` may use now: OpenMP's setting in its worker thread.

    MXNet runs a CPU context's operators in that context's engine worker thread, never in the Python
    thread, so this asks the worker thread itself (``omp_get_max_threads`` there). It blocks until the
    operators already queued on ``ctx`` have run, and starts the context's worker thread if none ran yet.

    Parameters
    ----------
    ctx : mxnet.Context, optional
        A CPU context (``cpu``, ``cpu_pinned`` or ``cpu_shared``); defaults to ``mx.cpu(0)``.

    Returns
    -------
    int
        The smallest setting over the context's worker threads (one thread unless
        ``MXNET_CPU_WORKER_NTHREADS`` says otherwise).

    >>> import mxnet as mx
    >>> omp_threads(mx.cpu(0)) >= 1
    True
    >>> omp_threads(mx.gpu(0))
    Traceback (most recent call last):
        ...
    ValueError: gpu(0) is not a CPU context; GPU operators use no OpenMP threads
    """
    import mxnet as mx

    ctx = mx.cpu(0) if ctx is None else ctx
    _check_cpu_context(ctx, "ctx")
    if ctx.device_type == "gpu":
        raise ValueError(f"{ctx} is not a CPU context; GPU operators use no OpenMP threads")
    lib = _omp_library()
    return min(on_worker_threads(ctx, lambda: int(lib.omp_get_max_threads())))


def set_omp_threads(n=None, ctx_list=None):
    """Let each operator on the given CPU contexts use ``n`` threads, after ``import mxnet``.

    The API counterpart of setting ``OMP_NUM_THREADS`` before MXNet starts, as ``python -m parallel.train``
    does. A CPU context's operators run in its engine worker thread, whose OpenMP thread count MXNet sets
    once, when the thread starts: to half the cores unless ``OMP_NUM_THREADS`` was set before ``import
    mxnet``. Calling MXNet's ``MXSetNumOMPThreads`` from Python changes only the Python thread, where no
    operator runs (measured: no change in step time). This function pushes an operator onto each context
    that calls ``MXSetNumOMPThreads(n)`` in the worker thread itself (through ``MXEnginePushSyncND``), and
    blocks until that has run.

    What changes, and what does not:

    - oneDNN operators (convolution, fully connected, pooling, activation: most of LeNet's time) use ``n``
      threads. MXNet's own kernels (elementwise arithmetic, the SGD update, softmax) keep at most the
      limit MXNet fixed at import (half the cores, unless ``OMP_NUM_THREADS`` or ``MXNET_OMP_MAX_THREADS``
      was set before); nothing after import can raise that limit. For LeNet on 2 cores the step time
      matches ``OMP_NUM_THREADS=2`` set before import all the same: 68 ms against 69 ms, and 125 ms
      with neither (benchmarks/threads.py, medians of 15 fresh processes each).
    - Call it before anything runs on those contexts (``omp_threads`` included): it refuses with a
      ``RuntimeError`` to change the setting of a context whose worker thread has already run operators.
      Changing it then corrupted the heap here (one LeNet step, then ``set_omp_threads(2)`` with
      ``OMP_NUM_THREADS`` unset: 10 of 12 fresh processes aborted in ``free()``, 2 hung): oneDNN keeps
      per-thread state set up for the old thread count. A call that changes nothing is always allowed.
    - Only the contexts in ``ctx_list``: a CPU context used for the first time later starts with MXNet's
      default again, so pass every CPU context you will train on. ``cpu(i)``, ``cpu_pinned(i)`` and
      ``cpu_shared(i)`` share one worker thread. Not changed: the Python thread, MXNet's pool of
      prioritized CPU operators (the kvstore's CPU reductions), other processes, and a forked child
      (MXNet starts new worker threads after a fork).
    - GPU contexts in ``ctx_list`` are skipped: a GPU operator runs on the device, and its worker thread
      only launches kernels, with one OpenMP thread by MXNet's design.

    Parameters
    ----------
    n : int, optional
        Threads per operator, 1 .. the cores this process may run on; defaults to
        ``recommended_omp_threads()`` (every core).
    ctx_list : list of mxnet.Context or mxnet.Context, optional
        The contexts you train on; defaults to ``[mx.cpu(0)]``.

    Returns
    -------
    dict
        The previous setting of each CPU context in ``ctx_list``: ``{context: threads}``. Passing the value
        back restores the setting, for operators set up from then on.

    Raises
    ------
    TypeError
        When ``n`` is not an int, or ``ctx_list`` holds something other than contexts.
    ValueError
        When ``n`` is below 1 or above the cores, or ``ctx_list`` is empty.
    RuntimeError
        When operators already ran on a context whose setting would change (nothing is changed then), for
        an MXNet built without OpenMP, or an engine without per-device threads
        (``MXNET_ENGINE_TYPE=ThreadedEngine``).

    >>> set_omp_threads(0)
    Traceback (most recent call last):
        ...
    parallel.validate.BadValue: n must be >= 1, got 0
    >>> set_omp_threads(2.0)
    Traceback (most recent call last):
        ...
    parallel.validate.BadType: n must be an int, got 2.0
    """
    cores = recommended_omp_threads()
    n = cores if n is None else check_int(n, "n", low=1)
    if n > cores:
        raise ValueError(f"n={n} threads per operator is more than the {cores} cores this process may run on; "
                         f"use at most {cores} (more threads than cores only contend for them)")
    import mxnet as mx

    if ctx_list is None:
        ctx_list = [mx.cpu(0)]
    elif isinstance(ctx_list, mx.Context):
        ctx_list = [ctx_list]
    elif not isinstance(ctx_list, (list, tuple)):
        raise TypeError(f"ctx_list must be a list of mxnet Contexts such as [mx.cpu(0), mx.cpu(1)], "
                        f"got {ctx_list!r}")
    if not ctx_list:
        raise ValueError("ctx_list is empty; give the contexts you train on, such as [mx.cpu(0)]")
    for i, ctx in enumerate(ctx_list):
        _check_cpu_context(ctx, f"ctx_list[{i}]")
    lib = _omp_library()
    threads = int(n)
    previous_by_id = {}
    for ctx in ctx_list:
        if ctx.device_type != "gpu" and ctx.device_id not in previous_by_id:
            previous_by_id[ctx.device_id] = _swap_threads(lib, ctx, threads)
    return {ctx: previous_by_id[ctx.device_id] for ctx in ctx_list if ctx.device_type != "gpu"}


def _thread_ids():
    """Native ids of this process's threads now, or None where the system does not list them (no
    ``/proc/self/task``)."""
    try:
        return {int(name) for name in os.listdir("/proc/self/task")}
    except OSError:
        return None


def _swap_threads(lib, ctx, threads):
    """Set ``threads`` in every worker thread of ``ctx`` if that is safe; return the previous setting.

    Safe means: the setting does not change, or the worker threads are new, started by this very call, so
    that no operator ran in them before. Each worker thread decides, all of them wait until every one has,
    and then all of them change or none does.
    """
    import mxnet as mx

    existing = _thread_ids()
    workers = _cpu_worker_threads()
    barrier = threading.Barrier(workers, timeout=_BARRIER_TIMEOUT) if workers > 1 else None
    verdicts = []

    def swap():
        previous = int(lib.omp_get_max_threads())
        fresh = existing is not None and threading.get_native_id() not in existing
        verdicts.append(previous == threads or fresh)
        if barrier is not None:
            barrier.wait()   # every worker thread has given its verdict
        if all(verdicts) and previous != threads:
            mx.base.check_call(lib.MXSetNumOMPThreads(ctypes.c_int(threads)))
        return previous

    previous = min(on_worker_threads(ctx, swap))
    if not all(verdicts):
        raise RuntimeError(
            f"operators already ran on {ctx} (its engine worker thread was started before this call), and "
            f"changing its OpenMP threads from {previous} to {threads} now can corrupt the heap (oneDNN keeps "
            "per-thread state sized for the old count; seen as aborts and hangs with MXNet 1.9.1); call "
            "set_omp_threads before anything runs on that context, omp_threads included, or set "
            "OMP_NUM_THREADS before importing mxnet (python -m parallel.train does)")
    return previous
