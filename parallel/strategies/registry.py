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
from ..config import check_compression, check_distributed, check_layout, check_recompute, check_zero
from . import DEFAULT_MICRO_BATCHES
from .data import DataParallel
from .hybrid import Hybrid
from .model import ModelParallel
from .pipeline import Pipeline
from .sharded import FullyShardedDataParallel

__all__ = ["make_strategy"]


def make_strategy(name, params, ctx_list, stages=None, boundaries=None, micro_batches=None, batch_size=None,
                  reducer=None, recompute=False, zero=0):
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
    stages, boundaries
        Where to cut the model (see ``stage_ranges``; default two stages); not for ``"data"``.
    micro_batches : int, optional
        Pipeline only (default ``DEFAULT_MICRO_BATCHES``). A batch with fewer examples than micro-batches (the
        short last batch of an epoch) is trained in one micro-batch per example.
    batch_size : int, optional
        When given, more micro-batches than ``batch_size`` are refused up front.
    reducer : parallel.Reducer or str, optional
        How ``"data"`` and ``"hybrid"`` sum the gradients (``parallel.comm.Reducer``: algorithm, buckets,
        compression, job; an algorithm's name for ``Reducer(name)``). A reducer with a job (``"data"`` only)
        trains as one worker of a distributed job (see ``DataParallel``; a collective call): BatchNorm normalises
        over the worker's slice, synchronized across its contexts but not across the workers, so a job with
        BatchNorm is not the same computation as one context. Compression: ``"data"`` only.

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
    reducer = as_reducer(reducer)
    check_layout(name, stages, boundaries, micro_batches, batch_size)
    check_distributed(name, reducer.job is not None)
    check_compression("none" if reducer.codec is None else reducer.codec.spec, strategy=name)
    check_recompute(recompute, name)
    check_zero(zero, name, reducer.algorithm)
    check_contexts(ctx_list)
    if zero == 3:
        return FullyShardedDataParallel(params, ctx_list, reducer)
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
                        DEFAULT_MICRO_BATCHES if micro_batches is None else micro_batches, short_batches=True)
    return Hybrid(params, ctx_list, stages, boundaries, reducer)
