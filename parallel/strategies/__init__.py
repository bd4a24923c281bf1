"""Every parallel layout, driven by the one step of ``parallel.step``, and the registry of them.

- ``base``: ``Strategy``, the protocol every strategy keeps (its members and defaults), and ``ArrayPlace``: where
  each of a model's arrays lies, from which its arrays are read whole and written back, whatever the layout.
- ``data``: ``DataParallel``, a PyTorch-style wrapper (scatter, replicate, parallel apply, gather) for a function of
  (inputs, params) or a gluon Block the package does not lay out itself, taking the one step and the one update,
  and its functional twin ``data_parallel``; ``describe_replicas``, the line of data replicas alone.
- ``hybrid``: ``Hybrid``, the composed strategy of every layout ``make_strategy`` builds, the data preset
  included: data x experts x context x pipeline stages x tensor ranks (a
  ``parallel.mesh.Mesh``), with ZeRO and recomputation, every axis a plug-in of the same step; its presets
  ``ModelParallel`` (one replica of stages), ``Pipeline`` (fed micro-batches) and ``FullyShardedDataParallel``
  (ZeRO-3); its chunks run the replicas in lockstep (``parallel.models.lockstep``) for a mixture of experts
  (its experts spread over expert-parallel groups, tokens sent to them by an all-to-all) or context parallelism
  (each example's tokens split over a group, attention by ring attention).
- ``pipeline``: a schedule's order issued over a model's chunks (``issue``), micro-batches, ``bubble_fraction``.
- ``schedules``: GPipe, 1F1B, interleaved 1F1B laid out on slots (``PIPELINE_SCHEDULES`` names them without
  MXNet).
- ``sharded``: ZeRO-3 as hooks around a network's blocks (``ShardedGroup``: a group's arrays sharded over the
  replicas, gathered a block at a time, reduce-scattered through the Reducer).
- ``model``: where a model is cut into stages (``stage_ranges``).
- ``registry``: ``make_strategy(name, model, ctx_list, ...)``, a strategy of a ``parallel.Layout``.

A strategy is a ``Strategy`` (``base``): ``name``, ``layout``, ``ctx_list`` (the contexts it uses), ``reducer``,
``job`` (None in one process), ``train_step(X, y, lr=None, optimizer=None, accumulate=1)`` -> (summed loss, correct
count), ``evaluate(data_iter)`` -> accuracy, ``params()`` and ``aux()`` (the model's trained arrays and the others,
whole, in the model's order: what a checkpoint stores), ``groups()`` (the replicas of each parameter, as
``parallel.optim.optimizer_step`` takes them: where an optimizer's state lives), ``describe()`` and ``model``
(what ``fit`` returns: the replicas for data parallelism, else the strategy). Each ``train_step`` is the same step
as ``parallel.train_batch`` on one context (but a network with BatchNorm fed micro-batches, which normalises each
on its own), with plain SGD at ``lr`` or any ``parallel.optim`` optimizer.

The names need no MXNet, so the CLI offers them before MXNet starts (which options each takes:
``parallel.config.check_layout``):

>>> list(STRATEGIES), DEFAULT_STAGES, DEFAULT_MICRO_BATCHES
(['data', 'model', 'pipeline', 'hybrid'], 2, 4)
"""
from typing import NamedTuple, Optional

from ..lazy import lazy_exports

#: The parallel styles, by name, with what the CLI's help says of each.
STRATEGIES = {
    "data": "a replica per device",
    "model": "the model cut into stages, one per device",
    "pipeline": "micro-batches through the stages",
    "hybrid": "data parallelism over groups of stages",
}

#: Stages of the model, pipeline and hybrid strategies when neither stages nor boundaries are given.
DEFAULT_STAGES = 2

#: Micro-batches per batch of the pipeline strategy when not given.
DEFAULT_MICRO_BATCHES = 4

#: The orders a pipeline issues its work in (``parallel.strategies.schedules``), with what the CLI's help says.
PIPELINE_SCHEDULES = {
    "gpipe": "every micro-batch's forward, then every backward (GPipe)",
    "1f1b": "one forward, one backward: each backward as soon as it can (PipeDream-Flush); interleaved with "
            "--virtual-stages",
}


class Stages(NamedTuple):
    """Where the model, pipeline and hybrid strategies cut the model, and how a pipeline feeds it: ``make_strategy``'s
    ``stages`` (an int there is ``Stages(count=...)``).

    >>> Stages(count=2), Stages(boundaries=(2,), micro_batches=8, schedule="1f1b").schedule
    (Stages(count=2, boundaries=None, micro_batches=None, schedule='gpipe', virtual=1), '1f1b')
    """
    #: Stages of layers as even as possible (``stage_ranges``), or None.
    count: Optional[int] = None
    #: The layer indices where stages start, instead of ``count``.
    boundaries: Optional[tuple] = None
    #: Micro-batches a pipeline cuts each batch into (default ``DEFAULT_MICRO_BATCHES``).
    micro_batches: Optional[int] = None
    #: The order a pipeline issues its work in: ``"gpipe"`` or ``"1f1b"`` (``parallel.strategies.schedules``).
    schedule: str = "gpipe"
    #: Model chunks a pipeline device holds: more than 1 interleaves 1F1B.
    virtual: int = 1


_SOURCES = {
    "base": ["Strategy", "ArrayPlace"],
    "data": ["DataParallel", "data_parallel", "replicate", "parallel_apply", "gather"],
    "hybrid": ["Hybrid", "Chunk", "ModelParallel", "Pipeline", "FullyShardedDataParallel"],
    "model": ["stage_ranges"],
    "pipeline": ["bubble_fraction", "issue", "micro_batches"],
    "schedules": ["pipeline_schedule", "Schedule", "Op"],
    "sharded": ["ShardedGroup", "ShardedHooks", "Keys"],
    "registry": ["make_strategy", "layout_of"],
}
__all__ = ["STRATEGIES", "DEFAULT_STAGES", "DEFAULT_MICRO_BATCHES", "PIPELINE_SCHEDULES", "Stages"] + [
    name for names in _SOURCES.values() for name in names]
__getattr__, __dir__ = lazy_exports(__name__, _SOURCES)
