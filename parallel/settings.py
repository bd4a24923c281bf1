"""What the CLI must know before MXNet starts: names, defaults, argument checks and the thread setting.

Nothing here imports MXNet, so ``python -m parallel.train --help`` and every argument error answer at once,
and the CLI can set ``OMP_NUM_THREADS`` in its own process before MXNet reads it (MXNet reads it only when
it is imported). The modules that do the work take their names and defaults from here.

>>> from parallel.settings import check_lr, check_seed
>>> check_lr(0.2)
>>> check_lr(1e-40)
Traceback (most recent call last):
    ...
ValueError: learning rate must be between 1.18e-38 and 3.40e+38 (float32's normal range, which MXNet's update takes), got 1e-40
>>> check_seed(2**32)
Traceback (most recent call last):
    ...
ValueError: seed must be between 0 and 4294967295 (2**32 - 1), got 4294967296
"""
import math
import numbers
import os

__all__ = ["ALLREDUCE_NAMES", "DEFAULT_ALGORITHM", "STRATEGIES", "DEFAULT_STAGES", "DEFAULT_MICRO_BATCHES",
           "MAX_SEED", "LR_RANGE", "check_lr", "check_seed", "recommended_omp_threads"]

#: The allreduce algorithms of ``parallel.comm.allreduce``, by name.
ALLREDUCE_NAMES = ("naive", "fused", "ring", "tree")

#: The algorithm ``train_batch`` and the CLI use unless told otherwise: the fastest measured
#: (benchmarks/allreduce.py, LeNet's flat gradient: fastest at K=4, within 0.1 ms of tree at K=2);
#: ``allreduce`` itself defaults to the textbook's ``"naive"``.
DEFAULT_ALGORITHM = "fused"

#: The ways ``fit`` can spread LeNet over the contexts (``--strategy``).
STRATEGIES = ("data", "model", "pipeline", "hybrid")

#: Stages of the model, pipeline and hybrid strategies when neither stages nor boundaries are given.
DEFAULT_STAGES = 2

#: Micro-batches per batch of the pipeline strategy when not given.
DEFAULT_MICRO_BATCHES = 4

#: Seeds are those numpy's ``RandomState`` takes: 0 .. 2**32 - 1.
MAX_SEED = 2 ** 32 - 1

#: Learning rates MXNet's ``sgd_update`` accepts: its parameters are float32, and it refuses a value that
#: does not parse as a normal float32 ("Out of range value for lr").
LR_RANGE = (1.1754943508222875e-38, 3.4028234663852886e+38)


def check_lr(lr):
    """Raise unless ``lr`` is a number MXNet can step with: finite, > 0, in float32's normal range.

    Raises
    ------
    TypeError
        For anything but a real number.
    ValueError
        For a value outside ``LR_RANGE`` (zero, negative, NaN, inf, or beyond float32).
    """
    if isinstance(lr, bool) or not isinstance(lr, numbers.Real):
        raise TypeError(f"lr must be a number, got {lr!r}")
    low, high = LR_RANGE
    if not (math.isfinite(lr) and lr > 0):
        raise ValueError(f"learning rate must be a finite number > 0, got {lr!r}")
    if not low <= lr <= high:
        raise ValueError(f"learning rate must be between {low:.2e} and {high:.2e} (float32's normal range, "
                         f"which MXNet's update takes), got {lr!r}")


def check_seed(seed):
    """Raise unless ``seed`` is an int in 0 .. ``MAX_SEED`` (what numpy's ``RandomState`` takes)."""
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"seed must be an int, got {seed!r}")
    if not 0 <= seed <= MAX_SEED:
        raise ValueError(f"seed must be between 0 and {MAX_SEED} (2**32 - 1), got {seed}")


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
