"""Argument checks shared by the strategies (errors name the offending value and the fix)."""
import mxnet as mx
import numpy as np

from ..models import LENET_SHAPES
from ..step import check_labels


def is_int(value):
    """True for a Python or numpy integer that is not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def check_contexts(ctx_list, needed=1, what="this"):
    """Raise unless ``ctx_list`` is a list of at least ``needed`` distinct contexts; ``what`` names the need."""
    if not isinstance(ctx_list, (list, tuple)) or not ctx_list:
        raise ValueError(f"ctx_list must be a non-empty list of contexts such as [mx.cpu(0), mx.cpu(1)], "
                         f"got {ctx_list!r}")
    for i, ctx in enumerate(ctx_list):
        if not isinstance(ctx, mx.Context):
            raise TypeError(f"ctx_list[{i}] must be an mxnet Context such as mx.cpu({i}), got {ctx!r}")
        if ctx in ctx_list[:i]:
            raise ValueError(f"ctx_list[{i}] repeats {ctx}; list each context once")
    if len(ctx_list) < needed:
        raise ValueError(f"{what} need {needed} contexts, got {len(ctx_list)}; "
                         "use fewer stages or more contexts")


def check_batch(X, y, loss, num_classes=LENET_SHAPES[-1][0]):
    """Raise unless ``X`` and ``y`` hold the same number (>= 1) of examples, and ``y`` holds ``num_classes``
    classes (LeNet's 10 by default; ``None``: not checked here, see ``parallel.step.check_labels``)."""
    if X.shape[0] != y.shape[0]:
        raise ValueError(f"X has {X.shape[0]} examples but y has {y.shape[0]}; give one label per example")
    if X.shape[0] < 1:
        raise ValueError("cannot train on an empty batch (0 examples); give at least one example")
    if num_classes is not None:
        check_labels(y, num_classes, loss)
