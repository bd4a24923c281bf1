"""Device contexts: find GPUs, fall back to the CPU, and parse the CLI's ``--devices`` spec.

A *context* (``mx.gpu(i)``, ``mx.cpu(i)``) names where an array lives and where its operators run.
Several CPU contexts (``mx.cpu(0)``, ``mx.cpu(1)``, ...) share the machine's cores but each gets its own
worker thread in MXNet's engine, so they behave like separate devices: this is how the tests run.
"""
import re

import mxnet as mx

from .validate import BadType, BadValue

__all__ = ["try_gpu", "try_all_gpus", "parse_devices", "MAX_CPU_CONTEXTS"]


def try_gpu(i=0):
    """Return ``mx.gpu(i)`` if that GPU exists, otherwise ``mx.cpu()``.

    Parameters
    ----------
    i : int
        GPU index as this process sees it (after ``CUDA_VISIBLE_DEVICES`` renumbering).

    Returns
    -------
    mxnet.Context
    """
    return mx.gpu(i) if mx.context.num_gpus() >= i + 1 else mx.cpu()


def try_all_gpus():
    """Return every GPU context, or ``[mx.cpu()]`` when there is no GPU.

    Returns
    -------
    list of mxnet.Context
        Never empty.
    """
    return [mx.gpu(i) for i in range(mx.context.num_gpus())] or [mx.cpu()]


_SPEC = re.compile(r"(cpu|gpu)(?::(.*))?", re.DOTALL)
_NUMBER = re.compile(r"[0-9]+")   # ASCII digits only: str.isdigit() also takes '٣' and '²' (int('²') fails)

#: Most CPU contexts ``cpu:N`` may ask for. MXNet refuses device ids from 2**31 on, and the first array on
#: ``cpu(i)`` makes it allocate per-device tables up to ``i`` (~15 GB for ``cpu(10**9)``); each context in
#: use also gets its own engine worker thread. A few contexts per core is all that is useful.
MAX_CPU_CONTEXTS = 1024


def _digits(text):
    """``text`` as a canonical whole number (ASCII digits, no leading zeros), or None if it is not one.

    Kept as a string: Python's ``int()`` refuses over 4300 digits, and no count or index needs that many.
    """
    if not _NUMBER.fullmatch(text):
        return None
    return text.lstrip("0") or "0"


def _at_most(digits, limit):
    """Whether the canonical number ``digits`` is <= ``limit`` (without converting a huge one)."""
    return len(digits) <= len(str(limit)) and int(digits) <= limit


def parse_devices(spec):
    """Turn a device spec into a list of contexts.

    Parameters
    ----------
    spec : str
        ``"auto"``: all GPUs, else one CPU context.
        ``"cpu"`` or ``"cpu:N"``: N CPU contexts ``cpu(0) .. cpu(N-1)`` (N defaults to 1).
        ``"gpu"``: all GPUs.
        ``"gpu:I,J,..."``: those GPU indices, as the process sees them. ``CUDA_VISIBLE_DEVICES``
        renumbers GPUs: with ``CUDA_VISIBLE_DEVICES=2,5`` physical GPUs 2 and 5 are ``gpu:0,1`` here.

    Returns
    -------
    list of mxnet.Context
        Distinct contexts, never empty.

    Raises
    ------
    ValueError
        For a malformed spec (including ``"cpu:"`` or ``"gpu:"`` with nothing after the colon, and digits
        other than ASCII 0-9), a count below 1 or above ``MAX_CPU_CONTEXTS``, a repeated GPU index, or a GPU
        that does not exist.
    TypeError
        When ``spec`` is not a string.
    """
    if not isinstance(spec, str):
        raise BadType("devices", f"{{devices|device spec}} must be a string such as 'cpu:4' or 'gpu:0,1', got {spec!r}")
    text = spec.strip().lower()
    if text == "auto":
        return try_all_gpus()
    match = _SPEC.fullmatch(text)
    if not match:
        raise BadValue("devices", f"unknown {{devices|device spec}} {spec!r}; use 'auto', 'cpu:N' or 'gpu:I,J,...'")
    kind, arg = match.groups()
    given = "{devices|device spec} " + repr(spec)   # the spec, as the API and the command name it
    if arg is not None and not arg.strip():
        if kind == "cpu":
            raise BadValue("devices", f"{given} has nothing after the colon; write 'cpu' for one "
                                      "CPU context or 'cpu:N' for N of them, such as 'cpu:4'")
        raise BadValue("devices", f"{given} has nothing after the colon; write 'gpu' for every GPU "
                                  "or 'gpu:I,J,...' for some of them, such as 'gpu:0,1'")
    num_gpus = mx.context.num_gpus()
    if kind == "cpu":
        if arg is None:
            return [mx.cpu(0)]
        count = _digits(arg)
        if count is None or count == "0":
            raise BadValue("devices", f"{given}: 'cpu:N' needs a whole number of contexts N >= 1, "
                                      "written with the digits 0-9")
        if not _at_most(count, MAX_CPU_CONTEXTS):
            many = count if len(count) <= 12 else f"a {len(count)}-digit number of"
            raise BadValue("devices", f"{given} asks for {many} CPU contexts; at most "
                                      f"{MAX_CPU_CONTEXTS} are allowed (MAX_CPU_CONTEXTS)")
        return [mx.cpu(i) for i in range(int(count))]
    if arg is None:
        if num_gpus == 0:
            raise BadValue("devices", f"{given} asks for GPUs but this machine has none; use 'cpu:N'")
        return [mx.gpu(i) for i in range(num_gpus)]
    parts = [_digits(part.strip()) for part in arg.split(",")]
    if None in parts:
        raise BadValue("devices", f"{given}: 'gpu:I,J,...' needs GPU indices written with the "
                                  "digits 0-9, such as 'gpu:0,3'")
    if len(set(parts)) != len(parts):
        raise BadValue("devices", f"{given} repeats a GPU index; list each GPU once")
    missing = [part for part in parts if not _at_most(part, num_gpus - 1)]
    if missing:
        have = f"GPUs 0..{num_gpus - 1}" if num_gpus else "no GPU"
        raise BadValue("devices", f"{given} asks for GPU {missing[0]} but this process sees {have}; "
                                  "use 'cpu:N' or check CUDA_VISIBLE_DEVICES")
    indices = [int(part) for part in parts]
    return [mx.gpu(i) for i in indices]
