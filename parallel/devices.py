"""Device contexts: find GPUs, fall back to the CPU, and parse the CLI's ``--devices`` spec.

A *context* (``mx.gpu(i)``, ``mx.cpu(i)``) names where an array lives and where its operators run.
Several CPU contexts (``mx.cpu(0)``, ``mx.cpu(1)``, ...) share the machine's cores but each gets its own
worker thread in MXNet's engine, so they behave like separate devices: this is how the tests run.
"""
import os
import re

import mxnet as mx

__all__ = ["try_gpu", "try_all_gpus", "parse_devices", "recommended_omp_threads"]


def try_gpu(i=0):
    """Return ``mx.gpu(i)`` if that GPU exists, otherwise ``mx.cpu()``.

    Parameters
    ----------
    i : int
        GPU index as this process sees it (after ``CUDA_VISIBLE_DEVICES`` renumbering).

    Returns
    -------
    mxnet.Context
    """
    return mx.gpu(i) if mx.context.num_gpus() >= i + 1 else mx.cpu()


def try_all_gpus():
    """Return every GPU context, or ``[mx.cpu()]`` when there is no GPU.

    Returns
    -------
    list of mxnet.Context
        Never empty.
    """
    return [mx.gpu(i) for i in range(mx.context.num_gpus())] or [mx.cpu()]


_SPEC = re.compile(r"^(cpu|gpu)(?::(.*))?$")


def parse_devices(spec):
    """Turn a device spec into a list of contexts.

    Parameters
    ----------
    spec : str
        ``"auto"``: all GPUs, else one CPU context.
        ``"cpu"`` or ``"cpu:N"``: N CPU contexts ``cpu(0) .. cpu(N-1)`` (N defaults to 1).
        ``"gpu"``: all GPUs.
        ``"gpu:I,J,..."``: those GPU indices, as the process sees them. ``CUDA_VISIBLE_DEVICES``
        renumbers GPUs: with ``CUDA_VISIBLE_DEVICES=2,5`` physical GPUs 2 and 5 are ``gpu:0,1`` here.

    Returns
    -------
    list of mxnet.Context
        Distinct contexts, never empty.

    Raises
    ------
    ValueError
        For a malformed spec, a count below 1, a repeated GPU index, or a GPU that does not exist.
    """
    if not isinstance(spec, str):
        raise TypeError(f"device spec must be a string such as 'cpu:4' or 'gpu:0,1', got {spec!r}")
    text = spec.strip().lower()
    if text == "auto":
        return try_all_gpus()
    match = _SPEC.match(text)
    if not match:
        raise ValueError(f"unknown device spec {spec!r}; use 'auto', 'cpu:N' or 'gpu:I,J,...'")
    kind, arg = match.groups()
    num_gpus = mx.context.num_gpus()
    if kind == "cpu":
        if arg is None or arg == "":
            return [mx.cpu(0)]
        if not arg.isdigit() or int(arg) < 1:
            raise ValueError(f"device spec {spec!r}: 'cpu:N' needs a whole number of contexts N >= 1")
        return [mx.cpu(i) for i in range(int(arg))]
    if arg is None or arg == "":
        if num_gpus == 0:
            raise ValueError(f"device spec {spec!r} asks for GPUs but this machine has none; use 'cpu:N'")
        return [mx.gpu(i) for i in range(num_gpus)]
    parts = arg.split(",")
    if not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"device spec {spec!r}: 'gpu:I,J,...' needs GPU indices such as 'gpu:0,3'")
    indices = [int(p) for p in parts]
    if len(set(indices)) != len(indices):
        raise ValueError(f"device spec {spec!r} repeats a GPU index; list each GPU once")
    missing = [i for i in indices if i >= num_gpus]
    if missing:
        have = f"GPUs 0..{num_gpus - 1}" if num_gpus else "no GPU"
        raise ValueError(f"device spec {spec!r} asks for GPU {missing[0]} but this process sees {have}; "
                         "use 'cpu:N' or check CUDA_VISIBLE_DEVICES")
    return [mx.gpu(i) for i in indices]


def recommended_omp_threads(cores=None):
    """Operator threads (``OMP_NUM_THREADS``) for training on CPU contexts: every core, for any K.

    Each CPU context has its own engine worker thread, and each operator on it runs ``OMP_NUM_THREADS``
    threads. MXNet's default, half the cores, leaves cores idle. Dividing the cores between the K contexts
    (``cores // K``) looks right but measured worse: in a data-parallel step the contexts rarely compute at
    the same instant (the host queues their work one after another, and the allreduce joins them every
    step), so an operator that can use every core wins. On this project's 2-core machine, 2 threads beat 1
    for LeNet at K = 1, 2 and 4, for this package and for gluon's Trainer alike (benchmarks/step_time.py).
    GPU contexts use the CPU only to launch kernels, so the setting hardly matters there.

    MXNet reads ``OMP_NUM_THREADS`` when it starts, so the value must be in the environment before
    ``import mxnet``; ``python -m parallel.train`` sets it for you unless you set it yourself.

    Parameters
    ----------
    cores : int, optional
        Cores to use; defaults to the cores this process may run on.

    Returns
    -------
    int
        Threads per operator, >= 1.
    """
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, int(cores))
