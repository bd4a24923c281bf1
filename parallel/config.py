"""A run's configuration as one object, for the CLI and ``fit`` alike.

- ``RunConfig``: what the training loop (``parallel.fit``) takes besides the data, the built strategy and the
  optimizer: epochs, the global batch, the seed, micro-batches per batch, how often to checkpoint, what to trace,
  where to write TensorBoard's event files.
  Frozen: a run's settings cannot drift while it trains.
- ``layout_of_args``: the run's ``parallel.Layout`` (how the model is spread over the contexts; its rules are its
  own: ``Layout.check``), ``optimizer_defaults`` (each optimizer's learning rate and weight decay when none is
  given), and ``FLAGS``: the flag of each argument the package's errors name (``BadValue``/``BadType``,
  ``parallel.validate``), so that the CLI names its flags.

Nothing here imports MXNet: the CLI checks its flags with these before MXNet starts.

>>> RunConfig(epochs=2, batch_size=64)
RunConfig(epochs=2, batch_size=64, seed=0, accumulate=1, checkpoint_every=None, trace=None, progress=False, logdir=None)
"""
from dataclasses import dataclass
from typing import Optional

from .board import check_logdir
from .layout import Layout
from .optim import OPTIMIZERS
from .validate import BadValue, check_bool, check_choice, check_int, check_path, check_seed

#: The most optimizer steps a run takes: up to 2**53 a step's number is an exact integer in float64, the
#: arithmetic of the learning-rate schedules
MAX_STEPS = 2 ** 53

__all__ = ["RunConfig", "run_config", "layout_of_args", "FLAGS", "optimizer_defaults"]

#: The flag of ``python -m parallel.train`` for each argument name the package's errors use (``lr`` -> ``--lr``).
FLAGS = {"epochs": "--epochs", "num_epochs": "--epochs", "batch_size": "--batch-size", "lr": "--lr",
         "seed": "--seed", "data_dir": "--data-dir", "ctx_list": "--devices", "devices": "--devices",
         "stages": "--stages", "boundaries": "--boundaries", "micro_batches": "--micro-batches",
         "metrics_json": "--metrics-json", "plot": "--plot", "export": "--export", "checkpoint_dir": "--checkpoint-dir",
         "model": "--model", "strategy": "--strategy", "algorithm": "--allreduce", "kvstore": "--kvstore",
         "optimizer": "--optimizer", "momentum": "--momentum", "nesterov": "--nesterov", "wd": "--wd",
         "clip_norm": "--clip-norm", "accumulate": "--accumulate", "zero": "--zero", "warmup_epochs": "--warmup-epochs",
         "checkpoint_every": "--checkpoint-every", "compression": "--compression", "trace": "--trace",
         "compression_warmup": "--compression-warmup", "cross_barrier": "--cross-barrier",
         "bucket_mb": "--bucket-mb", "lr_decay_epochs": "--lr-decay-epochs", "lr_decay": "--lr-decay",
         "factor": "--lr-decay", "milestones": "--lr-decay-epochs",
         "lr_schedule": "--lr-schedule", "recompute": "--recompute", "tensor": "--tensor", "schedule": "--schedule",
         "virtual_stages": "--virtual-stages", "virtual": "--virtual-stages", "logdir": "--logdir",
         "experts": "--experts", "top_k": "--top-k", "capacity_factor": "--capacity-factor",
         "z_weight": "--router-z-loss", "gate_scale": "--gate-scale", "aux_weight": "--aux-loss-weight",
         "context": "--context", "patch": "--patch-size",
         "sequence": "--sequence-parallel", "expert_parallel": "--expert-parallel"}


@dataclass(frozen=True)
class RunConfig:
    """What ``parallel.fit`` runs: ``epochs`` epochs of shuffled batches of ``batch_size`` (the global batch).

    Attributes
    ----------
    epochs, batch_size : int
        Both >= 1. The last batch of an epoch may be smaller; it is trained on, not dropped.
    seed : int
        0 .. 2**32-1: orders the examples of every epoch (``parallel.data.batches.epoch_seed``).
    accumulate : int
        Run each batch as this many micro-batches before its update (1 .. ``batch_size``).
    checkpoint_every : int, optional
        Also checkpoint after every this many optimizer steps (counted from the run's first step).
    trace : str, optional
        Record steps ``TRACE_FIRST`` .. of the run with MXNet's profiler and write a Chrome trace there (a run
        of fewer steps: those it has, ``parallel.fit.trace_first``).
    progress : bool
        Show a progress bar per epoch that counts finished batches.
    logdir : str, optional
        Write TensorBoard's event files into this directory (created when missing; an existing file is refused):
        each step's and each epoch's scalars and the configuration (``parallel.board``); rank 0 alone in a job.
    """
    epochs: int
    batch_size: int
    seed: int = 0
    accumulate: int = 1
    checkpoint_every: Optional[int] = None
    trace: Optional[str] = None
    progress: bool = False
    logdir: Optional[str] = None

    def __post_init__(self):
        check_int(self.epochs, "epochs", low=1)
        check_int(self.epochs, "epochs", high=MAX_STEPS)   # apart: "must be >= 1" for what is too small
        check_int(self.batch_size, "batch_size", low=1)
        check_seed(self.seed)
        check_int(self.accumulate, "accumulate", low=1, high=self.batch_size)
        if self.checkpoint_every is not None:
            check_int(self.checkpoint_every, "checkpoint_every", low=1)
        if self.trace is not None:
            object.__setattr__(self, "trace", check_path(self.trace, "trace"))
        check_bool(self.progress, "progress")
        if self.logdir is not None:
            object.__setattr__(self, "logdir", check_logdir(self.logdir))

    def check_fits(self, num_train):
        """Refuse a run that does not fit a training set of ``num_train`` examples: a global batch larger than the
        set (every epoch would be one batch of it all, whatever ``batch_size`` said), or more optimizer steps than
        ``MAX_STEPS``. ``BadValue`` naming ``batch_size`` or ``epochs``.

        >>> RunConfig(epochs=2, batch_size=64).check_fits(100)   # two batches an epoch, the last of 36
        >>> RunConfig(epochs=2, batch_size=128).check_fits(100)
        Traceback (most recent call last):
        ...
        parallel.validate.BadValue: batch_size 128 is more than the 100 examples of the training set: every epoch would be one batch of them all
        """
        if self.batch_size > num_train:
            raise BadValue("batch_size", f"{{batch_size}} {self.batch_size} is more than the {num_train} examples of "
                                         "the training set: every epoch would be one batch of them all")
        per_epoch = -(-num_train // self.batch_size)
        if self.epochs * per_epoch > MAX_STEPS:
            raise BadValue("epochs", f"{{epochs}} {self.epochs} makes {self.epochs * per_epoch:.3g} optimizer steps "
                                     f"({per_epoch} an epoch), more than 2**53, past which a step's number is not "
                                     "exact in float64 (the rate schedules count in it)")


def run_config(args):
    """The ``RunConfig`` of ``python -m parallel.train``'s parsed arguments (``BadValue``/``BadType`` naming one)."""
    return RunConfig(epochs=args.epochs, batch_size=args.batch_size, seed=args.seed, accumulate=args.accumulate,
                     checkpoint_every=args.checkpoint_every, trace=args.trace, progress=not args.no_progress,
                     logdir=args.logdir)


def layout_of_args(args):
    """The ``parallel.Layout`` of ``python -m parallel.train``'s parsed arguments (``BadValue``/``BadType`` naming
    one)."""
    return Layout(args.strategy, stages=args.stages, boundaries=args.boundaries, micro_batches=args.micro_batches,
                  schedule=args.schedule, virtual=args.virtual_stages, tensor=args.tensor, zero=args.zero,
                  recompute=args.recompute, accumulate=args.accumulate, compression=args.compression,
                  expert_parallel=args.expert_parallel, context=args.context, sequence=args.sequence_parallel)


def optimizer_defaults(name):
    """``{"lr": ..., "wd": ...}`` of the optimizer ``name`` when none are given: SGD at 0.2 (the textbook's LeNet
    rate), Adam and AdamW at 0.001; weight decay 0, and 0.01 for AdamW (decoupled, PyTorch's default).

    >>> optimizer_defaults("adamw")
    {'lr': 0.001, 'wd': 0.01}
    """
    check_choice(name, "optimizer", tuple(OPTIMIZERS))
    return {"lr": 0.2 if name == "sgd" else 0.001, "wd": 0.01 if name == "adamw" else 0.0}
