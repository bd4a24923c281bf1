"""parallel: data-parallel training from scratch on Apache MXNet.

The textbook calling pattern, on two CPU contexts (``[mx.gpu(0), mx.gpu(1)]`` on GPUs):

>>> import mxnet as mx
>>> from parallel import get_params, init_lenet_params, train_batch, parse_devices
>>> ctx_list = parse_devices("cpu:2")
>>> device_params = [get_params(init_lenet_params(seed=0), ctx) for ctx in ctx_list]
>>> X, y = mx.nd.ones((8, 1, 28, 28)), mx.nd.array([0, 1, 2, 3, 4, 5, 6, 7])
>>> loss = train_batch(X, y, device_params, ctx_list, lr=0.2)   # queued; reading it waits
>>> round(loss.asscalar() / len(y), 2)                           # mean loss: ln(10) at the start
2.3

The names are loaded on first use (``parallel.settings`` needs no MXNet, the rest imports it), so
``python -m parallel.train --help`` answers without starting MXNet. The CLI lives in ``parallel.train``
and is not imported here.
"""
import importlib

__version__ = "0.1.0"

# Every public name, and the module that defines it.
_SOURCES = {
    "comm": ["get_params", "FlatReplica", "allreduce", "ALLREDUCE_ALGORITHMS", "DEFAULT_ALGORITHM",
             "bytes_moved", "BytesMoved", "free_buffers", "set_buffer_limit", "buffer_info"],
    "split": ["split_and_load", "shard_sizes"],
    "step": ["sgd", "train_batch", "train_step", "allreduce_grads", "update_replicas", "loss_and_correct"],
    "models": ["init_lenet_params", "lenet", "lenet_layers", "lenet_cached", "CachedNet", "softmax_cross_entropy",
              "LENET_SHAPES", "LENET_LAYERS", "GluonNet", "set_block_params",
               "resnet18", "init_resnet18"],
    "evaluate": ["evaluate_accuracy", "accuracy"],
    "devices": ["try_gpu", "try_all_gpus", "parse_devices"],
    "settings": ["recommended_omp_threads", "set_omp_threads", "omp_threads"],
    "data": ["DataError", "Dataset", "read_idx", "write_idx", "load_idx_dataset", "load_fashion_mnist",
             "default_data_dir", "synthetic_dataset", "iterate_batches"],
    "training": ["fit", "plot_metrics", "TrainingStopped"],
    "checkpoint": ["TrainingState", "save_checkpoint", "load_checkpoint", "CheckpointError"],
    "export": ["export_lenet", "export_gluon", "to_gluon", "lenet_symbol"],
    "kvstore": ["join", "Job", "broadcast_params", "allreduce_across"],
}
_MODULE_OF = {name: module for module, names in _SOURCES.items() for name in names}

__all__ = [name for names in _SOURCES.values() for name in names]


def __getattr__(name):
    """Import the module that defines ``name`` on first use (PEP 562)."""
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
