"""Train LeNet (or ResNet-18, a small ViT or a Transformer) on Fashion-MNIST with data parallelism written from
scratch, or with the other parallel styles (model, pipeline, hybrid, tensor): the command ``python -m parallel.train``.

Run::

    python -m parallel.train --devices cpu:2 --epochs 10
    python -m parallel.train --dataset synthetic --epochs 2 --metrics-json m.json --plot curves.png
    python -m parallel.train --devices cpu:2 --strategy pipeline --stages 2 --micro-batches 4
    python -m parallel.train --devices cpu:4 --strategy hybrid --boundaries 2
    python -m parallel.launch -n 2 python -m parallel.train --devices cpu:1 --epochs 10

The last one trains one model in two processes (started by ``parallel.launch``, joined through MXNet's
distributed kvstore): ``--batch-size`` stays the global batch, each worker trains its slice, and rank 0
alone prints the epochs and writes the metrics, plot, TensorBoard event files, checkpoints and export.

Every strategy runs the same SGD step on the same batches: the same ``--seed`` gives the same loss curve.
``--model resnet18`` trains the textbook's ResNet-18 (a gluon block, 11.2 million parameters, BatchNorm) the same
ways instead of LeNet; on a CPU it costs a few hundred times LeNet's time per example. ``--model vit`` trains a
small Vision Transformer (7x7 patches, a class token, four pre-norm Transformer blocks of width 64: 139 thousand
parameters, no BatchNorm) the same ways, and ``--model transformer`` an encoder over the image's 28 rows (two
post-norm blocks); the two Transformers are made of parallel layers, so ``--tensor`` splits them too, and both
take ``--context``, ``--sequence-parallel`` and ``--experts``.

The arguments are checked before MXNet is imported, so ``--help`` and argument errors answer at once; then,
unless ``OMP_NUM_THREADS`` is set, the command sets it to every core (MXNet reads it when it is imported; see
``parallel.threads.recommended_omp_threads``) and imports MXNet, once. ``run`` is the whole command as a
sequence of named steps: claim the output files, join the job, load the data, lay the model out, train,
export.

Each epoch prints one line in the textbook's form; ``--metrics-json`` and ``--plot`` are rewritten
atomically after every epoch. Input the user controls that cannot work (an argument, the data, an output
path, a learning rate that diverges, a checkpoint directory another run holds) exits with status 2 and a
one-line ``error:`` message; Ctrl-C exits with 130 (in a distributed job, a signal ends the worker at once;
the launcher reports it). Anything else is a bug in the package and ends with Python's traceback (status 1).
"""
import sys

if __name__ == "__main__" and not __package__:   # python parallel/train.py: the relative imports would fail
    sys.stderr.write("error: run the command as a module, from the directory that holds parallel/: "
                     "python -m parallel.train ...\n")
    sys.exit(2)


def _interrupted_while_importing(signum, frame):
    """Ctrl-C before ``main`` runs (this module's imports take a moment on a busy machine): ``main``'s one line
    and status (``INTERRUPTED_STATUS``, 128 + SIGINT), not a traceback from inside an import. Nothing has started
    that needs stopping."""
    sys.stderr.write("error: interrupted\n")
    sys.stderr.flush()
    import os
    os._exit(128 + signum)


if __name__ == "__main__":
    import signal
    signal.signal(signal.SIGINT, _interrupted_while_importing)

import argparse
import contextlib
import os
import shlex

from .cli import (JOB_ENV, USAGE_STATUS, Parser, UsageError, finite_float, launched, positive_float, restart_count,
                  users_input, warning_lines)
from .comm import ALGORITHMS, DEFAULT_ALGORITHM, DEFAULT_BUCKET_MB, HOSTS_BUCKET_MB
from .data import DATASETS
from .config import FLAGS, layout_of_args, optimizer_defaults, run_config
from .files import LOCK_FILE, DirectoryLock, DirectoryLocked, check_writable, export_files, remove_if_empty_at_exit
from .handover import ELASTIC_ENV
from .interrupt import INTERRUPTED_STATUS, end_on_signals, hold_interrupts, stop_between_batches
from .layout import PRESETS, preset_micro_batches
from .models import MODELS, model_info, model_spec
from .mxnet_compat import import_mxnet_without_scipy_stats
from .optim import OPTIMIZERS, SCHEDULES, ZERO_LEVELS, check_hyper
from .optim.schedules import Step
from .strategies import DEFAULT_MICRO_BATCHES, DEFAULT_STAGES, PIPELINE_SCHEDULES, STRATEGIES
from .threads import engine_settings
from .validate import LR_RANGE, MAX_SEED, check_int, check_lr, check_number

__all__ = ["main", "main_in_job", "build_parser", "check_args", "run"]

def _int_list(what, example):
    """An ``argparse`` type: a comma-separated list of ints (``what``, e.g. "layer indices")."""
    def parse(text):
        try:
            return [int(part) for part in text.split(",")] if text.strip() else []
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of {what} such as "
                                             f"{example}") from None
    return parse


_layer_indices = _int_list("layer indices", "2 or 1,3")


def build_parser():
    """The argument parser of ``python -m parallel.train`` (it imports nothing heavy)."""
    parser = Parser(prog="python -m parallel.train",
                    description="Train LeNet, ResNet-18, a small ViT or a Transformer with data, pipeline and tensor "
                                "parallelism written from scratch on MXNet.")
    add = parser.add_argument
    add("--model", choices=list(MODELS), default="lenet",
        help="lenet: the textbook's LeNet, from scratch; resnet18: the textbook's ResNet-18 for 28x28 images (a "
             "gluon block with BatchNorm, statistics over the whole batch across one process's devices, over each "
             "micro-batch under --accumulate; in a distributed job each worker keeps its own); vit: a small Vision "
             "Transformer for 28x28 images (7x7 patches, a class token, 4 pre-norm blocks of width 64, 4 heads); "
             "transformer: an encoder over the image's 28 rows (post-norm blocks, mean-pooled); default lenet")
    add("--devices", default="auto", help="'auto' (all GPUs, else one CPU context), 'cpu:N' (N CPU contexts) or "
        "'gpu:I,J,...' (GPU indices as CUDA_VISIBLE_DEVICES numbers them); default auto")
    add("--epochs", type=int, default=10, help="number of epochs (>= 1); default 10")
    add("--batch-size", type=int, default=256, help="global batch size, split across the devices (>= 1); default 256")
    add("--lr", type=positive_float, default=None,
        help=f"learning rate (> 0, at most {LR_RANGE[1]:.2e}); default 0.2 for sgd, 0.001 for adam and adamw")
    _add_data_flags(add)
    _add_reduction_flags(add)
    _add_layout_flags(add)
    _add_expert_flags(add)
    _add_sequence_flag(add)
    _add_optimizer_flags(add)
    add("--seed", type=int, default=0, help=f"seeds initial parameters and shuffling, 0 to {MAX_SEED}; default 0")
    add("--metrics-json", metavar="PATH", help="write per-epoch metrics as JSON")
    add("--trace", metavar="PATH",
        help="record steps 2-4 of the run (fewer in a shorter run: from step 2, or step 1 if it is the only one) "
             "with MXNet's profiler and write a Chrome trace there (chrome://tracing, "
             "Perfetto): a lane per device, each operator named load, forward, backward, allreduce or update; in a "
             "job each worker writes PATH with .workerR before its extension")
    add("--plot", metavar="PATH",
        help="write loss and accuracy curves; the suffix names the format (.png, .pdf, .svg, ...)")
    add("--logdir", metavar="DIR",
        help="write TensorBoard event files into DIR (created when missing; view them with tensorboard --logdir "
             "DIR): each step's loss, learning rate, gradient norm, examples/sec and bytes moved, each epoch's "
             "loss, accuracies and memory per device, the run's configuration as text; in a job rank 0 alone "
             "writes")
    add("--checkpoint-dir", metavar="DIR", help="write a checkpoint there after every epoch and when interrupted "
                                                "(Ctrl-C, SIGTERM); one run at a time holds the directory")
    add("--checkpoint-every", type=int, default=None, metavar="N",
        help="also write a checkpoint after every N optimizer steps (batches), so that a run killed mid-epoch "
             "loses at most N; needs --checkpoint-dir")
    add("--commit-every", type=int, default=10, metavar="N",
        help="in an elastic job (launch -n MIN:MAX or --host-discovery-script), commit the state in memory every N "
             "steps for a restart to take from a live worker (a failure trains at most N again); default 10")
    add("--resume", action="store_true",
        help="continue from the checkpoint in --checkpoint-dir (any strategy or devices; --epochs may grow)")
    add("--export", metavar="PREFIX", help="write the trained model as MXNet's PREFIX-symbol.json + "
                                           "PREFIX-0000.params (gluon.SymbolBlock.imports reads it)")
    add("--kvstore", choices=["dist_sync", "dist_device_sync"], default=None,
        help="under python -m parallel.launch: the distributed kvstore that sums the workers' gradients; "
             "default dist_sync (dist_device_sync for GPUs)")
    add("--batchnorm-stats", choices=["job", "worker"], default="job",
        help="for a BatchNorm network in a job (--model resnet18 under python -m parallel.launch): normalise over "
             "the whole global batch, every worker's slice (job: the one-device model, two small sums a BatchNorm "
             "a step through the job) or over each worker's slice alone (worker: no sum, another model); default "
             "job")
    add("--no-progress", action="store_true", help="hide the progress bars")
    return parser


def _add_data_flags(add):
    add("--dataset", choices=list(DATASETS), default="fashion-mnist",
        help="default fashion-mnist (downloaded when missing)")
    add("--data-dir", default=None, help="with --dataset fashion-mnist (the default): an existing directory of the "
                                         "four IDX files of an MNIST-format dataset, "
                                         "raw or .gz (Fashion-MNIST is downloaded into it when it is empty; default "
                                         "$MXNET_HOME/datasets/fashion-mnist, i.e. ~/.mxnet/..., created when "
                                         "missing)")
    add("--train-size", type=int, default=None, metavar="N",
        help="train on the first N examples of the training set (>= 1; the test set stays whole); default all")


def _add_layout_flags(add):
    """How the model is laid out on the devices: the strategy, its stages and micro-batches, the tensor axis."""
    add("--strategy", choices=list(STRATEGIES), default="data",
        help="; ".join(f"{name}: {what}" for name, what in STRATEGIES.items()) + "; default data")
    add("--stages", type=int, default=None,
        help=f"model/pipeline/hybrid: cut the model's layers (LeNet's 4, ResNet-18's 7 children, the ViT's 6, the "
             f"Transformer's 4) into N stages as evenly as possible (default {DEFAULT_STAGES})")
    add("--boundaries", type=_layer_indices, default=None, metavar="I,J",
        help="model/pipeline/hybrid: instead of --stages, the layer indices where stages start, e.g. 2 (conv | "
             "dense) or 1,3; " + "; ".join(f"{MODELS[m].title}'s layers are {MODELS[m].layers}" for m in MODELS))
    add("--micro-batches", type=int, default=None, metavar="M",
        help=f"pipeline and hybrid: micro-batches a replica's stages are fed per batch, at most --batch-size "
             f"(default {DEFAULT_MICRO_BATCHES} for pipeline, 1 for hybrid); a shorter last batch uses one per "
             "example")
    add("--schedule", choices=list(PIPELINE_SCHEDULES), default="gpipe",
        help="pipeline and hybrid: the order the micro-batches' forwards and backwards are issued in; " +
             "; ".join(f"{name}: {what}" for name, what in PIPELINE_SCHEDULES.items()) + "; default gpipe")
    add("--virtual-stages", type=int, default=1, metavar="V",
        help="with --schedule 1f1b: V model chunks a device (interleaved 1F1B: the model cut into --stages x V "
             "chunks, --micro-batches a multiple of --stages); default 1")
    add("--tensor", type=int, default=1, metavar="T",
        help="tensor parallelism (Megatron-LM): split each layer's attention heads and MLP units over groups of T "
             "devices (a model made of parallel layers: --model vit or transformer), data parallelism over the "
             "groups (--devices a multiple of T); with --stages each stage split so (data x pipeline x tensor); "
             "default 1 (none)")


def _add_expert_flags(add):
    """A mixture of experts in the two Transformers, expert parallelism, the ViT's patches and context parallelism."""
    add("--patch-size", type=int, default=7, metavar="P",
        help="--model vit: cut the 28x28 image into patches of P x P pixels (a divisor of 28), (28 / P)^2 + 1 tokens "
             "with the class token: 4 makes 50; default 7 (17 tokens)")
    add("--context", type=int, default=1, metavar="C",
        help="--model vit or transformer: context parallelism: each example's tokens split over groups of C "
             "devices (--devices a multiple of C), attention by ring attention (blocks of keys and values passed "
             "round the group, an online softmax), data parallelism over the groups (and --stages, --tensor, "
             "--recompute, --zero 3); default 1 (none)")
    add("--experts", type=int, default=0, metavar="E",
        help="--model vit or transformer: every other block's MLP a mixture of E experts (at least 2), each token "
             "routed to --top-k of them, its load-balancing loss (Switch's) added to the loss; default 0 (none)")
    add("--top-k", type=int, default=1, metavar="K",
        help="--experts: the experts each token goes to, its gates their probabilities (normalized for K > 1); "
             "default 1 (Switch)")
    add("--capacity-factor", type=positive_float, default=1.0, metavar="C",
        help="--experts: an expert takes at most ceil(C x K x tokens / E) tokens of a batch, the rest dropped (they go "
             "on through the residual); E / K or more drops none; default 1")
    add("--aux-loss-weight", type=finite_float, default=0.01, metavar="W",
        help="--experts: the weight of Switch's load-balancing loss (E x the sum over the experts of the fraction of "
             "tokens each is first choice of times its mean router probability); 0: none; default 0.01")
    add("--router-z-loss", type=finite_float, default=0.0, metavar="W",
        help="--experts: add W x the mean squared log-sum-exp of the router's scores (ST-MoE's z-loss, e.g. 0.001); "
             "default 0 (none)")
    add("--gate-scale", type=positive_float, default=1.0, metavar="S",
        help="--experts: every gate times S (DeepSeek-V2's routed scaling factor); with --top-k 1 the load-balancing "
             "loss keeps a gate near 1 / E, and E gives a chosen expert about the dense MLP's weight; default 1")
    add("--expert-parallel", type=int, default=1, metavar="P",
        help="--experts: spread the experts over groups of P devices (E / P each, --devices a multiple of P), "
             "tokens sent to their experts and back by an all-to-all (also across --stages, over --tensor ranks, "
             "with --zero 3); default 1 (every device holds every expert)")


class Scope:
    """Where a flag of the command does something: ``where``, the words its ``--help`` text and its README row say
    it with; ``out``, arguments that give it where it does nothing (refused, one line naming it); ``within``,
    arguments where it applies (accepted). For a scope no other check covers, ``applies(args)`` says whether the
    flag does something, and ``refusal`` (a text, or a function of ``args``) what ``check_scopes`` says when not."""

    def __init__(self, where, out, within, refusal=None, applies=None):
        self.where, self.out, self.within, self.refusal, self.applies = where, out, within, refusal, applies


def _fixes_micro_batches(strategy):
    """Whether the preset ``strategy`` feeds its pipeline one micro-batch whatever is given (data, model)."""
    return "micro_batches" in PRESETS[strategy]["fixed"]


def _feeds_micro_batches(args):
    """Whether the run's pipeline is fed more than one micro-batch a batch: a schedule has something to order."""
    if _fixes_micro_batches(args.strategy):
        return False
    given = args.micro_batches
    return (preset_micro_batches(args.strategy) if given is None else given) > 1


def _orders(args):
    """Why a --schedule or --virtual-stages does nothing here."""
    if _fixes_micro_batches(args.strategy):
        return (f"orders the micro-batches a pipeline is fed; the {args.strategy} --strategy feeds it one: use the "
                "pipeline or hybrid --strategy")
    return ("orders the micro-batches a pipeline is fed; --micro-batches 1 leaves nothing to order: give "
            "--micro-batches 2 or more")


#: Every flag that applies in some runs only, in one place: what --help and the README say of it, and what the
#: checks refuse (tests/test_train.py holds the three to it). The others apply to every run.
SCOPES = {
    "--data-dir": Scope("--dataset fashion-mnist", "--dataset synthetic --data-dir .", "--data-dir ."),
    "--stages": Scope("model/pipeline/hybrid", "--stages 2", "--strategy model --stages 2"),
    "--boundaries": Scope("model/pipeline/hybrid", "--boundaries 2", "--strategy model --boundaries 2"),
    "--micro-batches": Scope("pipeline and hybrid", "--strategy model --micro-batches 2",
                             "--strategy pipeline --micro-batches 2"),
    "--schedule": Scope("pipeline and hybrid", "--strategy model --schedule 1f1b",
                        "--strategy pipeline --schedule 1f1b", refusal=_orders, applies=_feeds_micro_batches),
    "--virtual-stages": Scope("with --schedule 1f1b", "--strategy pipeline --virtual-stages 2",
                              "--strategy pipeline --schedule 1f1b --virtual-stages 2", refusal=_orders,
                              applies=_feeds_micro_batches),
    "--tensor": Scope("--model vit or transformer", "--tensor 2 --devices cpu:2",
                      "--model vit --tensor 2 --devices cpu:2"),
    "--patch-size": Scope("--model vit", "--patch-size 4", "--model vit --patch-size 4"),
    "--context": Scope("--model vit or transformer", "--context 2 --devices cpu:2",
                       "--model vit --context 2 --devices cpu:2"),
    "--experts": Scope("--model vit or transformer", "--experts 4", "--model vit --experts 4"),
    **{flag: Scope("--experts", f"--model vit {flag} {value}", f"--model vit --experts 4 {flag} {value}")
       for flag, value in (("--top-k", 2), ("--capacity-factor", 2), ("--aux-loss-weight", 0.1),
                           ("--router-z-loss", 0.001), ("--gate-scale", 2), ("--expert-parallel", 2))},
    "--sequence-parallel": Scope("with --tensor", "--model vit --sequence-parallel",
                                 "--model vit --tensor 2 --devices cpu:2 --sequence-parallel"),
    "--cross-barrier": Scope("--zero 0", "--zero 1 --cross-barrier", "--cross-barrier",
                             refusal="splits the parameters into one buffer a bucket, which --zero's shards do not "
                                     "support: use --zero 0",
                             applies=lambda args: args.zero == 0),
    "--compression-warmup": Scope("--compression", "--compression-warmup 5",
                                  "--compression fp16 --compression-warmup 5"),
    "--momentum": Scope("sgd", "--optimizer adam --momentum 0.9", "--momentum 0.9"),
    "--nesterov": Scope("--momentum", "--nesterov", "--momentum 0.9 --nesterov"),
    "--lr-decay-epochs": Scope("step schedule", "--lr-decay-epochs 5", "--lr-schedule step --lr-decay-epochs 5"),
    "--lr-decay": Scope("step schedule", "--lr-decay 0.5", "--lr-schedule step --lr-decay 0.5"),
    "--checkpoint-every": Scope("--checkpoint-dir", "--checkpoint-every 5", "--checkpoint-dir c --checkpoint-every 5"),
    "--resume": Scope("--checkpoint-dir", "--resume", "--checkpoint-dir c --resume"),
    "--commit-every": Scope("elastic job", "--commit-every 5", None,
                            refusal="applies to an elastic job (python -m parallel.launch -n MIN:MAX or "
                                    "--host-discovery-script), whose workers commit their state in memory",
                            applies=lambda args: os.environ.get(ELASTIC_ENV) == "1"),
    "--kvstore": Scope("python -m parallel.launch", "--kvstore dist_sync", None),
    "--batchnorm-stats": Scope("BatchNorm network in a job", "--model resnet18 --batchnorm-stats worker", None,
                               refusal="applies to a BatchNorm network (--model resnet18) in a job (python -m "
                                       "parallel.launch): what each worker's BatchNorm normalises over",
                               applies=lambda args: launched() and model_info(args.model).batchnorm),
}


def check_scopes(args):
    """Refuse, in one line naming it, a flag given another value than its default where it does nothing, for the
    scopes of ``SCOPES`` no other check covers."""
    parser = build_parser()
    for flag, scope in SCOPES.items():
        dest = flag[2:].replace("-", "_")
        if scope.refusal is not None and getattr(args, dest) != parser.get_default(dest) and not scope.applies(args):
            raise UsageError(f"{flag} {scope.refusal if isinstance(scope.refusal, str) else scope.refusal(args)}")


def _models_with(option):
    """The names of the models of ``MODELS`` that have the variant ``option`` (``model_spec``'s)."""
    return [name for name, info in MODELS.items() if option in [o for o, _, _ in info.options]]


def check_model_args(args):
    """The models' flags (the ViT's ``--patch-size``, ``--context``, the mixture of experts) together, then
    ``args.model`` the variant they make (``parallel.models.model_spec``); ``UsageError`` naming the flag."""
    if args.patch_size != 7:
        if args.model != "vit":
            raise UsageError(f"--patch-size applies to the ViT's tokens; use --model vit, not {args.model}")
        if args.patch_size < 1 or 28 % args.patch_size:
            raise UsageError(f"--patch-size must divide the image's 28 pixels (1, 2, 4, 7, 14 or 28), got "
                             f"{args.patch_size}")
    tokens = [name for name, info in MODELS.items() if info.sequences]
    if args.context != 1 and args.model not in tokens:
        raise UsageError(f"--context applies to a model's tokens; use --model {' or '.join(tokens)}, not "
                         f"{args.model}")
    _check_expert_args(args)
    options = {"experts": args.experts, "top_k": args.top_k, "capacity_factor": args.capacity_factor,
               "aux_weight": args.aux_loss_weight, "z_weight": args.router_z_loss,
               "gate_scale": args.gate_scale, "patch": args.patch_size}
    if args.model in _models_with("experts"):
        known = [o for o, _, _ in MODELS[args.model].options]
        args.model = model_spec(args.model, **{o: v for o, v in options.items() if o in known})


def _check_expert_args(args):
    """The mixture-of-experts flags together; ``UsageError`` naming the flag."""
    given = [flag for flag, value, default in (("--top-k", args.top_k, 1), ("--capacity-factor", args.capacity_factor,
                                                                              1.0),
                                               ("--aux-loss-weight", args.aux_loss_weight, 0.01),
                                               ("--router-z-loss", args.router_z_loss, 0.0),
                                               ("--gate-scale", args.gate_scale, 1.0),
                                               ("--expert-parallel", args.expert_parallel, 1)) if value != default]
    if not args.experts:
        if given:
            raise UsageError(f"{given[0]} applies to a mixture of experts: give --experts E (and --model "
                             f"{' or '.join(_models_with('experts'))})")
        return
    if args.model not in _models_with("experts"):
        raise UsageError(f"--experts makes a Transformer's MLPs mixtures of experts; use --model "
                         f"{' or '.join(_models_with('experts'))}, not {args.model}")
    if args.experts < 2:
        raise UsageError(f"--experts must be at least 2 (a mixture of one expert is the MLP), got {args.experts}")
    if not 1 <= args.top_k <= args.experts:
        raise UsageError(f"--top-k must be between 1 and --experts {args.experts}, got {args.top_k}")
    for flag, value in (("--aux-loss-weight", args.aux_loss_weight), ("--router-z-loss", args.router_z_loss)):
        if value < 0:
            raise UsageError(f"{flag} must be at least 0, got {value}")
    if args.expert_parallel < 1 or args.experts % args.expert_parallel:
        raise UsageError(f"--expert-parallel must divide --experts {args.experts} (each device of a group holds E / P "
                         f"experts), got {args.expert_parallel}")
    if args.export is not None:
        raise UsageError("--export writes MXNet's symbol graph, and a mixture of experts routes its tokens on the host "
                         "(no graph can); leave --export out with --experts")


def _add_sequence_flag(add):
    add("--sequence-parallel", action="store_true",
        help="with --tensor: sequence parallelism (Megatron-LM's): the layer norms and the residual stream split along "
             "the sequence over each tensor group, f and g an all-gather and a reduce-scatter (the same bytes), the "
             "activations of those regions 1/T a device; --model vit or transformer")


def _add_reduction_flags(add):
    """How the gradients are summed: the allreduce, the buckets, the compression."""
    add("--allreduce", choices=list(ALGORITHMS), default=DEFAULT_ALGORITHM,
        help=f"how gradients are summed across devices; default {DEFAULT_ALGORITHM}")
    add("--bucket-mb", type=positive_float, default=None, metavar="MB",
        help="sum the gradients in buckets of at most MB MiB, the last layers first, each bucket's sum starting "
             f"while the backward pass computes the earlier layers (PyTorch DDP's bucket_cap_mb); default "
             f"{DEFAULT_BUCKET_MB}, or {HOSTS_BUCKET_MB} in a job whose processes span several hosts (the run's "
             "header says which)")
    add("--compression", default="none", metavar="SPEC",
        help="send the gradients between devices compressed, with error feedback: none, fp16, 2bit (+-t or 0 "
             "an element, t each bucket's mean magnitude, scaled at every step), 2bit:THRESHOLD (MXNet's fixed t; "
             "its default is 2bit:0.5), topk:RATIO or powersgd:RANK (every data-parallel sum; not with --zero 3); "
             "default none")
    add("--cross-barrier", action="store_true",
        help="let each layer's next forward wait only for its own bucket's update (BytePS's cross barrier): the "
             "parameters in one buffer a bucket, each updated as its sum lands, first layers first, and in a job the "
             "first layers' sums sent first once backward ends; for slow links; the same model; with --zero 0")
    add("--compression-warmup", type=int, default=0, metavar="STEPS",
        help="sum the gradients of the first STEPS optimizer steps uncompressed, then compress (DDP's PowerSGD "
             "start_powerSGD_iter): a codec that sends a small part of the gradient learns far less in the first "
             "steps; with --compression; default 0")


def _add_optimizer_flags(add):
    """The optimizer's flags: the rule, its hyper-parameters, the schedule, clipping, accumulation, sharding."""
    add("--optimizer", choices=list(OPTIMIZERS), default="sgd",
        help="; ".join(f"{name}: {what}" for name, what in OPTIMIZERS.items()) + "; default sgd")
    add("--momentum", type=finite_float, default=0.0, help="sgd: momentum in [0, 1); default 0 (plain SGD)")
    add("--nesterov", action="store_true", help="sgd: Nesterov's momentum (needs --momentum > 0)")
    add("--wd", type=finite_float, default=None,
        help="weight decay >= 0 (L2 for sgd and adam, decoupled for adamw); default 0, and 0.01 for adamw")
    add("--lr-schedule", choices=list(SCHEDULES), default="constant",
        help="; ".join(f"{name}: {what}" for name, what in SCHEDULES.items()) + "; counted in optimizer steps; "
             "default constant")
    add("--warmup-epochs", type=finite_float, default=0.0, metavar="E",
        help="ramp the rate up linearly over the first E epochs (may be fractional); default 0")
    add("--lr-decay-epochs", type=_int_list("epochs", "5,8"), default=None, metavar="E1,E2",
        help="step schedule: the epochs after which the rate decays; default half and three quarters of --epochs")
    add("--lr-decay", type=finite_float, default=None, metavar="F",
        help="step schedule: what the rate is multiplied by at each decay, in (0, 1]; default 0.1")
    add("--clip-norm", type=positive_float, default=None, metavar="N",
        help="clip the gradient by its global norm (of the mean gradient over the global batch) to N > 0")
    add("--accumulate", type=int, default=1, metavar="N",
        help="run each batch as N micro-batches one after another, summing their gradients, before one update "
             "(1 to --batch-size); default 1")
    add("--zero", type=int, choices=list(ZERO_LEVELS), default=0,
        help="0: optimizer state on every device; 1: each device keeps and updates its shard of the state "
             "(ZeRO-1); 2: the gradients are reduce-scattered too (ZeRO-2); 3: the parameters sharded too, gathered "
             "a block at a time and recomputed in backward (ZeRO-3, FSDP); over the data replicas (and workers) of "
             "every layout; default 0")
    add("--recompute", action="store_true",
        help="activation recomputation: keep only each block's input (LeNet's layers, ResNet-18's residual blocks, "
             "the ViT's and the Transformer's children) and compute its forward again during backward; the same gradients, less memory, about one more "
             "forward pass a step; every layout")


def _default_decay_epochs(epochs):
    """The step schedule's decays when none are given: after half and three quarters of the epochs."""
    return sorted({e for e in (round(epochs * 0.5), round(epochs * 0.75)) if 1 <= e < epochs})


def check_optimizer_args(args):
    """Check the optimizer's flags without MXNet; fill in the defaults that depend on the optimizer."""
    defaults = optimizer_defaults(args.optimizer)
    args.lr = defaults["lr"] if args.lr is None else args.lr
    args.wd = defaults["wd"] if args.wd is None else args.wd
    with users_input(ValueError, TypeError, flags=FLAGS):
        check_hyper(args.optimizer, args.momentum, args.nesterov, args.wd, args.clip_norm)
    if not 0 <= args.warmup_epochs < args.epochs:
        raise UsageError(f"--warmup-epochs must be at least 0 and less than --epochs ({args.epochs}), "
                         f"got {args.warmup_epochs:g}")
    if args.lr_schedule != "step" and (args.lr_decay_epochs is not None or args.lr_decay is not None):
        raise UsageError("--lr-decay-epochs and --lr-decay apply to --lr-schedule step")
    if args.lr_schedule == "step":
        args.lr_decay = 0.1 if args.lr_decay is None else args.lr_decay
        if args.lr_decay_epochs == []:
            raise UsageError("--lr-decay-epochs needs at least one epoch to decay after, such as 5 or 5,8; got an "
                             "empty list (for no decay, use --lr-schedule constant)")
        epochs = _default_decay_epochs(args.epochs) if args.lr_decay_epochs is None else args.lr_decay_epochs
        if args.lr_decay_epochs is None and len(epochs) < 2:   # half and three quarters fell on one epoch, or none
            print(f"warning: --epochs {args.epochs} leaves " +
                  (f"one decay of the default two (after half and three quarters of the epochs): after epoch "
                   f"{epochs[0]}" if epochs else "no epoch to decay after: the rate stays constant") +
                  "; give --lr-decay-epochs to choose", file=sys.stderr, flush=True)
        if any(not 1 <= e < args.epochs for e in epochs) or any(a >= b for a, b in zip(epochs, epochs[1:])):
            where = (f"strictly increasing epochs in 1..{args.epochs - 1}" if args.epochs > 1 else
                     "epochs before the last, and --epochs 1 has none")
            raise UsageError(f"--lr-decay-epochs must be {where} (a decay after the last epoch would change "
                             f"nothing), got {epochs}")
        args.lr_decay_epochs = epochs
        with users_input(ValueError, TypeError, flags=FLAGS):   # the decay, and the rate it leads to, MXNet takes
            Step(epochs, args.lr_decay).check_rates(args.lr)


def check_args(args):
    """Check parsed ``args`` as far as can be done without MXNet, with the rules ``fit`` and ``make_strategy`` use
    (``parallel.config``); raise ``UsageError`` naming the flag."""
    for flag, value in (("--data-dir", args.data_dir), ("--checkpoint-dir", args.checkpoint_dir),
                        ("--export", args.export), ("--metrics-json", args.metrics_json), ("--plot", args.plot),
                        ("--trace", args.trace), ("--logdir", args.logdir)):
        if value == "":
            raise UsageError(f"{flag} needs a path, got an empty string")
    check_model_args(args)
    if args.commit_every < 1:   # a bad value is refused as one wherever it is given
        raise UsageError(f"--commit-every must be >= 1, got {args.commit_every}")
    check_scopes(args)   # before the layout's checks: their advice assumes each flag applies
    with users_input(ValueError, TypeError, flags=FLAGS):
        run_config(args)
        layout_of_args(args).check(model=args.model, batch_size=args.batch_size)
    check_optimizer_args(args)
    with users_input(ValueError, TypeError, flags=FLAGS):
        check_lr(args.lr)
        if args.bucket_mb is not None:
            check_number(args.bucket_mb, "bucket_mb", positive=True)
        check_int(args.compression_warmup, "compression_warmup", low=0)
    if args.compression_warmup and args.compression == "none":
        raise UsageError("--compression-warmup applies to a --compression; without one every sum is uncompressed")
    if args.data_dir is not None and args.dataset == "synthetic":
        raise UsageError("--data-dir applies to --dataset fashion-mnist, not synthetic")
    if args.data_dir is not None and not os.path.isdir(args.data_dir):   # a typo, not a place to download into
        what = "is not a directory" if os.path.exists(args.data_dir) else "does not exist"
        raise UsageError(f"--data-dir {args.data_dir!r} {what}; give the directory that holds the four IDX files, "
                         "create it first to download Fashion-MNIST there, or leave --data-dir out for the default")
    if args.train_size is not None and args.train_size < 1:
        raise UsageError(f"--train-size must be >= 1, got {args.train_size}")
    if args.checkpoint_every is not None and args.checkpoint_dir is None:
        raise UsageError("--checkpoint-every needs --checkpoint-dir, the directory to write the checkpoints in")
    if args.resume and args.checkpoint_dir is None:
        raise UsageError("--resume needs --checkpoint-dir, the directory that holds the checkpoint")
    if args.kvstore is not None and not launched():
        raise UsageError("--kvstore applies to a distributed job: run python -m parallel.launch -n 2 python -m "
                         "parallel.train ...")
    if args.plot is not None:
        from .report import plot_format   # matplotlib, not MXNet
        with users_input(ValueError, flags=FLAGS):
            plot_format(args.plot)


def claim_outputs(args, stack):
    """Make sure every output of ``args`` can be written before training starts: create and lock
    ``--checkpoint-dir`` for the life of the run (``stack`` releases the lock), then check the other files.

    Raises ``UsageError`` naming the flag: a directory that cannot be created or written, one another run
    holds, an output that cannot be written or that two flags name.
    """
    args.checkpoint_lock = None
    if args.checkpoint_dir is not None:
        directory = args.checkpoint_dir
        if os.path.exists(directory) and not os.path.isdir(directory):
            raise UsageError(f"--checkpoint-dir {directory!r} is a file, not a directory")
        if not os.path.exists(directory):   # a run that ends before its first checkpoint leaves no empty directory
            stack.callback(_remove_if_empty, directory)
            remove_if_empty_at_exit(directory)   # also when it must end at once (a signal, in a job)
        try:
            os.makedirs(directory, exist_ok=True)
            os.close(os.open(os.path.join(directory, LOCK_FILE), os.O_WRONLY | os.O_CREAT, 0o666))   # writable?
            args.checkpoint_lock = stack.enter_context(DirectoryLock(directory, os.environ.get(JOB_ENV),
                                                                     restart_count()))
        except OSError as e:
            raise UsageError(f"--checkpoint-dir {directory!r} cannot hold the checkpoint: "
                             f"{e.strerror or e}") from None
        except DirectoryLocked as e:
            raise UsageError(f"--checkpoint-dir {e}") from None
    outputs = [(path, flag) for path, flag in ((args.metrics_json, "--metrics-json"), (args.plot, "--plot"),
                                                (export_files(args.export)[1], "--export"), (args.trace, "--trace"))
               if path is not None]
    for path, flag in outputs:
        with users_input(ValueError, flags={}):
            check_writable(path, flag)
    for i, (path, flag) in enumerate(outputs):
        for other, other_flag in outputs[i + 1:]:
            if os.path.realpath(path) == os.path.realpath(other):
                raise UsageError(f"{flag} and {other_flag} both name {path!r}; give each its own file")
    if args.logdir is not None:
        _claim_logdir(args.logdir, outputs)


def _claim_logdir(logdir, outputs):
    """Create ``--logdir`` (a directory TensorBoard's event files can be written in) unless it exists; no other
    output file may be it. ``UsageError`` naming the flag."""
    for path, flag in outputs:
        if os.path.realpath(path) == os.path.realpath(logdir):
            raise UsageError(f"{flag} and --logdir both name {path!r}; give the event files a directory of their own")
    try:
        os.makedirs(logdir, exist_ok=True)
        if not os.access(logdir, os.W_OK | os.X_OK):
            raise PermissionError(13, "Permission denied")
    except OSError as e:
        raise UsageError(f"--logdir {logdir!r} cannot hold TensorBoard's event files: {e.strerror or e}") from None


def _remove_if_empty(directory):
    """Remove ``directory`` if it is empty (it was created for a run that wrote nothing there)."""
    with contextlib.suppress(OSError):
        os.rmdir(directory)   # fails, as it should, on a directory that holds anything


def _use_every_core():
    """Set ``OMP_NUM_THREADS`` to every core and MXNet's engine settings (``parallel.threads.engine_settings``),
    each unless the user set it; MXNet reads them when imported, so this only has an effect before the first
    ``import mxnet`` in this process."""
    if "mxnet" not in sys.modules:
        for name, value in engine_settings().items():
            os.environ.setdefault(name, value)


def _resume_command(argv):
    """The command that continues this run: the same arguments, with ``--resume``."""
    words = list(argv) + ([] if "--resume" in argv else ["--resume"])
    return "python -m parallel.train " + " ".join(shlex.quote(w) for w in words)


class _Stopped(Exception):
    """Training stopped cleanly on a signal; ``main`` prints ``line`` and returns ``status``."""

    def __init__(self, line, status):
        super().__init__(line)
        self.line, self.status = line, status


def run(args, stack):
    """Train as the checked ``args`` say, a step at a time (see ``parallel.train_steps``): join the job (in one
    launched by ``parallel.launch``), claim the outputs, read the checkpoint, lay the model out, load the data,
    train, export. ``stack`` holds what lives as long as the run (the checkpoint directory's lock).

    Raises ``UsageError`` for input the user controls (devices, layout, data, output files, divergence).
    """
    with hold_interrupts():   # imports MXNet
        import_mxnet_without_scipy_stats()
        from . import train_steps as steps
    job = steps.join_job(args)
    if job is not None:   # a signal ends a worker at once, leaving nothing it was writing (no lock file)
        stack.enter_context(end_on_signals())
    if job is not None and job.rank == 0:   # one process alone claimed its outputs before MXNet started
        claim_outputs(args, stack)
    checkpoint = steps.read_checkpoint(args, job)
    ctx_list = steps.devices(args)
    initial, strategy = steps.lay_out(args, checkpoint, ctx_list, job)   # before the data: a bad layout fails fast
    steps.check_trace(args, strategy)
    dataset, data_name = steps.load_dataset(args, job)
    optimizer = steps.optimizer_of(args, dataset)
    record = steps.checkpoint_record(args, strategy, optimizer, dataset, data_name, job)
    steps.check_resume(checkpoint, record, dataset)
    report = steps.open_report(args, strategy, optimizer, dataset, data_name, job)
    steps.announce_start(args, checkpoint, report)
    with (stop_between_batches() if job is None else contextlib.nullcontext()) as stop:
        try:
            steps.train(args, strategy, optimizer, dataset, checkpoint, stop, report, record)
        except steps.TrainingStopped as e:
            raise _Stopped(report.stopped(e.state, args.checkpoint_dir, _resume_command(args.argv)),
                           128 + stop.signum) from None
    steps.export(args, strategy, initial, report)
    steps.announce_trace(args, job, report)


def main(argv=None):
    """Entry point of ``python -m parallel.train``; returns the process exit status.

    0 when training finished; 2 with one ``error:`` line on stderr for input the user controls (a failed
    checkpoint write too). A first Ctrl-C or SIGTERM during training stops at the next batch boundary, writes
    the checkpoint, metrics and plot, prints one line with the command that resumes, and returns 130 or 143;
    a second one (or Ctrl-C before training starts) stops at once: ``error: interrupted``, 130, even while
    the process waits inside MXNet. A bug in the package is not caught: its traceback is shown and Python
    exits with 1.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    _interrupts_raise()
    try:
        args = build_parser().parse_args(argv)
        args.argv = argv
        check_args(args)
        with contextlib.ExitStack() as stack:
            stack.enter_context(warning_lines())   # a warning is one "warning: ..." line, as the command's own
            if not launched():   # in a job, rank 0 alone writes, and claims its outputs once it knows its rank
                claim_outputs(args, stack)
            _use_every_core()
            run(args, stack)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return USAGE_STATUS
    except _Stopped as e:
        print(e.line, file=sys.stderr)
        return e.status
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return INTERRUPTED_STATUS
    return 0


def _interrupts_raise():
    """From here on Ctrl-C raises ``KeyboardInterrupt`` (Python's default), which ``main`` turns into its line;
    undoes ``_interrupted_while_importing``."""
    import signal
    if signal.getsignal(signal.SIGINT) is _interrupted_while_importing:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def main_in_job():
    """``main`` for a worker of a distributed job (what ``python -m parallel.train`` runs when the launcher started
    it, and what a wrapper of the command calls in its place): a failure ends the process at once (``abandon``),
    not in ps-lite's shutdown, which would wait for the other workers while they wait for this one. Returns
    ``main``'s exit status when it is 0."""
    from .job import abandon
    status = main()
    if status != 0:
        abandon(status)
    return status


if __name__ == "__main__":
    sys.exit(main_in_job() if launched() else main())
