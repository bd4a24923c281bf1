"""Gradient compression with error feedback: codecs that send less where gradients cross a boundary.

- ``codec``: the interface (``Codec``: encode, decode, a residual per gradient buffer so that what was not sent is
  added to the next step's gradient) and the protocols that reduce through a transport they are given;
- one codec a file: ``fp16`` (``FP16``), ``twobit`` (``TwoBit``), ``topk`` (``TopK``), ``powersgd``
  (``PowerSGD``); ``registry``: ``make_codec(spec)``;
- ``feedback``: error feedback in a checkpoint, named by worker and context, and placed on another layout.

The codecs move nothing themselves: ``parallel.comm.reducer`` runs them as communication hooks, the transport
theirs to use. This package imports nothing else of ``parallel``.

The names parse here, without MXNet, so that the CLI checks ``--compression`` before MXNet starts:

>>> COMPRESSIONS
('none', 'fp16', '2bit', 'topk', 'powersgd')
>>> parse_compression("topk:0.01"), parse_compression("2bit"), parse_compression("2bit:0.5")
(('topk', 0.01), ('2bit', None), ('2bit', 0.5))
"""
import math

from ..lazy import lazy_exports
from ..validate import FLOAT32_RANGE, fits_float32

#: The compressors by name: ``none`` (nothing compressed: bitwise the uncompressed step), ``fp16`` (half
#: precision), ``2bit`` (MXNet's threshold scheme: +t, -t or 0 per element, t scaled to the gradient, or fixed with
#: ``2bit:T``), ``topk:RATIO`` (the largest
#: RATIO of the elements by magnitude, with their indices), ``powersgd:RANK`` (low rank, by power iteration).
COMPRESSIONS = ("none", "fp16", "2bit", "topk", "powersgd")

#: MXNet's default threshold for its 2-bit compression (``kv.set_gradient_compression``); ``"2bit:0.5"`` spells it.
#: The package's ``"2bit"`` scales the threshold to the gradient instead (``parallel.compress.twobit``).
MXNET_THRESHOLD = 0.5


def parse_compression(spec, name="compression"):
    """``(name, value)`` of a compressor spec: ``"none"``, ``"fp16"``, ``"2bit"`` (the threshold scaled to the
    gradient) or ``"2bit:THRESHOLD"`` (fixed), ``"topk:RATIO"`` (0 < RATIO <= 1), ``"powersgd:RANK"`` (an int >=
    1). ``value`` is None for none, fp16 and 2bit.

    Raises ``TypeError`` for a spec that is not a string and ``ValueError`` (naming ``name``) for a bad one.
    """
    if not isinstance(spec, str):
        raise TypeError(f"{name} must be a string such as 'none', 'fp16', '2bit', 'topk:0.01' or 'powersgd:4', "
                        f"got {spec!r}")
    kind, _, value = spec.partition(":")
    if kind not in COMPRESSIONS:
        raise ValueError(f"{name} must be one of none, fp16, 2bit[:THRESHOLD], topk:RATIO, powersgd:RANK; "
                         f"got {spec!r}")
    if kind in ("none", "fp16"):
        if value:
            raise ValueError(f"{name} {kind!r} takes no value, got {spec!r}")
        return kind, None
    if kind == "2bit" and not value:
        return kind, None
    if not value:
        what = "RATIO (e.g. topk:0.01)" if kind == "topk" else "RANK (e.g. powersgd:4)"
        raise ValueError(f"{name} {kind!r} needs a {what}, got {spec!r}")
    if kind == "powersgd":
        try:
            rank = int(value)
        except ValueError:
            rank = 0
        if rank < 1 or str(rank) != value:
            raise ValueError(f"{name} powersgd:RANK needs an int RANK >= 1, got {spec!r}")
        return kind, rank
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if kind == "topk" and not 0 < number <= 1:
        raise ValueError(f"{name} topk:RATIO needs 0 < RATIO <= 1 (the fraction of elements sent), got {spec!r}")
    if kind == "2bit" and not (math.isfinite(number) and number > 0 and fits_float32(number)):
        low, high = FLOAT32_RANGE   # the threshold is a float32 on the device: 1e40 would be infinite there
        raise ValueError(f"{name} 2bit:THRESHOLD needs a THRESHOLD > 0 in float32's normal range ({low:.2e} .. "
                         f"{high:.2e}), got {spec!r}")
    return kind, number


_SOURCES = {"codec": ["Codec"], "fp16": ["FP16"], "twobit": ["TwoBit"], "topk": ["TopK"], "powersgd": ["PowerSGD"],
            "registry": ["make_codec", "as_codec", "CODECS"],
            "feedback": ["job_names", "split_name", "place", "expected_residuals"]}
__all__ = ["COMPRESSIONS", "MXNET_THRESHOLD", "parse_compression"] + [name for names in _SOURCES.values()
                                                                       for name in names]
__getattr__, __dir__ = lazy_exports(__name__, _SOURCES)
