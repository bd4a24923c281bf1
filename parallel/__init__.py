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

Every public name is re-exported here and loaded on first use (``parallel.lazy``), so ``import parallel`` does
not import MXNet until a name that needs it is used, and ``python -m parallel.train --help`` answers without
starting MXNet. The entry points (``parallel.train``, ``parallel.launch``) are not imported here.
"""
from .lazy import lazy_exports

__version__ = "0.1.0"

# Every public name, and the module that defines it.
_SOURCES = {
    "comm.replica": ["get_params", "FlatReplica"],
    "comm.reducer": ["Reducer", "GradBucket", "BucketComm", "allreduce_grads", "compressed_allreduce"],
    "comm.algorithms": ["allreduce", "ALLREDUCE_ALGORITHMS", "bytes_moved", "BytesMoved", "free_buffers",
                       "set_buffer_limit", "buffer_info"],
    "comm": ["DEFAULT_ALGORITHM", "DEFAULT_BUCKET_MB"],
    "split": ["split_and_load", "shard_sizes"],
    "step": ["sgd", "train_batch", "train_step", "update_replicas", "loss_and_correct"],
    "models": ["MODELS"],
    "models.lenet": ["init_lenet_params", "lenet", "lenet_layers", "lenet_cached", "CachedNet",
                     "softmax_cross_entropy", "LENET_SHAPES", "LENET_LAYERS"],
    "models.gluon": ["GluonNet", "set_block_params"],
    "models.resnet": ["resnet18", "init_resnet18"],
    "models.vit": ["vit", "init_vit"],
    "models.moe": ["Experts", "MoEFeedForward"],
    "models.transformer": ["transformer", "init_transformer"],
    "models.layout": ["init_model"],
    "evaluate": ["evaluate_accuracy", "accuracy"],
    "devices": ["try_gpu", "try_all_gpus", "parse_devices"],
    "threads": ["recommended_omp_threads", "engine_settings", "set_omp_threads", "omp_threads"],
    "data": ["DataError", "Dataset", "read_idx", "write_idx", "load_idx_dataset", "load_fashion_mnist",
             "default_data_dir", "synthetic_dataset", "iterate_batches"],
    "fit": ["fit", "TrainingStopped"],
    "report": ["plot_metrics"],
    "strategies": ["make_strategy"],
    "checkpoint": ["TrainingState", "Snapshot", "save_checkpoint", "load_checkpoint", "CheckpointError"],
    "config": ["RunConfig"],
    "layout": ["Layout"],
    "mesh": ["Mesh"],
    "export": ["export_lenet", "export_gluon", "to_gluon", "lenet_symbol"],
    "job": ["join", "Job", "broadcast_params", "allreduce_across"],
    "uneven": ["Join"],
    "flight": ["FlightRecorder"],
    "compress": ["COMPRESSIONS", "parse_compression"],
    "compress.registry": ["make_codec"],
    "compress.codec": ["Codec"],
    "trainer_kvstore": ["AllreduceKVStore"],
    "trace": ["trace", "plot_timeline", "read_trace", "reduction_order"],
}
__all__ = [name for names in _SOURCES.values() for name in names]
__getattr__, __dir__ = lazy_exports(__name__, _SOURCES)
