"""Every parallel style, one file each, all taking the one step of ``parallel.step``, and the registry of them.

- ``data``: ``DataParallel``, one replica per context (the textbook's data parallelism, and a PyTorch-style
  wrapper: scatter, replicate, parallel apply, gather) for a function of (inputs, params) or a gluon Block,
  and its functional twin ``data_parallel``.
- ``model``: ``ModelParallel``, LeNet or a gluon ``HybridSequential`` cut into stages on different contexts.
- ``pipeline``: ``Pipeline``, micro-batches through the stages (GPipe's schedule).
- ``hybrid``: ``Hybrid``, data parallelism over groups of model-parallel stages.
- ``registry``: ``make_strategy(name, model, ctx_list, ...)``, a strategy of ``STRATEGIES`` by name.

A strategy is an object with ``name``, ``ctx_list`` (the contexts it uses), ``job`` (None in one process),
``train_step(X, y, lr=None, optimizer=None, accumulate=1)`` -> (summed loss, correct count),
``evaluate(data_iter)`` -> accuracy, ``params()`` and ``aux()`` (the model's trained arrays and the others, live,
in the model's order: what a checkpoint stores), ``groups()`` (the replicas of each parameter, as
``parallel.optim.optimizer_step`` takes them: where an optimizer's state lives), ``describe()`` and ``model``
(what ``fit`` returns: the replicas for data parallelism, else the strategy). Each ``train_step`` is the same step
as ``parallel.train_batch`` on one context (except a pipeline of a network with BatchNorm, which normalises each
micro-batch on its own), with plain SGD at ``lr`` or any ``parallel.optim`` optimizer.

The names need no MXNet, so the CLI offers them before MXNet starts:

>>> list(STRATEGIES), DEFAULT_STAGES, DEFAULT_MICRO_BATCHES
(['data', 'model', 'pipeline', 'hybrid'], 2, 4)
"""
from ..comm import SHARDED_ALGORITHMS
from ..lazy import lazy_exports
from ..validate import check_choice, check_int

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


def check_options(name, stages=None, boundaries=None, micro_batches=None, batch_size=None, distributed=False, zero=0,
                  algorithm=None):
    """Raise ``ValueError`` (``TypeError`` for a wrong type) for options the strategy ``name`` does not take.

    ``distributed``: the strategy is to train one worker's share of a distributed job, which only data
    parallelism does. ``zero``: the optimizer's sharding (``parallel.optim``), which only data and hybrid
    parallelism can use (they replicate the model); with ``zero=2`` the ``algorithm`` must split into a
    reduce-scatter and an all-gather. Needs no MXNet: the CLI checks its flags with it before MXNet starts.

    >>> check_options("data", stages=2)   # doctest: +ELLIPSIS
    Traceback (most recent call last):
        ...
    ValueError: stages apply to the model, pipeline and hybrid strategies, not to data; ...
    """
    check_choice(name, "strategy", tuple(STRATEGIES))
    for given, value in (("stages", stages), ("boundaries", boundaries)):
        if value is not None and name == "data":
            raise ValueError(f"{given} apply to the model, pipeline and hybrid strategies, not to data; drop them "
                             "or choose another strategy")
    if stages is not None and boundaries is not None:
        raise ValueError(f"stages and boundaries both say where to cut (stages={stages!r}, "
                         f"boundaries={list(boundaries)!r}); give one of them")
    if distributed and name != "data":
        raise ValueError(f"strategy {name} cannot train across processes, only data can; run the {name} strategy "
                         "in one process")
    if zero and name in ("model", "pipeline"):
        raise ValueError(f"zero={zero} shards replicated optimizer state, but the {name} strategy holds one copy of "
                         "each stage, with its state, on its own context; use zero 0 or the data or hybrid strategy")
    if zero == 2 and algorithm is not None and algorithm not in SHARDED_ALGORITHMS:
        raise ValueError(f"zero=2 reduce-scatters the gradients, which the {algorithm} allreduce cannot; use "
                         f"algorithm {' or '.join(SHARDED_ALGORITHMS)}")
    if micro_batches is not None:
        if name != "pipeline":
            raise ValueError(f"micro_batches apply to the pipeline strategy only, not to {name}; drop them or "
                             "choose the pipeline strategy")
        check_int(micro_batches, "micro_batches", low=1)
    if name == "pipeline" and batch_size is not None:
        m = DEFAULT_MICRO_BATCHES if micro_batches is None else micro_batches
        if m > check_int(batch_size, "batch_size", low=1):
            raise ValueError(f"micro_batches={m} cannot split batches of {batch_size} examples; use at most "
                             f"{batch_size} micro-batches or a larger batch size")


_SOURCES = {
    "data": ["DataParallel", "data_parallel", "replicate", "parallel_apply", "gather"],
    "model": ["ModelParallel", "stage_ranges", "forward_stages"],
    "pipeline": ["Pipeline", "bubble_fraction"],
    "hybrid": ["Hybrid", "hybrid_groups"],
    "registry": ["make_strategy"],
}
__all__ = ["STRATEGIES", "DEFAULT_STAGES", "DEFAULT_MICRO_BATCHES", "check_options"] + [
    name for names in _SOURCES.values() for name in names]
__getattr__, __dir__ = lazy_exports(__name__, _SOURCES)
