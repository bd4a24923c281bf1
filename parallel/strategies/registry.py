"""A strategy of ``STRATEGIES`` by name: what the training loop and ``python -m parallel.train --strategy`` use.

>>> import mxnet as mx
>>> from parallel import init_lenet_params
>>> strategy = make_strategy("hybrid", init_lenet_params(seed=0), [mx.cpu(i) for i in range(4)])
>>> strategy.name, strategy.describe()
('hybrid', '2 replicas x 2 stages: conv1,conv2 @ cpu(0),cpu(2) | dense1,dense2 @ cpu(1),cpu(3); gradients summed with the fused allreduce in buckets of 25 MiB')
"""

from ..comm.reducer import as_reducer
from ..layout import Layout
from ..validate import BadType, check_contexts
from . import Stages
from .hybrid import Hybrid

__all__ = ["make_strategy", "layout_of"]


def _as_stages(stages):
    if stages is None or isinstance(stages, Stages):
        return stages or Stages()
    if isinstance(stages, int) and not isinstance(stages, bool):
        return Stages(count=stages)
    raise BadType("stages", f"{{stages}} must be a number of stages or a Stages(count, boundaries, micro_batches), "
                            f"got {type(stages).__name__}")


def layout_of(name, stages=None, reducer=None, recompute=False, zero=0, tensor=1, expert_parallel=1):
    """The ``Layout`` of ``make_strategy``'s arguments: the preset ``name``, where ``stages`` cut the model and how a
    pipeline is fed (a number of stages or a ``Stages``), the other axes, and the reducer's compression."""
    count, boundaries, micro_batches, schedule, virtual = _as_stages(stages)
    codec = as_reducer(reducer).codec
    return Layout(name, stages=count, boundaries=boundaries, micro_batches=micro_batches, schedule=schedule,
                  virtual=virtual, tensor=tensor, zero=zero, recompute=recompute,
                  compression="none" if codec is None else codec.spec, expert_parallel=expert_parallel)


def make_strategy(name, params, ctx_list, stages=None, reducer=None, recompute=False, zero=0, tensor=1,
                  batch_size=None, expert_parallel=1):
    """Lay ``params`` out on ``ctx_list`` as the layout ``name`` and the axes say.

    Parameters
    ----------
    name : str or parallel.Layout
        One of ``STRATEGIES`` (a preset of the axes: ``"data"``, ``"model"``, ``"pipeline"``, ``"hybrid"``), or a
        whole ``Layout`` (then the axis arguments below keep their defaults).
    params : list of NDArray, or mxnet.gluon.nn.HybridSequential
        The initial model (``parallel.models.init_model``): LeNet's eight arrays, or an initialized gluon block
        with known shapes (data parallelism replicates it into flat replicas run by ``GluonNet``, with BatchNorm
        synchronized across the contexts; the other layouts cut it at its children). Copied, not modified.
    ctx_list : list of mxnet.Context
        Distinct contexts, at least one.
    stages : int or Stages, optional
        Where to cut the model: a number of stages, or ``Stages(count, boundaries, micro_batches, schedule,
        virtual)`` (see ``stage_ranges``; default two stages); not for ``"data"``.
    reducer : parallel.Reducer or str, optional
        How every data-parallel sum of gradients is taken (``parallel.comm.Reducer``: algorithm, buckets, hook or
        compression, job; an algorithm's name for ``Reducer(name)``). A reducer with a job trains as one worker of
        a distributed job (a collective call): BatchNorm normalises over every worker's slice of the batch, so a
        job with BatchNorm trains the one-context model (``parallel.comm.statistics``), or over each worker's slice
        alone with ``job.statistics = "worker"``.
    recompute : bool
        Activation recomputation (``parallel.models.recompute``).
    zero : int
        0 to 3: ZeRO's stage (``parallel.optim``; 3: the parameters sharded, ``parallel.strategies.sharded``).
    tensor : int
        Each layer split over groups of ``tensor`` contexts (a model made of parallel layers); 1: none.
    batch_size : int, optional
        When given, more micro-batches than ``batch_size`` are refused up front.
    expert_parallel : int
        A mixture-of-experts model's experts spread over groups of this many replicas (``Hybrid``'s lockstep
        chunks, ``parallel.models.lockstep``).

    Returns
    -------
    parallel.strategies.hybrid.Hybrid
        The composed strategy, for every layout (the data preset's replicas print and train as ``DataParallel``'s
        did: ``describe_replicas``); its ``ctx_list`` holds the contexts it uses (the model and pipeline presets
        leave the rest idle).

    Raises
    ------
    ValueError, TypeError
        For an unknown name, an empty or repeated ``ctx_list``, a layout the mathematics cannot run (its
        reason), or one the contexts cannot hold.
    """
    reducer = as_reducer(reducer)
    layout = (name if isinstance(name, Layout) else
              layout_of(name, stages, reducer, recompute, zero, tensor, expert_parallel))
    layout.check(batch_size=batch_size)
    check_contexts(ctx_list)
    return Hybrid(params, ctx_list, layout, reducer)
