"""Networks, one per file, and the one registry of the models the CLI trains.

- ``lenet``: the textbook's LeNet written from scratch, a function ``lenet(X, params)`` of plain arrays, and
  ``CachedNet`` (``lenet_cached``) that runs such a function as a cached graph.
- ``resnet``: the textbook's ResNet-18 for 28x28 images, a gluon ``HybridSequential``.
- ``vit``: a small Vision Transformer for 28x28 images (7x7 patches, a class token, pre-norm Transformer blocks),
  a gluon ``HybridSequential``.
- ``transformer``: a small Transformer encoder over a 28x28 image's 28 rows (post-norm blocks, mean pooling), a
  gluon ``HybridSequential`` built of the parallel layers, as the ViT is.
- ``layers``: the tensor-parallel layers (``ColumnParallelDense``, ``RowParallelDense``,
  ``ParallelPatchEmbedding``), each its gluon base class in ordinary mode and split over T ranks by ``run_ranks``
  (Megatron-LM's tensor parallelism for any block made of them); ``shard_specs``, ``replicate_ranks``.
- ``gluon``: any gluon ``HybridBlock`` as a function ``net(X, params)`` of flat replicas (``GluonNet``), with
  BatchNorm synchronized across contexts; ``Chain``, blocks passing tuples.
- ``registry``: what each model does (``LeNetModel``, ``GluonModel``, and the ``BuiltGluonModel`` subclasses
  ``ResNet18Model``, ``ViTModel`` and ``TransformerModel``): its initial model, the layout and checks of its arrays, the function data
  parallelism runs, where model parallelism cuts it, its export; ``behaviour_of`` gives the behaviour of an
  initial model a strategy is handed.
- ``recompute``: activation recomputation, a network trained block by block keeping only each block's input
  (``Recompute`` of a model's ``segments``).
- ``layout``: what each model of ``MODELS`` is made of: its initial arrays (``init_model``) and the names and
  shapes a checkpoint stores (``model_layout``).

``MODELS`` needs no MXNet, so the CLI offers its names before MXNet starts; each entry's ``behaviour`` (a
class of ``registry``, imported on first use) is the one place that knows the model:

>>> list(MODELS), MODELS["resnet18"].title
(['lenet', 'resnet18', 'vit', 'transformer'], 'ResNet-18')
>>> MODELS["resnet18"].behaviour.layout().names[:2]
('0.0.weight', '0.0.bias')
"""
import functools
import importlib
from typing import NamedTuple

from ..lazy import lazy_exports


class ModelInfo(NamedTuple):
    """A model of the registry: how messages name it, what the CLI says of its layers, and its behaviour."""
    #: How the epoch lines, plots and messages name it.
    title: str
    #: Its layers (children), as ``--boundaries`` numbers them.
    layers: str
    #: The class of ``parallel.models.registry`` that holds its behaviour.
    source: str
    #: The most ranks tensor parallelism splits it over (its attention heads: ``--tensor``); 0: it is not split.
    tensor: int = 0

    @property
    def behaviour(self):
        """What the model does (``parallel.models.registry.Model``: ``init``, ``layout``, ``check``, ``net``,
        ``layers``, ``cut``, ``export``), one instance per model; the first use imports MXNet."""
        return _behaviour(self.source, self.title)


@functools.lru_cache(maxsize=None)
def _behaviour(source, title):
    return getattr(importlib.import_module(f"{__name__}.registry"), source)(title)


#: The models ``python -m parallel.train --model`` trains and a checkpoint can hold, by name.
MODELS = {
    "lenet": ModelInfo("LeNet", "0 conv1, 1 conv2, 2 dense1, 3 dense2", "LeNetModel"),
    "resnet18": ModelInfo("ResNet-18", "0 stem (conv, BatchNorm, ReLU), 1-4 its four stages of residual blocks "
                                       "(64, 128, 256, 512 channels), 5 pooling, 6 dense", "ResNet18Model"),
    "vit": ModelInfo("ViT", "0 patch embedding (7x7 patches, class token, positions), 1-4 its four Transformer "
                            "blocks, 5 head (LayerNorm, dense)", "ViTModel", tensor=4),
    "transformer": ModelInfo("Transformer", "0 row embedding (the 28 rows as tokens, positions), 1-2 its two "
                                            "post-norm Transformer blocks, 3 head (mean over the rows, dense)",
                             "TransformerModel", tensor=4),
}

_SOURCES = {
    "lenet": ["init_lenet_params", "lenet", "lenet_layers", "lenet_cached", "CachedNet", "softmax_cross_entropy",
              "LENET_SHAPES", "LENET_LAYERS", "LENET_PARAM_NAMES"],
    "gluon": ["GluonNet", "Chain", "as_net", "set_block_params"],
    "resnet": ["Residual", "resnet18", "init_resnet18"],
    "vit": ["PatchEmbedding", "MultiHeadAttention", "TransformerBlock", "ClassifierHead", "vit", "init_vit"],
    "transformer": ["RowEmbedding", "PostNormBlock", "MeanPoolHead", "transformer", "init_transformer"],
    "layers": ["Ranks", "RanksF", "ColumnParallelDense", "RowParallelDense", "ParallelPatchEmbedding", "shard_specs",
               "local_arrays", "joined_arrays", "replicate_ranks", "most_ranks", "run_ranks"],
    "layout": ["init_model", "model_layout", "Layout", "block_names"],
    "registry": ["behaviour_of", "LeNetModel", "GluonModel", "BuiltGluonModel", "ResNet18Model", "ViTModel",
                 "TransformerModel"],
    "recompute": ["Recompute", "Segment"],
}
__all__ = ["MODELS", "ModelInfo"] + [name for names in _SOURCES.values() for name in names]
__getattr__, __dir__ = lazy_exports(__name__, _SOURCES)
