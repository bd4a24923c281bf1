"""Optimizers with state, on flat buffers, sharded across contexts (ZeRO), with schedules and gradient clipping.

- ``optimizers``: ``SGD`` (momentum, Nesterov, weight decay), ``Adam``, ``AdamW``, each updating a flat buffer
  with one of MXNet's fused update operators, its state in flat buffers beside the parameters; ``make_optimizer``.
- ``schedules``: ``Constant``, ``Step``, ``Cosine``, with a linear warm-up, counted in optimizer steps.
- ``zero``: ``optimizer_step``, the update of every replica once the gradients are computed: sum them, clip by the
  global norm, update (the whole buffer on every context, or each context its shard: ZeRO), all-gather; and the
  optimizer state of a layout as the layout-free arrays a checkpoint stores (``gather_state``, ``load_state``).

The registries need no MXNet, so the CLI checks its flags before MXNet starts:

>>> list(OPTIMIZERS), list(SCHEDULES), ZERO_LEVELS
(['sgd', 'adam', 'adamw'], ['constant', 'step', 'cosine'], (0, 1, 2, 3))
"""
from ..lazy import lazy_exports
from ..validate import BadValue, check_bool, check_choice, check_float32

#: The optimizers, by name, with what the CLI's help says of each.
OPTIMIZERS = {
    "sgd": "SGD, with --momentum (and --nesterov) and --wd as L2 weight decay",
    "adam": "Adam (MXNet's: bias correction in the rate, --wd as L2)",
    "adamw": "AdamW (decoupled weight decay --wd)",
}

#: The learning-rate schedules, by name.
SCHEDULES = {
    "constant": "the same rate at every step",
    "step": "the rate times --lr-decay after each of --lr-decay-epochs",
    "cosine": "half a cosine from --lr down to 0 at the last step",
}

#: ZeRO's stages: 0 (state replicated), 1 (state sharded), 2 (gradients and state sharded).
ZERO_LEVELS = (0, 1, 2, 3)

def check_hyper(name, momentum=0.0, nesterov=False, wd=0.0, clip_norm=None):
    """Check an optimizer's hyper-parameters, without MXNet (the CLI calls it before MXNet starts); returns
    ``(momentum, nesterov, wd, clip_norm)`` as floats and a bool. ``ValueError``/``TypeError`` naming the argument;
    every float must be one MXNet's update operators take (``parallel.validate.check_float32``).

    >>> check_hyper("adam", momentum=0.9)
    Traceback (most recent call last):
        ...
    parallel.validate.BadValue: momentum applies to sgd, not adam (Adam's first moment decays with beta1)
    """
    check_choice(name, "optimizer", tuple(OPTIMIZERS))
    momentum = check_float32(momentum, "momentum")
    if not 0 <= momentum < 1:
        raise BadValue("momentum", f"{{momentum}} must be in [0, 1), got {momentum!r}")
    if momentum and name != "sgd":
        raise BadValue("momentum", f"{{momentum}} applies to {{optimizer=sgd|sgd}}, not {name} (Adam's first moment "
                                   "decays with beta1)")
    if check_bool(nesterov, "nesterov") and name != "sgd":   # advice to add momentum would fail in turn
        raise BadValue("nesterov", f"{{nesterov}} applies to {{optimizer=sgd|sgd}} with a {{momentum}} > 0, not to "
                                   f"{name}; drop {{nesterov}}")
    if nesterov and not momentum:
        raise BadValue("nesterov", "{nesterov} needs a {momentum} > 0 (Nesterov's momentum without momentum is plain "
                               "SGD); give {momentum=0.9}, say, or drop {nesterov}")
    wd = check_float32(wd, "wd")
    if wd < 0:
        raise BadValue("wd", f"{{wd}} must be >= 0, got {wd!r}")
    clip_norm = None if clip_norm is None else check_float32(clip_norm, "clip_norm", positive=True)
    return momentum, nesterov, wd, clip_norm


_SOURCES = {
    "optimizers": ["Optimizer", "SGD", "Adam", "AdamW", "make_optimizer"],
    "schedules": ["Schedule", "Constant", "Step", "Cosine"],
    "zero": ["optimizer_step", "as_optimizer", "gather_state", "load_state", "memory_per_context",
             "MemoryUse", "memory_table", "ReplicatedStore", "owned_regions"],
}
__all__ = ["OPTIMIZERS", "SCHEDULES", "ZERO_LEVELS", "check_hyper"] + [name for names in _SOURCES.values() for name in names]
__getattr__, __dir__ = lazy_exports(__name__, _SOURCES)
