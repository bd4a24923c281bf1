"""Where a model is cut into stages: ``stage_ranges``, the layers of each stage.

A *stage* is a run of consecutive layers: of ``parallel.models.LENET_LAYERS`` (conv1, conv2, dense1, dense2)
for LeNet's parameter list, or of the children of a gluon ``HybridSequential`` (``init_resnet18()`` has seven:
stem, four stages of residual blocks, pooling, classifier; ``init_vit()`` six: patch embedding, four Transformer
blocks, head). Stage boundaries are layer (child) indices: ``boundaries=[2]`` makes the stages [0, 2) and [2, 4)
(LeNet's convolutional part, then its dense part); ``stages=N`` splits the layers as evenly as possible:

>>> stage_ranges(boundaries=[2]), stage_ranges(stages=3)
([(0, 2), (2, 4)], [(0, 2), (2, 3), (3, 4)])

The model strategy (``parallel.strategies.ModelParallel``: one replica, one stage a context, the whole batch
through each) and the pipeline strategy (``Pipeline``: micro-batches) are presets of the composed strategy
(``parallel.strategies.hybrid``), which cuts the model at these ranges (its behaviour's ``cut``) and runs the
stages.
"""
from ..models.lenet import LENET_LAYERS
from ..split import shard_sizes
from ..validate import BadValue, check_int
from . import DEFAULT_STAGES

__all__ = ["stage_ranges"]


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
