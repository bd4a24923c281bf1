"""The other parallel styles, written from scratch on MXNet contexts; one file per concept.

- ``data_parallel``: ``DataParallel``, a PyTorch-style wrapper (scatter, replicate, parallel apply,
  gather) for a gluon Block or a function of (inputs, params), and its functional twin ``data_parallel``.
- ``model_parallel``: ``ModelParallel``, LeNet or a gluon ``HybridSequential`` cut into stages on different
  contexts.
- ``pipeline``: ``Pipeline``, micro-batches through the stages (GPipe's schedule).
- ``hybrid``: ``Hybrid``, data parallelism over groups of model-parallel stages.

Each ``train_step(X, y, lr)`` is the same SGD step as ``parallel.train_batch`` on one context (except a
pipeline of a network with BatchNorm, which normalises each micro-batch on its own).
"""
from ..step import allreduce_grads, update_replicas   # the DataParallel step's halves, shared with train_batch
from .data_parallel import DataParallel, data_parallel, gather, parallel_apply, replicate
from .hybrid import Hybrid, hybrid_groups
from .model_parallel import ModelParallel, forward_stages, stage_ranges
from .pipeline import DEFAULT_MICRO_BATCHES, Pipeline, bubble_fraction

__all__ = [
    "DataParallel", "data_parallel", "replicate", "parallel_apply", "gather", "allreduce_grads", "update_replicas",
    "ModelParallel", "stage_ranges", "forward_stages",
    "Pipeline", "bubble_fraction", "DEFAULT_MICRO_BATCHES",
    "Hybrid", "hybrid_groups",
]
