"""Argument checks, with one rule everywhere: a wrong type raises ``TypeError``, a wrong value ``ValueError``.

The errors carry the offending argument as data: ``BadValue`` and ``BadType`` (subclasses of ``ValueError`` and
``TypeError``) hold ``argument``, the name the function calls it (``lr``, ``batch_size``), and a message written
with the names of the arguments it mentions as ``{name}`` (or ``{name=value}``), which reads ``lr`` (``lr=0.1``)
from the API and ``--lr`` (``--lr 0.1``) from the command (``render(flags)``): the CLI names its flags, never the
API's names. Each message says what is allowed and shows what was given. Nothing here imports MXNet at import
time, so the CLI checks its arguments before MXNet starts.

>>> check_int(0, "batch_size", low=1)
Traceback (most recent call last):
    ...
parallel.validate.BadValue: batch_size must be >= 1, got 0
>>> check_int(2.0, "batch_size", low=1)
Traceback (most recent call last):
    ...
parallel.validate.BadType: batch_size must be an int, got 2.0
>>> check_lr(1e-40)
Traceback (most recent call last):
    ...
parallel.validate.BadValue: lr must be between 1.18e-38 and 3.40e+38 (float32's normal range, which MXNet's operators take), got 1e-40
>>> check_float32(1e40, "wd")
Traceback (most recent call last):
    ...
parallel.validate.BadValue: wd must be 0 or between 1.18e-38 and 3.40e+38 in magnitude (float32's normal range, which MXNet's operators take), got 1e+40
"""
import math
import numbers
import os
import re

__all__ = ["BadValue", "BadType", "check_int", "check_number", "check_lr", "check_seed", "check_choice", "check_bool",
           "check_path", "check_contexts", "check_float32", "fits_float32", "MAX_SEED", "FLOAT32_RANGE", "LR_RANGE"]

_NAME = re.compile(r"\{([a-z_][a-z0-9_]*)(?:=([^{}|]*))?(?:\|([^{}]*))?\}")


def _named(name):
    """``(argument, how a template writes it)``: ``lr`` -> ``("lr", "{lr}")``, ``boundaries[0]`` ->
    ``("boundaries", "{boundaries}[0]")``; a name of another form is written as it is."""
    match = re.match(r"([a-z_][a-z0-9_]*)(.*)$", name)
    if match is None:
        return name, name
    return match.group(1), "{" + match.group(1) + "}" + match.group(2)


class _ArgumentError:
    """What ``BadValue`` and ``BadType`` share: the argument, and the message as a template of argument names."""

    def __init__(self, argument, template):
        base, written = _named(argument)   # "boundaries[0]": the argument is boundaries
        self.argument, self.template = base, template.replace("{" + argument + "}", written)
        super().__init__(self.render())

    def render(self, flags=None):
        """The message, each ``{name}`` the API's name or, with ``flags`` (``{name: "--flag"}``), the flag;
        ``{name=value}`` reads ``name=value``, or ``--flag value``; ``{name|words}`` (``{name=value|words}``) reads
        ``words`` from the API."""
        def name(match):
            arg, value, words = match.groups()
            flag = (flags or {}).get(arg)
            if flag is None:
                return words if words is not None else arg if value is None else f"{arg}={value}"
            return flag if value is None else f"{flag} {value}"
        return _NAME.sub(name, self.template)


class BadValue(_ArgumentError, ValueError):
    """A wrong value for the argument ``argument``; ``render(flags)`` names it as a command's flag."""


class BadType(_ArgumentError, TypeError):
    """A wrong type for the argument ``argument``; ``render(flags)`` names it as a command's flag."""

#: Seeds are those numpy's ``RandomState`` takes: 0 .. 2**32 - 1.
MAX_SEED = 2 ** 32 - 1

#: float32's normal range. MXNet's operators parse each float parameter (``lr``, ``wd``, ``momentum``, ``beta1``,
#: ``epsilon``, ``rescale_grad``, ...) as a float32 and refuse ("Out of range value for wd, value='1e-46', in
#: operator sgd_update") any value but 0 whose magnitude is outside it: a subnormal, one that rounds to 0, one
#: beyond float32's largest (infinite in float32).
FLOAT32_RANGE = (1.1754943508222875e-38, 3.4028234663852886e+38)

#: Learning rates MXNet's update operators accept: float32's normal range (0 would train nothing).
LR_RANGE = FLOAT32_RANGE


def check_int(value, name, low=None, high=None):
    """Return ``value`` as an ``int``; it must be an integer (not a bool) within ``low`` .. ``high``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise BadType(name, f"{{{name}}} must be an int, got {value!r}")
    if low is not None and high is not None and not low <= value <= high:
        raise BadValue(name, f"{{{name}}} must be between {low} and {high}, got {value}")
    if low is not None and value < low:
        raise BadValue(name, f"{{{name}}} must be >= {low}, got {value}")
    if high is not None and value > high:
        raise BadValue(name, f"{{{name}}} must be <= {high}, got {value}")
    return int(value)


def check_number(value, name, positive=False):
    """Return ``value`` as a ``float``; it must be a finite real number (not a bool), > 0 if ``positive``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise BadType(name, f"{{{name}}} must be a number, got {value!r}")
    if not math.isfinite(value) or (positive and not value > 0):
        raise BadValue(name, f"{{{name}}} must be a finite number{' > 0' if positive else ''}, got {value!r}")
    return float(value)


def fits_float32(value):
    """Whether MXNet's operators take ``value`` as a float parameter: 0, or its magnitude in ``FLOAT32_RANGE``."""
    low, high = FLOAT32_RANGE
    return value == 0 or low <= abs(value) <= high


def check_float32(value, name, positive=False, what=None):
    """Return ``value`` as a ``float``: a finite number (> 0 if ``positive``) that MXNet's operators take as a
    parameter (``fits_float32``), or that stays within float32 wherever the package computes with it.

    ``what`` names a value computed from the arguments, written as a template (``"{lr} * {factor}**2, the rate
    after the last decay,"``); the error is raised as ``name``'s. The place to check every float the package
    hands to MXNet: the optimizers' hyper-parameters, the rates a schedule gives, compression thresholds.
    """
    if what is None:
        value = check_number(value, name, positive)
    if not fits_float32(value) or (positive and value == 0):
        low, high = FLOAT32_RANGE
        allowed = (f"between {low:.2e} and {high:.2e}" if positive else
                   f"0 or between {low:.2e} and {high:.2e} in magnitude")
        given = f"{value!r}" if what is None else f"{value:.3g}"
        raise BadValue(name, f"{what or '{' + name + '}'} must be {allowed} (float32's normal range, which MXNet's "
                             f"operators take), got {given}")
    return float(value)


def check_lr(lr, name="lr"):
    """Raise unless ``lr`` is a learning rate MXNet can step with: finite, > 0, in float32's normal range."""
    return check_float32(lr, name, positive=True)


def check_seed(seed, name="seed"):
    """Raise unless ``seed`` is an int in 0 .. ``MAX_SEED`` (what numpy's ``RandomState`` takes)."""
    check_int(seed, name, 0, MAX_SEED)


def check_choice(value, name, choices):
    """Raise unless ``value`` is one of ``choices`` (strings): ``ValueError`` naming them all."""
    if not isinstance(value, str):
        raise BadType(name, f"{{{name}}} must be a string, one of {', '.join(choices)}; got {value!r}")
    if value not in choices:
        raise BadValue(name, f"{{{name}}} must be one of {', '.join(choices)}; got {value!r}")
    return value


def check_bool(value, name):
    """Raise unless ``value`` is ``True`` or ``False``."""
    if not isinstance(value, bool):
        raise BadType(name, f"{{{name}}} must be True or False, got {value!r}")
    return value


def check_path(value, name):
    """Return ``value`` as a ``str`` path; it must be a non-empty ``str`` or ``os.PathLike``."""
    if not isinstance(value, (str, os.PathLike)):
        raise BadType(name, f"{{{name}}} must be a path (str or os.PathLike), got {value!r}")
    path = os.fspath(value)
    if not isinstance(path, str):
        raise BadType(name, f"{{{name}}} must be a text path, got {value!r}")
    if path == "":
        raise BadValue(name, f"{{{name}}} must name a file or directory, got an empty string")
    return path


def check_contexts(ctx_list, name="ctx_list", needed=1, what="this"):
    """Raise unless ``ctx_list`` is a list (or tuple) of at least ``needed`` distinct MXNet contexts.

    ``what`` says what needs them (``"3 stages"``) in the message for too few. Imports MXNet.
    """
    import mxnet as mx

    if isinstance(ctx_list, mx.Context):
        raise BadType(name, f"{{{name}}} must be a list of contexts, got the single context {ctx_list}; write "
                            f"[{ctx_list!r}]")
    if not isinstance(ctx_list, (list, tuple)):
        raise BadType(name, f"{{{name}}} must be a list of contexts such as [mx.cpu(0), mx.cpu(1)], got {ctx_list!r}")
    if not ctx_list:
        raise BadValue(name, f"{{{name}}} is empty; give at least one context, such as [mx.cpu(0)]")
    for i, ctx in enumerate(ctx_list):
        if not isinstance(ctx, mx.Context):
            raise BadType(name, f"{{{name}}}[{i}] must be an mxnet Context such as mx.cpu({i}), got {ctx!r}")
        if ctx in ctx_list[:i]:
            raise BadValue(name, f"{{{name}}}[{i}] repeats {ctx}; list each context once")
    if len(ctx_list) < needed:
        raise BadValue(name, f"{what} need {needed} contexts, got {len(ctx_list)} in {{{name}}}; use fewer "
                             "{stages} or more contexts")
    return list(ctx_list)
