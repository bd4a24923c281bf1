"""The codecs by name: ``make_codec("topk:0.01")`` makes the codec a ``--compression`` spec names."""
from . import COMPRESSIONS, parse_compression
from .codec import Codec
from .fp16 import FP16
from .powersgd import PowerSGD
from .topk import TopK
from .twobit import TwoBit

__all__ = ["make_codec", "as_codec", "CODECS"]

#: The codec class of every compression but ``none``.
CODECS = {"fp16": FP16, "2bit": TwoBit, "topk": TopK, "powersgd": PowerSGD}


def make_codec(spec, name="compression"):
    """The codec a spec names (``parse_compression``): a new object with empty residuals, or None for ``"none"``.
    Keep the object for the whole run: its residuals carry over from step to step.

    >>> make_codec("topk:0.01"), make_codec("none")
    (TopK('topk:0.01'), None)
    """
    kind, value = parse_compression(spec, name)
    if kind == "none":
        return None
    return CODECS[kind]() if value is None else CODECS[kind](value)


def as_codec(value, name="compression"):
    """``value`` as a codec: None or ``"none"`` -> None, a spec string -> ``make_codec``, a ``Codec`` as is;
    ``TypeError`` naming ``name`` for anything else."""
    if value is None or isinstance(value, Codec):
        return value
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a compression spec such as 'topk:0.01' or a parallel.compress codec, got "
                        f"{value!r}")
    return make_codec(value, name)


if set(CODECS) != set(COMPRESSIONS) - {"none"}:   # pragma: no cover - a registry out of step is a bug
    raise ImportError("parallel.compress: CODECS and COMPRESSIONS name different codecs")
