"""Where a model is cut into stages: ``stage_ranges`` (the layers of each stage) and ``cut_model`` (the stages),
and ``forward_stages`` (a batch through stages on their contexts).

A *stage* is a run of consecutive layers: of ``parallel.models.LENET_LAYERS`` (conv1, conv2, dense1, dense2)
for LeNet's parameter list, or of the children of a gluon ``HybridSequential`` (``init_resnet18()`` has seven:
stem, four stages of residual blocks, pooling, classifier; ``init_vit()`` six: patch embedding, four Transformer
blocks, head). Stage boundaries are layer (child) indices: ``boundaries=[2]`` makes the stages [0, 2) and [2, 4)
(LeNet's convolutional part, then its dense part); ``stages=N`` splits the layers as evenly as possible:

>>> stage_ranges(boundaries=[2]), stage_ranges(stages=3)
([(0, 2), (2, 4)], [(0, 2), (2, 3), (3, 4)])

The model strategy (``parallel.strategies.ModelParallel``: one replica, one stage a context, the whole batch
through each) and the pipeline strategy (``Pipeline``: micro-batches) are presets of the composed strategy
(``parallel.strategies.hybrid``), which runs the stages ``cut_model`` makes.
"""
from ..models.lenet import LENET_LAYERS, LenetStage
from ..models.registry import behaviour_of
from ..split import shard_sizes
from ..validate import BadValue, check_int
from . import DEFAULT_STAGES

__all__ = ["stage_ranges", "forward_stages", "cut_model"]


def stage_ranges(stages=None, boundaries=None, num_layers=len(LENET_LAYERS), what=None, unit="layer"):
    """The layer range ``(start, stop)`` of each stage.

    Parameters
    ----------
    stages : int, optional
        Number of stages, 1 .. ``num_layers``; the layers are split as evenly as possible, earlier stages
        taking the extra layer (``shard_sizes``). Defaults to ``DEFAULT_STAGES`` when ``boundaries`` is None.
    boundaries : sequence of int, optional
        Layer indices where a new stage starts, strictly increasing, each in 1 .. ``num_layers - 1``:
        boundary ``b`` cuts between layer ``b - 1`` and layer ``b``. ``[]`` is one stage.
        Give ``stages`` or ``boundaries``, not both.
    num_layers : int
        Layers in the model (LeNet's four by default; a ``HybridSequential``'s ``len(block)`` children).
    what, unit : str
        How error messages name the model's layers (default "LeNet's 4 layers") and one of them ("layer").

    Returns
    -------
    list of (int, int)
        ``[(0, b1), (b1, b2), ..., (bn, num_layers)]``: consecutive, non-empty, covering every layer.

    Raises
    ------
    ValueError, TypeError
        For more stages than layers, a boundary outside the model, unsorted or repeated boundaries.
    """
    what = f"LeNet's {num_layers} layers" if what is None else what
    if stages is not None and boundaries is not None:
        raise BadValue("stages", "{stages} and {boundaries} both say where to cut; give one of them")
    if boundaries is None:
        stages = check_int(DEFAULT_STAGES if stages is None else stages, "stages")
        if not 1 <= stages <= num_layers:
            raise BadValue("stages", f"{{stages={stages}|{stages} stages}} cannot split {what}; use 1 to {num_layers} "
                                     "stages")
        cuts, start = [], 0
        for size in shard_sizes(num_layers, stages)[:-1]:
            start += size
            cuts.append(start)
    else:
        cuts = list(boundaries)
        for i, b in enumerate(cuts):
            check_int(b, f"boundaries[{i}]")
            if not 1 <= b < num_layers:
                raise BadValue("boundaries", f"{{boundaries|stage boundary}} {b} is outside {what}; a boundary b cuts "
                                             f"before {unit} b, so use values in 1..{num_layers - 1}")
        if any(a >= b for a, b in zip(cuts, cuts[1:])):
            raise BadValue("boundaries", f"{{boundaries}} {cuts} must be strictly increasing without repeats, "
                                         f"e.g. {sorted(set(cuts))}")
    edges = [0] + [int(b) for b in cuts] + [num_layers]
    return list(zip(edges[:-1], edges[1:]))


def cut_model(model, stages=None, boundaries=None):
    """``model`` cut into stages (a ``parallel.models.registry.Cut``), not yet placed: where its behaviour cuts
    it (``behaviour_of(model).layers``), at ``stage_ranges``."""
    behaviour = behaviour_of(model)
    return behaviour.cut(model, stage_ranges(stages, boundaries, *behaviour.layers(model)))


def forward_stages(X, stage_params, ranges, nets=None):
    """Run ``X`` through the stages; each stage runs on the context of its parameters.

    Parameters
    ----------
    X : NDArray
        Inputs on any context (LeNet's images are (batch, 1, 28, 28)); copied to the first stage's context.
    stage_params : list of list of NDArray
        ``stage_params[s]`` holds the parameters of stage ``s`` (``ranges[s]``), all on one context.
    ranges : list of (int, int)
        From ``stage_ranges``.
    nets : list of callable, optional
        ``nets[s](X, params)`` runs stage ``s`` (``ModelParallel.nets``); default: LeNet's layers ``ranges[s]``.

    Returns
    -------
    NDArray
        Outputs (LeNet's logits (batch, 10)) on the last stage's context. Inside ``autograd.record()`` the
        copies between contexts are recorded, so ``backward`` sends each stage's input gradient back to the
        previous stage's context. Nothing waits for the devices.
    """
    nets = [LenetStage(start, stop) for start, stop in ranges] if nets is None else nets
    for net, params in zip(nets, stage_params):
        X = net(X.as_in_context(params[0].context), params)
    return X
