"""Train LeNet (or ResNet-18) on Fashion-MNIST with data parallelism written from scratch, or with the other
parallel styles.

Run::

    python -m parallel.train --devices cpu:2 --epochs 10
    python -m parallel.train --dataset synthetic --epochs 2 --metrics-json m.json --plot curves.png
    python -m parallel.train --devices cpu:2 --strategy pipeline --stages 2 --micro-batches 4
    python -m parallel.train --devices cpu:4 --strategy hybrid --boundaries 2
    python -m parallel.launch -n 2 python -m parallel.train --devices cpu:1 --epochs 10

The last one trains one model in two processes (started by ``parallel.launch``, joined through MXNet's
distributed kvstore): ``--batch-size`` stays the global batch, each worker trains its slice, and rank 0
alone prints the epochs and writes the metrics, plot, checkpoints and export.

Every strategy runs the same SGD step on the same batches: the same ``--seed`` gives the same loss curve.
``--model resnet18`` trains the textbook's ResNet-18 (a gluon block, 11.2 million parameters, BatchNorm) the same
ways instead of LeNet; on a CPU it costs a few hundred times LeNet's time per example.

The arguments are parsed and checked before MXNet is imported, so ``--help`` and argument errors answer at
once; then, unless ``OMP_NUM_THREADS`` is set, the command sets it to every core (MXNet reads it when it is
imported; see ``parallel.settings.recommended_omp_threads``) and imports MXNet, once.

Each epoch prints one line in the textbook's form; ``--metrics-json`` and ``--plot`` are rewritten
atomically after every epoch. Input the user controls that cannot work (an argument, the data, an output
path, a learning rate that diverges) exits with status 2 and a one-line ``error:`` message; Ctrl-C exits
with 130 (in a distributed job, a signal ends the worker at once; the launcher reports it). Anything else
is a bug in the package and ends with Python's traceback (status 1).
"""
import argparse
import contextlib
import math
import os
import sys

from .interrupt import INTERRUPTED_STATUS, end_on_signals, hold_interrupts, stop_between_batches
from .settings import (ALLREDUCE_NAMES, DEFAULT_ALGORITHM, DEFAULT_MICRO_BATCHES, LR_RANGE, MAX_SEED, STRATEGIES,
                       recommended_omp_threads)

__all__ = ["main", "build_parser", "check_args", "run", "UsageError", "MODELS"]

#: ``--model``'s choices: ``parallel.checkpoint.MODELS`` (which imports MXNet), spelled out here so that
#: ``--help`` and argument errors answer before MXNet starts; a test keeps the two equal.
MODELS = ("lenet", "resnet18")
#: How the messages name each model (``parallel.training.MODEL_TITLES``).
_TITLES = {"lenet": "LeNet", "resnet18": "ResNet-18"}


class UsageError(Exception):
    """Input the user controls cannot work; ``main`` prints the message on one line and returns 2.

    Deliberately not a ``ValueError``: a ``ValueError`` escaping from the package's own code is a bug and
    must show its traceback, not pass for the user's mistake.
    """


class _Parser(argparse.ArgumentParser):
    def error(self, message):   # one line, no usage dump: main() prints "error: ..." and returns 2
        raise UsageError(message)


def _finite_float(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not finite")
    return value


def _layer_indices(text):
    try:
        return [int(part) for part in text.split(",")] if text.strip() else []
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of layer indices "
                                         "such as 2 or 1,3") from None


def build_parser():
    """The argument parser of ``python -m parallel.train`` (it imports nothing heavy)."""
    parser = _Parser(prog="python -m parallel.train",
                     description="Train LeNet or ResNet-18 with data parallelism written from scratch on MXNet.")
    parser.add_argument("--model", choices=MODELS, default="lenet",
                        help="lenet: the textbook's LeNet, from scratch; resnet18: the textbook's ResNet-18 for "
                             "28x28 images (a gluon block with BatchNorm, statistics over the whole batch across "
                             "one process's devices; in a distributed job each worker keeps its own); default "
                             "lenet")
    parser.add_argument("--devices", default="auto",
                        help="'auto' (all GPUs, else one CPU context), 'cpu:N' (N CPU contexts) or "
                             "'gpu:I,J,...' (GPU indices as CUDA_VISIBLE_DEVICES numbers them); default auto")
    parser.add_argument("--epochs", type=int, default=10, help="number of epochs (>= 1); default 10")
    parser.add_argument("--batch-size", type=int, default=256,
                        help="global batch size, split across the devices (>= 1); default 256")
    parser.add_argument("--lr", type=_finite_float, default=0.2,
                        help=f"learning rate (> 0, at most {LR_RANGE[1]:.2e}); default 0.2")
    parser.add_argument("--dataset", choices=["fashion-mnist", "synthetic"], default="fashion-mnist",
                        help="default fashion-mnist (downloaded when missing)")
    parser.add_argument("--data-dir", default=None,
                        help="directory of the four IDX files of an MNIST-format dataset, raw or .gz "
                             "(default $MXNET_HOME/datasets/fashion-mnist, i.e. ~/.mxnet/...)")
    parser.add_argument("--allreduce", choices=sorted(ALLREDUCE_NAMES), default=DEFAULT_ALGORITHM,
                        help=f"how gradients are summed across devices; default {DEFAULT_ALGORITHM}")
    parser.add_argument("--strategy", choices=STRATEGIES, default="data",
                        help="data: a replica per device; model: the model cut into stages, one per device; "
                             "pipeline: micro-batches through the stages; hybrid: data parallelism over "
                             "groups of stages; default data")
    parser.add_argument("--stages", type=int, default=None,
                        help="model/pipeline/hybrid: cut the model's layers (LeNet's 4, ResNet-18's 7 children) "
                             "into N stages as evenly as possible (default 2)")
    parser.add_argument("--boundaries", type=_layer_indices, default=None, metavar="I,J",
                        help="model/pipeline/hybrid: instead of --stages, the layer indices where stages start, "
                             "e.g. 2 (conv | dense) or 1,3; LeNet's layers are 0 conv1, 1 conv2, 2 dense1, "
                             "3 dense2; ResNet-18's children are 0 stem (conv, BatchNorm, ReLU), 1-4 its four "
                             "stages of residual blocks (64, 128, 256, 512 channels), 5 pooling, 6 dense")
    parser.add_argument("--micro-batches", type=int, default=None, metavar="M",
                        help=f"pipeline: micro-batches per batch, at most --batch-size "
                             f"(default {DEFAULT_MICRO_BATCHES}); a shorter last batch uses one per example")
    parser.add_argument("--seed", type=int, default=0,
                        help=f"seeds initial parameters and shuffling, 0 to {MAX_SEED}; default 0")
    parser.add_argument("--metrics-json", metavar="PATH", help="write per-epoch metrics as JSON")
    parser.add_argument("--plot", metavar="PATH",
                        help="write loss and accuracy curves; the suffix names the format (.png, .pdf, .svg, ...)")
    parser.add_argument("--checkpoint-dir", metavar="DIR",
                        help="write a checkpoint there after every epoch and when interrupted (Ctrl-C, SIGTERM)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the checkpoint in --checkpoint-dir (any strategy or devices; "
                             "--epochs may grow)")
    parser.add_argument("--export", metavar="PREFIX",
                        help="write the trained model as MXNet's PREFIX-symbol.json + PREFIX-0000.params "
                             "(gluon.SymbolBlock.imports reads it)")
    parser.add_argument("--kvstore", choices=["dist_sync", "dist_device_sync"], default=None,
                        help="under python -m parallel.launch: the distributed kvstore that sums the workers' "
                             "gradients; default dist_sync (dist_device_sync for GPUs)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    return parser


def _launched():
    """Whether this process is a worker that ``python -m parallel.launch`` started (a distributed job)."""
    return os.environ.get("DMLC_ROLE") == "worker"


def _check_output(path, flag):
    """Raise ``UsageError`` unless a file can be created at ``path``."""
    from .files import check_writable
    if path == "":
        raise UsageError(f"{flag} needs a file name, got an empty string")
    try:
        check_writable(path, flag)
    except ValueError as e:
        raise UsageError(str(e)) from None


def check_args(args):
    """Check parsed ``args`` as far as can be done without MXNet; raise ``UsageError`` naming the flag."""
    if args.epochs < 1:
        raise UsageError(f"--epochs must be >= 1, got {args.epochs}")
    if args.batch_size < 1:
        raise UsageError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.lr <= 0:
        raise UsageError(f"--lr must be > 0, got {args.lr}")
    if not LR_RANGE[0] <= args.lr <= LR_RANGE[1]:
        raise UsageError(f"--lr must be between {LR_RANGE[0]:.2e} and {LR_RANGE[1]:.2e} (float32's normal "
                         f"range, which MXNet's update takes), got {args.lr}")
    if not 0 <= args.seed <= MAX_SEED:
        raise UsageError(f"--seed must be between 0 and {MAX_SEED}, got {args.seed}")
    if args.data_dir is not None and args.dataset == "synthetic":
        raise UsageError("--data-dir applies to --dataset fashion-mnist, not synthetic")
    if args.data_dir == "":
        raise UsageError("--data-dir needs a directory, got an empty string")
    if args.strategy == "data" and (args.stages is not None or args.boundaries is not None):
        flag = "--stages" if args.stages is not None else "--boundaries"
        raise UsageError(f"{flag} applies to --strategy model, pipeline or hybrid, not data")
    if args.stages is not None and args.boundaries is not None:
        raise UsageError("give --stages or --boundaries, not both")
    if args.micro_batches is not None and args.strategy != "pipeline":
        raise UsageError(f"--micro-batches applies to --strategy pipeline, not {args.strategy}")
    if args.micro_batches is not None and not 1 <= args.micro_batches <= args.batch_size:
        raise UsageError(f"--micro-batches must be between 1 and --batch-size ({args.batch_size}), "
                         f"got {args.micro_batches}")
    if args.resume and args.checkpoint_dir is None:
        raise UsageError("--resume needs --checkpoint-dir, the directory that holds the checkpoint")
    if args.checkpoint_dir is not None:
        if args.checkpoint_dir == "":
            raise UsageError("--checkpoint-dir needs a directory, got an empty string")
        if os.path.exists(args.checkpoint_dir) and not os.path.isdir(args.checkpoint_dir):
            raise UsageError(f"--checkpoint-dir {args.checkpoint_dir!r} is a file, not a directory")
    if args.export is not None and args.export == "":
        raise UsageError("--export needs a path prefix such as out/lenet, got an empty string")
    if args.kvstore is not None and not _launched():
        raise UsageError("--kvstore applies to a distributed job: run python -m parallel.launch -n 2 python -m "
                         "parallel.train ...")
    if _launched() and args.strategy != "data":
        raise UsageError(f"a distributed job trains with --strategy data, not {args.strategy}; run the "
                         f"{args.strategy} strategy in one process")
    if not _launched():   # in a job, rank 0 alone writes, and checks once it knows its rank
        check_outputs(args)


def check_outputs(args):
    """Raise ``UsageError`` unless every output file of ``args`` can be written, each its own file."""
    outputs = [(path, flag) for path, flag in ((args.metrics_json, "--metrics-json"), (args.plot, "--plot"),
                                                (_export_files(args.export)[1], "--export"))
               if path is not None]
    for path, flag in outputs:
        _check_output(path, flag)
    for i, (path, flag) in enumerate(outputs):
        for other, other_flag in outputs[i + 1:]:
            if os.path.realpath(path) == os.path.realpath(other):
                raise UsageError(f"{flag} and {other_flag} both name {path!r}; give each its own file")


def _export_files(prefix):
    """The files ``--export PREFIX`` writes (symbol, params), or (None, None)."""
    return (None, None) if prefix is None else (f"{prefix}-symbol.json", f"{prefix}-0000.params")


@contextlib.contextmanager
def _users_input(*errors):
    """Turn ``errors`` raised inside the block, which can only come from the user's input, into ``UsageError``."""
    try:
        yield
    except errors as e:
        raise UsageError(str(e)) from None


class _Stopped(Exception):
    """Training stopped cleanly on a signal; ``main`` prints ``line`` and returns ``status``."""

    def __init__(self, line, status):
        super().__init__(line)
        self.line, self.status = line, status


def _resume_command(argv):
    """The command that continues this run: the same arguments, with ``--resume``."""
    import shlex
    words = list(argv) + ([] if "--resume" in argv else ["--resume"])
    return "python -m parallel.train " + " ".join(shlex.quote(w) for w in words)


def _use_every_core():
    """Set ``OMP_NUM_THREADS`` to every core unless the user set it; MXNet reads it when imported, so this
    only has an effect before the first ``import mxnet`` in this process."""
    if "OMP_NUM_THREADS" not in os.environ and "mxnet" not in sys.modules:
        os.environ["OMP_NUM_THREADS"] = str(recommended_omp_threads())


def _describe_data(args):
    from .data import default_data_dir, identify_dataset
    if args.dataset == "synthetic":
        return "synthetic"
    data_dir = default_data_dir() if args.data_dir is None else args.data_dir
    if identify_dataset(data_dir) == "fashion-mnist":
        return "fashion-mnist" if args.data_dir is None else f"fashion-mnist ({data_dir})"
    return f"the MNIST-format files in {data_dir}"


def run(args):
    """Train as the checked ``args`` say: load MXNet and the data, lay the model out, fit, report each epoch.

    In a distributed job (a worker of ``python -m parallel.launch``), join it first; rank 0 alone reads the
    checkpoint (and broadcasts it), prints and writes. Raises ``UsageError`` for input the user controls
    (devices, layout, data, output files, divergence).
    """
    with hold_interrupts():   # imports MXNet
        from .checkpoint import (CheckpointError, check_compatible, dataset_fingerprint, has_checkpoint,
                                 load_checkpoint, save_checkpoint)
        from .data import DataError
        from .devices import parse_devices
        from .export import export_gluon, export_lenet
        from .kvstore import join, sum_values
        from .training import (NonFiniteLossError, TrainingStopped, fit, format_epoch, init_model, load_data,
                               make_strategy, plot_format, plot_metrics, write_metrics)

    job = join(args.kvstore or "dist_sync") if _launched() else None   # waits for every worker and server
    main_rank = job is None or job.rank == 0   # the one that reads, prints and writes
    workers = 1 if job is None else job.num_workers
    if job is not None:
        print(f"joined the job as rank {job.rank} of {workers} ({job.kv.type})", flush=True)
        if main_rank:
            check_outputs(args)
    checkpoint = None
    if args.checkpoint_dir is not None and main_rank:
        with _users_input(CheckpointError):
            if args.resume:
                checkpoint = load_checkpoint(args.checkpoint_dir, model=args.model)
                if checkpoint.state.epoch - 1 > args.epochs:
                    raise UsageError(f"--epochs {args.epochs} is fewer than the {checkpoint.state.epoch - 1} epochs "
                                     f"the checkpoint in {args.checkpoint_dir} has finished; give --epochs "
                                     f"{checkpoint.state.epoch - 1} or more")
            elif has_checkpoint(args.checkpoint_dir):
                raise UsageError(f"{args.checkpoint_dir} already holds a checkpoint; add --resume to continue it, "
                                 "or choose another --checkpoint-dir to start a new run")
    with _users_input(ValueError):
        if args.plot is not None:
            plot_format(args.plot)
        ctx_list = parse_devices(args.devices)
    progress = not args.no_progress and main_rank
    with _users_input(DataError):
        if job is not None and not main_rank:   # one download at a time: rank 0 fetches, then the others read
            sum_values(job, [0])
        dataset = load_data(args.dataset, args.data_dir, progress=progress)
        data_name = _describe_data(args)
        if job is not None and main_rank:
            sum_values(job, [0])
    title = _TITLES[args.model]
    with _users_input(ValueError):
        if checkpoint is None:
            initial = init_model(args.model, args.seed)   # in a job, replaced by rank 0's in make_strategy
        else:
            initial = init_model(args.model, args.seed, checkpoint.params, checkpoint.aux)
        strategy = make_strategy(args.strategy, initial, ctx_list, args.stages, args.boundaries, args.micro_batches,
                                 args.batch_size, args.allreduce, job)   # in a job: every replica gets rank 0's
    used = strategy.ctx_list
    if len(used) < len(ctx_list):
        idle = ", ".join(str(ctx) for ctx in ctx_list[len(used):])
        print(f"warning: --strategy {args.strategy} uses {len(used)} of the {len(ctx_list)} contexts of "
              f"--devices {args.devices} (one per stage); {idle} stay idle", file=sys.stderr, flush=True)
    # the dataset's fingerprint hashes every example: only a run that checkpoints needs it
    fingerprint = None if args.checkpoint_dir is None or not main_rank else dataset_fingerprint(dataset)
    config = {"model": args.model, "dataset": {"name": args.dataset, "fingerprint": fingerprint},
              "batch_size": args.batch_size, "lr": args.lr, "seed": args.seed, "epochs": args.epochs,
              "strategy": args.strategy, "allreduce": args.allreduce, "devices": args.devices,
              "stages": args.stages, "boundaries": args.boundaries, "micro_batches": args.micro_batches,
              "workers": workers}
    if checkpoint is not None:
        with _users_input(CheckpointError):
            check_compatible(checkpoint.config, config)

    def say(line):
        if main_rank:
            print(line, flush=True)

    layout = f"{len(used)} context(s)" if job is None else f"{workers} worker(s) x {len(used)} context(s)"
    say(f"training {title} on {data_name}: {len(dataset.train_labels)} train / {len(dataset.test_labels)} test "
        f"examples, batch {args.batch_size}, lr {args.lr}, on {layout}")
    say(f"strategy {strategy.name}: {strategy.description}; operator threads: OMP_NUM_THREADS="
        f"{os.environ.get('OMP_NUM_THREADS', 'unset (MXNet default: half the cores)')}")

    def write_plot(history, path):
        plot_metrics(history, path, title=f"{title} on {data_name}, {strategy.name} parallel on {layout}")

    def on_epoch(metrics, history):
        say(format_epoch(metrics, used, strategy.name, workers))
        write_outputs(history)

    def write_outputs(history):
        if not main_rank:
            return
        for path, flag, write in ((args.metrics_json, "--metrics-json", write_metrics),
                                  (args.plot, "--plot", write_plot)):
            if path is not None:
                try:
                    write(history, path)
                except OSError as e:   # the disk filled up or the directory went away mid-run
                    raise UsageError(f"cannot write {flag} {path!r}: {e.strerror or e}") from None

    def save(state, params, aux):
        if args.checkpoint_dir is None or not main_rank:
            return
        try:
            save_checkpoint(args.checkpoint_dir, params, state, config, aux=aux, model=args.model)
        except OSError as e:   # a full disk, a file size limit: the previous checkpoint is intact
            raise UsageError(f"cannot write the checkpoint in {args.checkpoint_dir!r} ({e.strerror or e}); the "
                             "previous checkpoint there is intact") from None

    start = None if checkpoint is None else checkpoint.state
    if start is not None and start.epoch > args.epochs:
        say(f"the checkpoint in {args.checkpoint_dir} has finished all {args.epochs} epochs; nothing to train "
            "(give a larger --epochs to train further)")
    elif start is not None:
        say(f"resuming from {checkpoint.path}: epoch {start.epoch}, after {start.batch} batch(es)")
    with (stop_between_batches() if job is None else end_on_signals()) as stop, _users_input(NonFiniteLossError):
        try:
            fit(dataset, ctx_list, args.epochs, args.batch_size, args.lr, seed=args.seed, algorithm=args.allreduce,
                progress=progress, on_epoch=on_epoch, strategy=strategy, start=start, stop=stop,
                on_checkpoint=save)
        except TrainingStopped as e:
            if e.state.history:
                write_outputs(e.state.history)
            where = f"stopped at epoch {e.state.epoch} after {e.state.batch} batch(es)"
            if args.checkpoint_dir is None:
                line = f"{where}; no --checkpoint-dir, so there is nothing to resume from"
            else:
                line = f"{where}; checkpoint in {args.checkpoint_dir}. Resume with: {_resume_command(args.argv)}"
            raise _Stopped(line, 128 + stop.signum) from None
    if args.export is not None and main_rank:
        try:
            if args.model == "lenet":
                export_lenet(strategy.params(), args.export)
            else:   # into the initial block (unused since make_strategy copied it), then gluon's export
                export_gluon(initial, args.export, strategy.params(), strategy.aux())
        except OSError as e:
            raise UsageError(f"cannot write --export {args.export!r}: {e.strerror or e}") from None
        print(f"exported {title} to {' and '.join(_export_files(args.export))}", flush=True)


def main(argv=None):
    """Entry point of ``python -m parallel.train``; returns the process exit status.

    0 when training finished; 2 with one ``error:`` line on stderr for input the user controls (a failed
    checkpoint write too). A first Ctrl-C or SIGTERM during training stops at the next batch boundary, writes
    the checkpoint, metrics and plot, prints one line with the command that resumes, and returns 130 or 143;
    a second one (or Ctrl-C before training starts) stops at once: ``error: interrupted``, 130. A bug in the
    package is not caught: its traceback is shown and Python exits with 1.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = build_parser().parse_args(argv)
        args.argv = argv
        check_args(args)
        _use_every_core()
        run(args)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except _Stopped as e:
        print(e.line, file=sys.stderr)
        return e.status
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return INTERRUPTED_STATUS
    return 0


def _main_in_job():
    """``main`` for a worker of a distributed job: a failure ends the process at once (``abandon``), not in
    ps-lite's shutdown, which would wait for the other workers while they wait for this one."""
    from .kvstore import abandon
    status = main()
    if status != 0:
        abandon(status)
    return status


if __name__ == "__main__":
    sys.exit(_main_in_job() if _launched() else main())
