"""A run's configuration as one object, and one compatibility check per rule, for the CLI, ``fit`` and
``make_strategy`` alike.

- ``RunConfig``: what the training loop (``parallel.fit``) takes besides the data, the built strategy and the
  optimizer: epochs, the global batch, the seed, micro-batches per batch, how often to checkpoint, what to trace.
  Frozen: a run's settings cannot drift while it trains.
- The rules: ``check_layout`` (what each strategy's layout options are, ``stages`` against ``boundaries``),
  ``check_distributed`` (which strategy trains across processes), ``check_zero`` (ZeRO against the strategy and the
  algorithm), ``check_compression`` (compression against the strategy and ZeRO), ``optimizer_defaults`` (each
  optimizer's learning rate and weight decay when none is given). Each raises ``BadValue``/``BadType``
  (``parallel.validate``), which carry the offending argument, so that the CLI names its flag (``FLAGS``).

Nothing here imports MXNet: the CLI checks its flags with these before MXNet starts.

>>> RunConfig(epochs=2, batch_size=64)
RunConfig(epochs=2, batch_size=64, seed=0, accumulate=1, checkpoint_every=None, trace=None, progress=False)
>>> check_zero(2, "data", "naive")
Traceback (most recent call last):
    ...
parallel.validate.BadValue: zero=2 reduce-scatters the gradients, which the naive allreduce cannot; use algorithm fused or ring
"""
from dataclasses import dataclass
from typing import Optional

from .comm import SHARDED_ALGORITHMS
from .compress import parse_compression
from .models import MODELS
from .optim import OPTIMIZERS, ZERO_LEVELS
from .strategies import DEFAULT_MICRO_BATCHES, DEFAULT_STAGES, PIPELINE_SCHEDULES, STRATEGIES
from .validate import BadType, BadValue, check_bool, check_choice, check_int, check_path, check_seed

__all__ = ["RunConfig", "run_config", "FLAGS", "check_layout", "check_distributed", "check_zero", "check_compression",
           "check_tensor", "check_schedule", "check_recompute", "optimizer_defaults"]

#: The flag of ``python -m parallel.train`` for each argument name the package's errors use (``lr`` -> ``--lr``).
FLAGS = {"epochs": "--epochs", "num_epochs": "--epochs", "batch_size": "--batch-size", "lr": "--lr",
         "seed": "--seed", "data_dir": "--data-dir", "ctx_list": "--devices", "devices": "--devices",
         "stages": "--stages", "boundaries": "--boundaries", "micro_batches": "--micro-batches",
         "metrics_json": "--metrics-json", "plot": "--plot", "export": "--export", "checkpoint_dir": "--checkpoint-dir",
         "model": "--model", "strategy": "--strategy", "algorithm": "--allreduce", "kvstore": "--kvstore",
         "optimizer": "--optimizer", "momentum": "--momentum", "nesterov": "--nesterov", "wd": "--wd",
         "clip_norm": "--clip-norm", "accumulate": "--accumulate", "zero": "--zero", "warmup_epochs": "--warmup-epochs",
         "checkpoint_every": "--checkpoint-every", "compression": "--compression", "trace": "--trace",
         "bucket_mb": "--bucket-mb", "lr_decay_epochs": "--lr-decay-epochs", "lr_decay": "--lr-decay",
         "factor": "--lr-decay", "milestones": "--lr-decay-epochs",
         "lr_schedule": "--lr-schedule", "recompute": "--recompute", "tensor": "--tensor", "schedule": "--schedule",
         "virtual_stages": "--virtual-stages", "virtual": "--virtual-stages"}

#: The strategies that replicate the model, which ZeRO can shard and compression can compress between.
_REPLICATING = ("data", "hybrid")


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
    """
    epochs: int
    batch_size: int
    seed: int = 0
    accumulate: int = 1
    checkpoint_every: Optional[int] = None
    trace: Optional[str] = None
    progress: bool = False

    def __post_init__(self):
        check_int(self.epochs, "epochs", low=1)
        check_int(self.batch_size, "batch_size", low=1)
        check_seed(self.seed)
        check_int(self.accumulate, "accumulate", low=1, high=self.batch_size)
        if self.checkpoint_every is not None:
            check_int(self.checkpoint_every, "checkpoint_every", low=1)
        if self.trace is not None:
            object.__setattr__(self, "trace", check_path(self.trace, "trace"))
        check_bool(self.progress, "progress")


def run_config(args):
    """The ``RunConfig`` of ``python -m parallel.train``'s parsed arguments (``BadValue``/``BadType`` naming one)."""
    return RunConfig(epochs=args.epochs, batch_size=args.batch_size, seed=args.seed, accumulate=args.accumulate,
                     checkpoint_every=args.checkpoint_every, trace=args.trace, progress=not args.no_progress)


def check_layout(strategy, stages=None, boundaries=None, micro_batches=None, batch_size=None):
    """The layout options ``strategy`` takes: ``stages`` or ``boundaries`` (not both; not for data parallelism),
    ``micro_batches`` (the pipeline's, at most ``batch_size``).

    >>> check_layout("data", stages=2)
    Traceback (most recent call last):
        ...
    parallel.validate.BadValue: stages apply to the model, pipeline and hybrid strategies, not to data; drop them or choose another strategy
    """
    check_choice(strategy, "strategy", tuple(STRATEGIES))
    for name, value in (("stages", stages), ("boundaries", boundaries)):
        if value is not None and strategy == "data":
            raise BadValue(name, f"{{{name}}} apply to the model, pipeline and hybrid strategies, not to data; drop "
                                 "them or choose another {strategy}")
    if stages is not None and boundaries is not None:
        raise BadValue("stages", "{stages} and {boundaries} both say where to cut; give one of them")
    if micro_batches is not None:
        if strategy != "pipeline":
            raise BadValue("micro_batches", f"{{micro_batches}} apply to the pipeline strategy only, not to "
                                            f"{strategy}; drop them or choose the pipeline {{strategy}}")
        check_int(micro_batches, "micro_batches", low=1)
    if strategy == "pipeline" and batch_size is not None:
        m = DEFAULT_MICRO_BATCHES if micro_batches is None else micro_batches
        if m > check_int(batch_size, "batch_size", low=1):
            raise BadValue("micro_batches", f"{{micro_batches={m}}} cannot split batches of {batch_size} examples; "
                                            f"use at most {batch_size} micro-batches or a larger {{batch_size}}")


def check_schedule(strategy, schedule="gpipe", virtual=1, stages=None, micro_batches=None, boundaries=None):
    """A pipeline's schedule (``PIPELINE_SCHEDULES``) and virtual stages: the pipeline strategy's; more than one
    virtual stage interleaves 1F1B, the micro-batches taken a stage-count at a time (a multiple of the devices)."""
    check_choice(schedule, "schedule", tuple(PIPELINE_SCHEDULES))
    check_int(virtual, "virtual_stages", low=1)
    if strategy != "pipeline" and (schedule != "gpipe" or virtual > 1):
        raise BadValue("schedule", f"{{schedule}} and {{virtual_stages}} order a pipeline's micro-batches, not the "
                                   f"{strategy} strategy's; use {{strategy=pipeline}}")
    if virtual > 1 and schedule != "1f1b":
        raise BadValue("virtual_stages", f"{{virtual_stages={virtual}}} interleaves 1F1B; use {{schedule}} 1f1b")
    if virtual > 1:
        devices = stages if stages is not None else (len(boundaries) + 1) // virtual if boundaries else DEFAULT_STAGES
        m = DEFAULT_MICRO_BATCHES if micro_batches is None else micro_batches
        if boundaries is not None and (len(boundaries) + 1) % virtual:
            raise BadValue("boundaries", f"{{boundaries}} cut {len(boundaries) + 1} chunks, which cannot be dealt "
                                         f"{virtual} a device ({{virtual_stages={virtual}}}); give a multiple of "
                                         f"{virtual} chunks")
        if devices and m % devices:
            raise BadValue("micro_batches", f"interleaving takes the micro-batches {devices} at a time, one a stage: "
                                            f"{{micro_batches={m}}} must be a multiple of {devices}")


def check_distributed(strategy, distributed, tensor=1):
    """Only data parallelism trains one worker's share of a distributed job, and the hybrid strategy with
    ``tensor`` > 1 (its replicas of tensor-parallel stages are data-parallel replicas of the job's)."""
    if distributed and strategy != "data" and not (strategy == "hybrid" and tensor > 1):
        raise BadValue("strategy", f"{{strategy={strategy}}} cannot train across processes, only data can (and "
                                   f"hybrid with {{tensor}}); run the {strategy} strategy in one process")


def check_zero(zero, strategy=None, algorithm=None):
    """ZeRO shards replicated optimizer state: the data and hybrid strategies' (zero 1 and 2); zero 2
    reduce-scatters the gradients, which only the algorithms of ``SHARDED_ALGORITHMS`` split into; zero 3 shards
    the parameters too, for the data strategy with the fused allreduce's additions."""
    if isinstance(zero, bool) or not isinstance(zero, int):
        raise BadType("zero", f"{{zero}} must be 0, 1, 2 or 3, got {zero!r}")
    if zero not in ZERO_LEVELS:
        raise BadValue("zero", f"{{zero}} must be 0, 1, 2 or 3, got {zero!r}")
    if zero == 3 and strategy is not None and strategy != "data":
        raise BadValue("zero", f"{{zero=3}} shards the parameters of data parallelism's replicas, not the stages of "
                               f"{{strategy={strategy}}}; use {{zero=2}} or {{strategy=data}}")
    if zero and strategy is not None and strategy not in _REPLICATING:
        raise BadValue("zero", f"{{zero={zero}}} shards replicated optimizer state, but the {strategy} strategy "
                               "holds one copy of each stage, with its state, on its own context; use {zero=0} or "
                               "the data or hybrid {strategy}")
    if zero == 2 and algorithm is not None and algorithm not in SHARDED_ALGORITHMS:
        raise BadValue("zero", f"{{zero=2}} reduce-scatters the gradients, which the {algorithm} allreduce cannot; "
                               f"use {{algorithm}} {' or '.join(SHARDED_ALGORITHMS)}")
    if zero == 3 and algorithm is not None and algorithm != "fused":
        raise BadValue("zero", f"{{zero=3}} reduce-scatters with the fused allreduce's additions, not the "
                               f"{algorithm} allreduce's; use {{algorithm}} fused")


def check_compression(compression, strategy=None, zero=None):
    """A compression spec (``parse_compression``) compresses the data strategy's sums, and not with ``zero=2``
    (which reduce-scatters the gradients, which no codec does). Returns the spec's ``(kind, value)``."""
    kind, value = parse_compression(compression)
    if kind != "none" and strategy is not None and strategy != "data":
        raise BadValue("compression", f"{{compression}} applies to {{strategy=data}}, not {{strategy={strategy}}}")
    if kind != "none" and zero in (2, 3):
        raise BadValue("compression", f"{{compression}} does not work with {{zero={zero}}} (it reduce-scatters the "
                                      "gradients); use {zero=0} or {zero=1}")
    return kind, value


def check_tensor(tensor, strategy=None, zero=0, recompute=False, compression="none", model=None):
    """Tensor parallelism splits the data strategy's replicas (the hybrid strategy's stages) into groups of
    ``tensor`` contexts, each layer split over a group (``parallel.strategies.TensorParallel``): a model that
    splits (``MODELS[model].tensor``, at most that many ranks), with ZeRO's stages 0-2 (each rank's state sharded
    over its replicas), without recomputation or compression. (Across processes, ``check_distributed``: the data strategy's groups.)"""
    check_int(tensor, "tensor", low=1)
    if tensor == 1:
        return
    if model is not None:
        most = MODELS[check_choice(model, "model", tuple(MODELS))].tensor
        splits = [name for name, info in MODELS.items() if info.tensor]
        if not most:
            raise BadValue("tensor", f"{{tensor={tensor}}} splits attention heads and MLP units; {MODELS[model].title} "
                                     f"has none: use {{model}} {' or '.join(splits)}")
        if tensor > most:
            raise BadValue("tensor", f"{{tensor={tensor}}} ranks cannot split {MODELS[model].title}'s {most} attention "
                                     f"heads; use at most {most}")
    if strategy is not None and strategy not in ("data", "hybrid"):
        raise BadValue("tensor", f"{{tensor={tensor}}} splits each layer of the data or hybrid strategy's replicas over "
                                 f"groups of contexts, not {{strategy={strategy}}}'s; use {{strategy}} data or "
                                 "hybrid")
    if zero == 3:
        raise BadValue("tensor", f"{{tensor={tensor}}} splits the parameters over a group's ranks; {{zero=3}} would "
                                 "shard them again over the replicas: use {zero} 0, 1 or 2")
    if recompute:
        raise BadValue("tensor", f"{{tensor={tensor}}} does not recompute its layers; drop {{recompute}}")
    if compression != "none":
        raise BadValue("tensor", f"{{tensor={tensor}}} sums its activations uncompressed; use {{compression}} none")


def check_recompute(recompute, strategy=None):
    """Activation recomputation runs a replica's blocks one after another (``parallel.models.Recompute``): the data
    strategy's replicas; the other strategies run each stage whole."""
    check_bool(recompute, "recompute")
    if recompute and strategy is not None and strategy != "data":
        raise BadValue("recompute", f"{{recompute}} recomputes the blocks of data parallelism's replicas, not the "
                                    f"stages of {{strategy={strategy}}}; drop it or use {{strategy=data}}")


def optimizer_defaults(name):
    """``{"lr": ..., "wd": ...}`` of the optimizer ``name`` when none are given: SGD at 0.2 (the textbook's LeNet
    rate), Adam and AdamW at 0.001; weight decay 0, and 0.01 for AdamW (decoupled, PyTorch's default).

    >>> optimizer_defaults("adamw")
    {'lr': 0.001, 'wd': 0.01}
    """
    check_choice(name, "optimizer", tuple(OPTIMIZERS))
    return {"lr": 0.2 if name == "sgd" else 0.001, "wd": 0.01 if name == "adamw" else 0.0}
