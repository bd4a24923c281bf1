"""parallel: data-parallel training from scratch on Apache MXNet.

The textbook calling pattern::

    from parallel import get_params, init_lenet_params, train_batch, parse_devices
    ctx_list = parse_devices("cpu:2")
    device_params = [get_params(init_lenet_params(seed=0), ctx) for ctx in ctx_list]
    for X, y in train_iter:
        train_batch(X, y, device_params, ctx_list, lr=0.2)

The CLI lives in ``parallel.train`` (``python -m parallel.train``) and is not imported here.
"""
from .comm import ALLREDUCE_ALGORITHMS, DEFAULT_ALGORITHM, BytesMoved, FlatReplica, allreduce, bytes_moved, get_params
from .data import (DataError, Dataset, default_data_dir, iterate_batches, load_fashion_mnist,
                   load_idx_dataset, read_idx, synthetic_dataset, write_idx)
from .devices import recommended_omp_threads, parse_devices, try_all_gpus, try_gpu
from .evaluate import evaluate_accuracy
from .model import (LENET_LAYERS, LENET_SHAPES, CachedNet, init_lenet_params, lenet, lenet_cached, lenet_layers,
                    softmax_cross_entropy)
from .split import shard_sizes, split_and_load
from .step import allreduce_grads, loss_and_correct, sgd, train_batch, train_step, update_replicas

__version__ = "0.1.0"

__all__ = [
    "get_params", "FlatReplica", "allreduce", "ALLREDUCE_ALGORITHMS", "DEFAULT_ALGORITHM", "bytes_moved",
    "BytesMoved",
    "split_and_load", "shard_sizes",
    "sgd", "train_batch", "train_step", "allreduce_grads", "update_replicas", "loss_and_correct",
    "init_lenet_params", "lenet", "lenet_layers", "lenet_cached", "CachedNet", "softmax_cross_entropy",
    "LENET_SHAPES", "LENET_LAYERS",
    "evaluate_accuracy",
    "try_gpu", "try_all_gpus", "parse_devices", "recommended_omp_threads",
    "DataError", "Dataset", "read_idx", "write_idx", "load_idx_dataset", "load_fashion_mnist",
    "default_data_dir", "synthetic_dataset", "iterate_batches",
]
