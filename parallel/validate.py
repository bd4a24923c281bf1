"""Argument checks, with one rule everywhere: a wrong type raises ``TypeError``, a wrong value ``ValueError``.

Every message starts with the argument's name as the function calls it (``lr``, ``batch_size``,
``data_dir``), says what is allowed and shows what was given; the CLI maps these names to its flags
(``parallel.cli.flag_message``). Nothing here imports MXNet at import time, so the CLI checks its arguments
before MXNet starts.

>>> check_int(0, "batch_size", low=1)
Traceback (most recent call last):
    ...
ValueError: batch_size must be >= 1, got 0
>>> check_int(2.0, "batch_size", low=1)
Traceback (most recent call last):
    ...
TypeError: batch_size must be an int, got 2.0
>>> check_lr(1e-40)
Traceback (most recent call last):
    ...
ValueError: lr must be between 1.18e-38 and 3.40e+38 (float32's normal range, which MXNet's update takes), got 1e-40
"""
import math
import numbers
import os

__all__ = ["check_int", "check_number", "check_lr", "check_seed", "check_choice", "check_bool", "check_path",
           "check_contexts", "MAX_SEED", "LR_RANGE"]

#: Seeds are those numpy's ``RandomState`` takes: 0 .. 2**32 - 1.
MAX_SEED = 2 ** 32 - 1

#: Learning rates MXNet's update operators accept: their parameters are float32, and they refuse a value that
#: does not parse as a normal float32 ("Out of range value for lr").
LR_RANGE = (1.1754943508222875e-38, 3.4028234663852886e+38)


def check_int(value, name, low=None, high=None):
    """Return ``value`` as an ``int``; it must be an integer (not a bool) within ``low`` .. ``high``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if low is not None and high is not None and not low <= value <= high:
        raise ValueError(f"{name} must be between {low} and {high}, got {value}")
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be <= {high}, got {value}")
    return int(value)


def check_number(value, name, positive=False):
    """Return ``value`` as a ``float``; it must be a finite real number (not a bool), > 0 if ``positive``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value) or (positive and not value > 0):
        raise ValueError(f"{name} must be a finite number{' > 0' if positive else ''}, got {value!r}")
    return float(value)


def check_lr(lr, name="lr"):
    """Raise unless ``lr`` is a learning rate MXNet can step with: finite, > 0, in float32's normal range."""
    check_number(lr, name, positive=True)
    low, high = LR_RANGE
    if not low <= lr <= high:
        raise ValueError(f"{name} must be between {low:.2e} and {high:.2e} (float32's normal range, which MXNet's "
                         f"update takes), got {lr!r}")


def check_seed(seed, name="seed"):
    """Raise unless ``seed`` is an int in 0 .. ``MAX_SEED`` (what numpy's ``RandomState`` takes)."""
    check_int(seed, name, 0, MAX_SEED)


def check_choice(value, name, choices):
    """Raise unless ``value`` is one of ``choices`` (strings): ``ValueError`` naming them all."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a string, one of {', '.join(choices)}; got {value!r}")
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")
    return value


def check_bool(value, name):
    """Raise unless ``value`` is ``True`` or ``False``."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return value


def check_path(value, name):
    """Return ``value`` as a ``str`` path; it must be a non-empty ``str`` or ``os.PathLike``."""
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{name} must be a path (str or os.PathLike), got {value!r}")
    path = os.fspath(value)
    if not isinstance(path, str):
        raise TypeError(f"{name} must be a text path, got {value!r}")
    if path == "":
        raise ValueError(f"{name} must name a file or directory, got an empty string")
    return path


def check_contexts(ctx_list, name="ctx_list", needed=1, what="this"):
    """Raise unless ``ctx_list`` is a list (or tuple) of at least ``needed`` distinct MXNet contexts.

    ``what`` says what needs them (``"3 stages"``) in the message for too few. Imports MXNet.
    """
    import mxnet as mx

    if isinstance(ctx_list, mx.Context):
        raise TypeError(f"{name} must be a list of contexts, got the single context {ctx_list}; write [{ctx_list!r}]")
    if not isinstance(ctx_list, (list, tuple)):
        raise TypeError(f"{name} must be a list of contexts such as [mx.cpu(0), mx.cpu(1)], got {ctx_list!r}")
    if not ctx_list:
        raise ValueError(f"{name} is empty; give at least one context, such as [mx.cpu(0)]")
    for i, ctx in enumerate(ctx_list):
        if not isinstance(ctx, mx.Context):
            raise TypeError(f"{name}[{i}] must be an mxnet Context such as mx.cpu({i}), got {ctx!r}")
        if ctx in ctx_list[:i]:
            raise ValueError(f"{name}[{i}] repeats {ctx}; list each context once")
    if len(ctx_list) < needed:
        raise ValueError(f"{name}: {what} need {needed} contexts, got {len(ctx_list)}; use fewer stages or more "
                         "contexts")
    return list(ctx_list)
