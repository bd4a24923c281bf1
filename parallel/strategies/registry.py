"""A strategy of ``STRATEGIES`` by name: what the training loop and ``python -m parallel.train --strategy`` use.

>>> import mxnet as mx
>>> from parallel import init_lenet_params
>>> strategy = make_strategy("hybrid", init_lenet_params(seed=0), [mx.cpu(i) for i in range(4)])
>>> strategy.name, strategy.describe()
('hybrid', '2 replicas x 2 stages: conv1,conv2 @ cpu(0),cpu(2) | dense1,dense2 @ cpu(1),cpu(3)')
"""
from ..comm.reducer import as_reducer
from ..models.recompute import Recompute
from ..models.registry import behaviour_of
from ..validate import check_contexts
from ..config import (check_compression, check_distributed, check_layout, check_recompute, check_schedule,
                      check_tensor, check_zero)
from ..validate import BadType
from . import DEFAULT_MICRO_BATCHES, Stages
from .data import DataParallel
from .hybrid import Hybrid
from .model import ModelParallel
from .pipeline import Pipeline
from .sharded import FullyShardedDataParallel
from .tensor import TensorParallel

__all__ = ["make_strategy"]


def _as_stages(stages):
    if stages is None or isinstance(stages, Stages):
        return stages or Stages()
    if isinstance(stages, int) and not isinstance(stages, bool):
        return Stages(count=stages)
    raise BadType("stages", f"{{stages}} must be a number of stages or a Stages(count, boundaries, micro_batches), "
                            f"got {type(stages).__name__}")


def make_strategy(name, params, ctx_list, stages=None, reducer=None, recompute=False, zero=0, tensor=1,
                  batch_size=None):
    """Lay ``model`` out on ``ctx_list`` for the parallel style ``name``.

    Parameters
    ----------
    name : str
        One of ``STRATEGIES``: ``"data"`` (``DataParallel``: one replica per context), ``"model"``
        (``ModelParallel``), ``"pipeline"`` (``Pipeline``) or ``"hybrid"`` (``Hybrid``).
    params : list of NDArray, or mxnet.gluon.nn.HybridSequential
        The initial model (``parallel.models.init_model``): LeNet's eight arrays, or an initialized gluon block
        with known shapes (ResNet-18: data parallelism replicates it into flat replicas run by ``GluonNet``,
        with BatchNorm synchronized across the contexts; the other strategies cut it at its children). Copied,
        not modified.
    ctx_list : list of mxnet.Context
        Distinct contexts, at least one.
    stages : int or Stages, optional
        Where to cut the model: a number of stages, or ``Stages(count, boundaries, micro_batches, schedule,
        virtual)`` (see ``stage_ranges``; default two stages); not for ``"data"``. ``micro_batches``, ``schedule``
        and ``virtual``: pipeline only (default ``DEFAULT_MICRO_BATCHES``, GPipe, none; ``Pipeline``); a batch with
        fewer examples than micro-batches (the short last batch of an epoch) is trained in one micro-batch per
        example.
    reducer : parallel.Reducer or str, optional
        How ``"data"`` and ``"hybrid"`` sum the gradients (``parallel.comm.Reducer``: algorithm, buckets,
        compression, job; an algorithm's name for ``Reducer(name)``). A reducer with a job (``"data"`` only)
        trains as one worker of a distributed job (see ``DataParallel``; a collective call): BatchNorm normalises
        over the worker's slice, synchronized across its contexts but not across the workers, so a job with
        BatchNorm is not the same computation as one context. Compression: ``"data"`` only.
    recompute : bool
        ``"data"``: activation recomputation (``parallel.models.Recompute``).
    zero : int
        0 to 3: ZeRO's stage (``parallel.optim``; 3: ``FullyShardedDataParallel``).
    tensor : int
        ``"data"`` with the ViT: each layer split over groups of ``tensor`` contexts (``TensorParallel``), data
        parallelism over the groups; 1 (the default): none.
    batch_size : int, optional
        When given, more micro-batches than ``batch_size`` are refused up front.

    Returns
    -------
    object
        The strategy (see ``parallel.strategies``); its ``ctx_list`` holds the contexts it uses: model and
        pipeline parallelism use one per stage and leave the rest of ``ctx_list`` idle.

    Raises
    ------
    ValueError, TypeError
        For an unknown name, an empty or repeated ``ctx_list``, an option the strategy does not take, or a
        layout the contexts cannot hold.
    """
    reducer, layout = as_reducer(reducer), _as_stages(stages)
    stages, boundaries, micro_batches, schedule, virtual = layout
    check_layout(name, stages, boundaries, micro_batches, batch_size)
    check_schedule(name, schedule, virtual, stages, micro_batches, boundaries)
    check_distributed(name, reducer.job is not None, tensor)
    compression = "none" if reducer.codec is None else reducer.codec.spec
    check_compression(compression, strategy=name)
    check_recompute(recompute, name)
    check_zero(zero, name, reducer.algorithm)
    check_tensor(tensor, name, zero=zero, recompute=recompute, compression=compression)
    check_contexts(ctx_list)
    if zero == 3:
        return FullyShardedDataParallel(params, ctx_list, reducer)
    if tensor > 1:
        return TensorParallel(params, ctx_list, tensor, reducer, layout if name == "hybrid" else None)
    if name == "data":
        behaviour = behaviour_of(params)
        net = behaviour.net(params)
        if recompute:
            net = Recompute(net, behaviour.segments(params))
        return DataParallel(net, ctx_list, params=params, reducer=reducer)
    if name == "model":
        return ModelParallel(params, ctx_list, stages, boundaries)
    if name == "pipeline":
        return Pipeline(params, ctx_list, stages, boundaries,
                        DEFAULT_MICRO_BATCHES if micro_batches is None else micro_batches, short_batches=True,
                        schedule=schedule, virtual=virtual)
    return Hybrid(params, ctx_list, stages, boundaries, reducer)
