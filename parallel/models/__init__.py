"""Networks, one per file, and the one registry of the models the CLI trains.

- ``lenet``: the textbook's LeNet written from scratch, a function ``lenet(X, params)`` of plain arrays, and
  ``CachedNet`` (``lenet_cached``) that runs such a function as a cached graph.
- ``resnet``: the textbook's ResNet-18 for 28x28 images, a gluon ``HybridSequential``.
- ``vit``: a small Vision Transformer for 28x28 images (7x7 patches, a class token, pre-norm Transformer blocks),
  a gluon ``HybridSequential``.
- ``transformer``: a small Transformer encoder over a 28x28 image's 28 rows (post-norm blocks, mean pooling), a
  gluon ``HybridSequential`` built of the parallel layers and calling the seams, as the ViT is (with experts too).
- ``plan``: each model's parallelize plan (``PLANS``, ``plan_of``): where sequence parallelism's region lies among
  its children, which no model file says.
- ``layers``: the tensor-parallel layers (``ColumnParallelDense``, ``RowParallelDense``,
  ``ParallelPatchEmbedding``), each its gluon base class in ordinary mode and split over T ranks by ``run_ranks``
  (Megatron-LM's tensor parallelism for any block made of them); ``shard_specs``, ``replicate_ranks``.
- ``moe``: a mixture-of-experts feed-forward layer (``MoEFeedForward``: a router, top-k gating, a capacity,
  the load-balancing and z auxiliary losses) that routes tokens on the host and, on replicas in lockstep, sends
  them to the replicas holding their experts (expert parallelism's all-to-all).
- ``gluon``: any gluon ``HybridBlock`` as a function ``net(X, params)`` of flat replicas (``GluonNet``), with
  BatchNorm synchronized across contexts; ``Chain``, blocks passing tuples.
- ``registry``: what each model does (``LeNetModel``, ``GluonModel``, and the ``BuiltGluonModel`` subclasses
  ``ResNet18Model``, ``ViTModel`` and ``TransformerModel``): its initial model, the layout and checks of its arrays, the function data
  parallelism runs, where model parallelism cuts it, its export; ``behaviour_of`` gives the behaviour of an
  initial model a strategy is handed.
- ``recompute``: activation recomputation, a network trained block by block keeping only each block's input
  (``Recompute`` of a model's ``segments``).
- ``base``: the protocols a model's pieces declare, with their defaults: ``Net`` (a network of replicas: ``ranked``,
  ``forward_all``, ``take_heads``), ``Cuttable`` (a block cut finer: ``parts()``, ``num_inputs``), ``ParallelLayer``
  (a layer split over tensor ranks: ``shard_specs()``), ``ParallelF`` (the ``F`` of a layout) and the seams a model
  calls on its ``F`` (``split_tokens``, ``attention``, ``mark_kept``, ``gather_tokens``: the mathematics itself
  with ``mx.nd`` and ``mx.sym``, the proxy's method on a layout).
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
from ..validate import check_choice


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
    #: Whether its tokens split along the sequence (its embedding cuts them, its head gathers them, its attention
    #: runs round a ring): sequence parallelism (``--sequence-parallel``) and context parallelism (``--context``).
    sequences: bool = False
    #: Whether it normalises with BatchNorm (running statistics besides its parameters): in a job, over every
    #: worker's batch unless ``--batchnorm-stats worker``.
    batchnorm: bool = False
    #: The options of its variants (``model_spec``), each with its type and default.
    options: tuple = ()
    #: A variant's options, as ``model_spec`` gave them (``model_info``); ``()`` for the model itself.
    chosen: tuple = ()

    @property
    def behaviour(self):
        """What the model does (``parallel.models.registry.Model``: ``init``, ``layout``, ``check``, ``net``,
        ``layers``, ``cut``, ``export``), one instance per model and variant; the first use imports MXNet."""
        return _behaviour(self.source, self.title, self.chosen)


@functools.lru_cache(maxsize=None)
def _behaviour(source, title, chosen):
    return getattr(importlib.import_module(f"{__name__}.registry"), source)(title, **dict(chosen))


#: The models ``python -m parallel.train --model`` trains and a checkpoint can hold, by name.
MODELS = {
    "lenet": ModelInfo("LeNet", "0 conv1, 1 conv2, 2 dense1, 3 dense2", "LeNetModel"),
    "resnet18": ModelInfo("ResNet-18", "0 stem (conv, BatchNorm, ReLU), 1-4 its four stages of residual blocks "
                                       "(64, 128, 256, 512 channels), 5 pooling, 6 dense", "ResNet18Model",
                         batchnorm=True),
    "vit": ModelInfo("ViT", "0 patch embedding (7x7 patches, class token, positions), 1-4 its four Transformer "
                            "blocks, 5 head (LayerNorm, dense)", "ViTModel", tensor=4, sequences=True,
                     options=(("experts", int, 0), ("top_k", int, 1), ("capacity_factor", float, 1.0),
                              ("aux_weight", float, 0.01), ("z_weight", float, 0.0), ("gate_scale", float, 1.0),
                              ("patch", int, 7))),
    "transformer": ModelInfo("Transformer", "0 row embedding (the 28 rows as tokens, positions), 1-2 its two "
                                            "post-norm Transformer blocks, 3 head (mean over the rows, dense)",
                             "TransformerModel", tensor=4, sequences=True,
                             options=(("experts", int, 0), ("top_k", int, 1), ("capacity_factor", float, 1.0),
                                      ("aux_weight", float, 0.01), ("z_weight", float, 0.0),
                                      ("gate_scale", float, 1.0))),
}

def model_spec(name, **options):
    """The name of model ``name``'s variant of ``options`` (those that differ from their defaults), as a checkpoint
    and ``model_info`` take it: ``"vit"``, or ``"vit(experts=4,top_k=2)"``.

    >>> model_spec("vit", experts=4, top_k=1), model_spec("vit", experts=0)
    ('vit(experts=4)', 'vit')
    """
    info = MODELS[name]
    known = {option: (kind, default) for option, kind, default in info.options}
    given = []
    for option, value in options.items():
        if option not in known:
            raise ValueError(f"{info.title} has no option {option}; its options are {', '.join(known) or 'none'}")
        kind, default = known[option]
        if kind(value) != default:
            given.append(f"{option}={kind(value)!r}")
    return name if not given else f"{name}({','.join(given)})"


def model_info(spec):
    """The ``ModelInfo`` of ``spec``, a name of ``MODELS`` or a variant of one (``model_spec``): its title says the
    variant (``"ViT (4 experts, top-1)"``), its behaviour builds it.

    >>> model_info("vit(experts=4)").title, model_info("vit(experts=4)").chosen
    ('ViT (4 experts, top-1)', (('experts', 4),))
    """
    name, _, rest = spec.partition("(") if isinstance(spec, str) else (spec, "", "")
    if not rest:
        return MODELS[check_choice(spec, "model", tuple(MODELS))]
    if name not in MODELS or not rest.endswith(")"):
        raise ValueError(f"model must be one of {', '.join(MODELS)} (or a variant such as vit(experts=4)), got "
                         f"{spec!r}")
    info = MODELS[name]
    if not rest:
        return info
    known = {option: kind for option, kind, _ in info.options}
    chosen = []
    for item in rest[:-1].split(","):
        option, _, value = item.partition("=")
        try:
            chosen.append((option, known[option](value)))
        except (KeyError, ValueError):
            raise ValueError(f"model {spec!r}: {item!r} is not an option of {info.title} "
                             f"({', '.join(known) or 'none'})") from None
    if model_spec(name, **dict(chosen)) != spec:
        raise ValueError(f"model {spec!r} is not written as model_spec writes it: {model_spec(name, **dict(chosen))!r}")
    options = dict(chosen)
    title = info.title
    if options.get("experts"):
        scale = f", gates x {options['gate_scale']:g}" if options.get("gate_scale", 1.0) != 1.0 else ""
        title += f" ({options['experts']} experts, top-{options.get('top_k', 1)}{scale})"
    if "patch" in options:
        title += f" ({options['patch']}x{options['patch']} patches)"
    return info._replace(title=title, chosen=tuple(chosen))


_SOURCES = {
    "lenet": ["init_lenet_params", "lenet", "lenet_layers", "lenet_cached", "CachedNet", "softmax_cross_entropy",
              "LENET_SHAPES", "LENET_LAYERS", "LENET_PARAM_NAMES"],
    "gluon": ["GluonNet", "Chain", "as_net", "set_block_params"],
    "moe": ["MoEFeedForward", "route", "moe_layers", "aux_losses"],
    "plan": ["Plan", "PLANS", "plan_of"],
    "resnet": ["Residual", "resnet18", "init_resnet18"],
    "vit": ["PatchEmbedding", "MultiHeadAttention", "TransformerBlock", "ClassifierHead", "vit", "init_vit"],
    "transformer": ["RowEmbedding", "PostNormBlock", "MeanPoolHead", "transformer", "init_transformer"],
    "layers": ["Ranks", "RanksF", "ColumnParallelDense", "RowParallelDense", "ParallelPatchEmbedding", "shard_specs",
               "local_arrays", "joined_arrays", "replicate_ranks", "most_ranks", "run_ranks", "RankedNet", "ReplicasF",
               "run_replicas"],
    "layout": ["init_model", "model_layout", "Layout", "block_names"],
    "registry": ["behaviour_of", "LeNetModel", "GluonModel", "BuiltGluonModel", "ResNet18Model", "ExpertsVariants",
                 "ViTModel", "TransformerModel"],
    "recompute": ["Recompute", "Segment"],
}
__all__ = ["MODELS", "ModelInfo", "model_spec", "model_info"] + [name for names in _SOURCES.values() for name in names]
__getattr__, __dir__ = lazy_exports(__name__, _SOURCES)
