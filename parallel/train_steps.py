"""The steps of ``python -m parallel.train`` once MXNet is loaded, in the order ``parallel.train.run`` takes them.

Each step takes the checked command-line ``args`` and what the earlier steps gave; each turns the user's
mistakes into one ``UsageError`` line naming the flag. In a distributed job every worker takes every step;
rank 0 alone reads the checkpoint (and broadcasts it), prints and writes.
"""
import dataclasses
import math
import os
import sys
import time

from .checkpoint import (CheckpointError, CheckpointWriteError, CheckpointWriter, check_compatible, read_all,
                         check_run_config, dataset_fingerprint, has_checkpoint, load_checkpoint,
                         load_checkpoint_bytes, packer)
from .cli import UsageError, job_hosts, launched, restart_count, shows_progress, users_input
from .comm import bucket_mb_for
from .comm.algorithms import free_buffers
from .comm.reducer import Reducer
from .config import FLAGS, layout_of_args, run_config
from .data import DataError, identify_dataset, load_data, num_batches
from .data.fashion_mnist import default_data_dir
from .devices import parse_devices
from .fit import NonFiniteLossError, TrainingStopped, check_start, fit, memory_of
from .job import join, sum_values
from .models import model_info
from .models.layout import init_model
from .optim import SGD, Constant, Cosine, Step, make_optimizer
from .files import export_files
from .handover import ELASTIC_ENV, STATE_ENV, StateServer, fetch_state, parse_address
from .report import Report
from .strategies import make_strategy
from .trace import check_traceable, worker_path

__all__ = ["join_job", "read_checkpoint", "devices", "check_trace", "load_dataset", "schedule_of", "optimizer_of",
           "lay_out", "checkpoint_record", "check_resume", "open_report", "announce_start", "train", "export",
           "announce_trace", "TrainingStopped"]


def join_job(args):
    """Join the distributed job this worker was launched into (waits for every worker and server), or None."""
    if not launched():
        return None
    job = join(args.kvstore or "dist_sync")
    job.statistics = args.batchnorm_stats
    print(f"joined the job as rank {job.rank} of {job.num_workers} ({job.kv.type})", flush=True)
    return job


def elastic():
    """Whether this worker belongs to an elastic job (``python -m parallel.launch -n MIN:MAX`` or
    ``--host-discovery-script``): it commits its state in memory and serves it (``parallel.handover``)."""
    return os.environ.get(ELASTIC_ENV) == "1"


def read_checkpoint(args, job):
    """The checkpoint to resume (rank 0 reads it), or None; refuse a new run over an existing checkpoint. In an
    elastic job started again after a change, the state a live worker committed (``PARALLEL_ELASTIC_STATE``), or
    the checkpoint in ``--checkpoint-dir`` if that one is further on (``args.handed_over`` says which)."""
    args.handed_over = False
    if job is not None and job.rank != 0:
        return None
    handed = _handed_over(args)
    on_disk = _on_disk(args)
    later = on_disk is not None and (handed is None or (on_disk.state.epoch, on_disk.state.batch) >
                                     (handed.state.epoch, handed.state.batch))
    args.handed_over = handed is not None and not later   # announce_start says which
    return on_disk if later else handed


def _handed_over(args):
    """The state the launcher holds for this start of an elastic job (``STATE_ENV``), or None."""
    address = os.environ.get(STATE_ENV)
    if not address:
        return None
    host, port = parse_address(address)
    began = time.monotonic()
    try:
        step, data = fetch_state(host, port)
    except OSError as e:
        raise RuntimeError(f"cannot fetch the job's state from the launcher at {address}: {e}") from None
    if step < 0:
        return None
    checkpoint = load_checkpoint_bytes(data, model=args.model, label=f"the state committed at step {step}")
    print(f"took the job's state of step {step} ({len(data) / 2**20:.1f} MiB) from the launcher in "
          f"{time.monotonic() - began:.2f} s", flush=True)
    return checkpoint


def _on_disk(args):
    """The checkpoint in ``--checkpoint-dir`` to resume, or None."""
    if args.checkpoint_dir is None:
        return None
    with users_input(CheckpointError):
        restarted = restart_count() > 0   # a job the launcher restarted continues where it was, if anywhere
        if not (args.resume or restarted and has_checkpoint(args.checkpoint_dir)):
            if has_checkpoint(args.checkpoint_dir):
                raise UsageError(f"{args.checkpoint_dir} already holds a checkpoint; add --resume to continue it, "
                                 "or choose another --checkpoint-dir to start a new run")
            return None
        checkpoint = load_checkpoint(args.checkpoint_dir, model=args.model)
    if checkpoint.state.epoch - 1 > args.epochs:
        raise UsageError(f"--epochs {args.epochs} is fewer than the {checkpoint.state.epoch - 1} epochs the checkpoint "
                         f"in {args.checkpoint_dir} has finished; give --epochs {checkpoint.state.epoch - 1} or more")
    return checkpoint


def devices(args):
    """The contexts of ``--devices``."""
    with users_input(ValueError, flags=FLAGS):
        return parse_devices(args.devices)


def check_trace(args, strategy):
    """``--trace`` records every context ``strategy`` computes on, or the run is refused before it starts."""
    if args.trace is not None:
        try:
            check_traceable(strategy.ctx_list)
        except ValueError as e:
            raise UsageError(f"--trace: {e}") from None


def describe_data(args):
    """How messages name the run's data: ``synthetic``, ``fashion-mnist`` (genuine files), or the MNIST-format
    files of a directory."""
    if args.dataset == "synthetic":
        return "synthetic"
    data_dir = default_data_dir() if args.data_dir is None else args.data_dir
    if identify_dataset(data_dir) == "fashion-mnist":
        return "fashion-mnist" if args.data_dir is None else f"fashion-mnist ({data_dir})"
    return f"the MNIST-format files in {data_dir}"


#: How the data errors' advice reads in the command's terms.
_DATA_ADVICE = (("use the synthetic dataset", "use --dataset synthetic"),
                ("the default directory, data_dir=None", "the default directory, without --data-dir"))


def load_dataset(args, job):
    """The dataset and how to name it. In a job rank 0 goes first, so that a download happens once."""
    main_rank = job is None or job.rank == 0
    try:
        if not main_rank:   # one download at a time: rank 0 fetches, then the others read
            sum_values(job, [0])
        dataset = load_data(args.dataset, args.data_dir, progress=shows_progress(args.no_progress, main_rank))
        if job is not None and main_rank:
            sum_values(job, [0])
    except DataError as e:   # the library's advice, in the command's terms
        message = str(e)
        for api, flag in _DATA_ADVICE:
            message = message.replace(api, flag)
        raise UsageError(message) from None
    if args.train_size is not None:   # its first N examples: a quick run, the test set whole
        if args.train_size > len(dataset.train_labels):
            raise UsageError(f"--train-size {args.train_size} is more than the {len(dataset.train_labels)} examples "
                             "of the training set")
        dataset = dataset._replace(train_images=dataset.train_images[:args.train_size],
                                   train_labels=dataset.train_labels[:args.train_size])
    return dataset, describe_data(args)


def schedule_of(args, per_epoch):
    """The learning-rate schedule of ``--lr-schedule``, in optimizer steps (``per_epoch`` a epoch), or None."""
    warmup = math.floor(args.warmup_epochs * per_epoch)   # < epochs * per_epoch, since --warmup-epochs < --epochs
    if args.lr_schedule == "cosine":
        return Cosine(args.epochs * per_epoch, warmup_steps=warmup)
    if args.lr_schedule == "step":
        return Step([e * per_epoch for e in args.lr_decay_epochs], args.lr_decay, warmup_steps=warmup)
    return Constant(warmup) if warmup else None


def optimizer_of(args, dataset):
    """The optimizer the flags describe, its schedule counted in the steps of this dataset's epochs (once the run
    is known to fit the dataset: ``RunConfig.check_fits``)."""
    with users_input(ValueError, flags=FLAGS):
        run_config(args).check_fits(len(dataset.train_labels))
    options = {"wd": args.wd, "clip_norm": args.clip_norm, "zero": args.zero,
               "schedule": schedule_of(args, num_batches(len(dataset.train_labels), args.batch_size))}
    if args.optimizer == "sgd":
        options.update(momentum=args.momentum, nesterov=args.nesterov)
    with users_input(ValueError, TypeError, flags=FLAGS):   # a rate of a step MXNet would refuse (Adam's lr * bias)
        return make_optimizer(args.optimizer, args.lr, **options)


def lay_out(args, checkpoint, ctx_list, job):
    """The initial model (the checkpoint's, else seeded) and the strategy that lays it out on ``ctx_list``. The
    allreduce's receive buffers of an earlier run in this process are dropped: the memory a run reports is its own."""
    free_buffers()
    with users_input(ValueError, TypeError, flags=FLAGS):
        if checkpoint is None:
            initial = init_model(args.model, args.seed)   # in a job, replaced by rank 0's in make_strategy
        else:
            initial = init_model(args.model, args.seed, checkpoint.params, checkpoint.aux)
        bucket_mb, why = (args.bucket_mb, "") if args.bucket_mb is not None else bucket_mb_for(job_hosts())
        why = why and f"{why}; --bucket-mb overrides"
        reducer = Reducer(args.allreduce, bucket_mb=bucket_mb, compression=args.compression, job=job,
                          bucket_note=why, warmup=args.compression_warmup, cross_barrier=args.cross_barrier)
        strategy = make_strategy(layout_of_args(args), initial, ctx_list, reducer=reducer,
                                 batch_size=args.batch_size)   # in a job: rank 0's
    _warn_idle_replicas(args, strategy, job)
    if args.zero and zero_shards(strategy) == 1:
        what = ("it only adds its gathers and a recomputed forward, and holds more than --zero 0 (docs/memory.md); "
                "ZeRO-3 shards over the data replicas of --devices and the workers of a job" if args.zero == 3 else
                f"ZeRO-{args.zero} shards the state over one process's data replicas of --devices")
        print(f"warning: --zero {args.zero} shards nothing here: one replica of the model; {what}", file=sys.stderr,
              flush=True)
    if len(strategy.ctx_list) < len(ctx_list):
        idle = ", ".join(str(ctx) for ctx in ctx_list[len(strategy.ctx_list):])
        print(f"warning: --strategy {args.strategy} uses {len(strategy.ctx_list)} of the {len(ctx_list)} contexts "
              f"of --devices {args.devices} (one per stage); {idle} stay idle", file=sys.stderr, flush=True)
    if args.compression != "none" and job is None and len(strategy.ctx_list) == 1:
        print(f"warning: --compression {args.compression} compresses nothing here: one context in one process "
              "sends no gradient; it applies between several --devices or the workers of a job", file=sys.stderr,
              flush=True)
    return initial, strategy


def _warn_idle_replicas(args, strategy, job):
    """One line when the global batch has fewer examples than the data replicas it is split over (each worker's
    data and expert replicas): those past it get no example and idle every step."""
    shape = strategy.layout.place(len(strategy.ctx_list)).shape
    workers = 1 if job is None else job.num_workers
    replicas = workers * shape.data * shape.expert
    if args.batch_size < replicas:
        where = f"{workers} workers x {replicas // workers}" if workers > 1 else f"{replicas}"
        print(f"warning: --batch-size {args.batch_size} is split over {where} data replicas (--devices "
              f"{args.devices}): {replicas - args.batch_size} of them get no example and stay idle; give a --batch-size "
              f"of at least {replicas}, or fewer --devices", file=sys.stderr, flush=True)


def zero_shards(strategy):
    """Over how many replicas ZeRO shards each array of ``strategy``: its data replicas in this process (ZeRO-1 and
    2; a context-parallel group's members each a replica), times the job's workers for ZeRO-3. 1: nothing is
    sharded."""
    replicas = strategy.layout.place(len(strategy.ctx_list)).replicas
    return replicas * (strategy.job.num_workers if strategy.job is not None and strategy.layout.zero == 3 else 1)


def checkpoint_record(args, strategy, optimizer, dataset, data_name, job):
    """What a checkpoint of this run records of its configuration (``parallel.checkpoint.COMPATIBLE_FIELDS`` decide
    whether a resume may continue it). The dataset's fingerprint hashes every example: only a run that checkpoints
    (rank 0) computes it, and every worker of an elastic job (each commits its state)."""
    main_rank = job is None or job.rank == 0
    writes = elastic() or args.checkpoint_dir is not None and main_rank
    fingerprint = dataset_fingerprint(dataset) if writes else None
    codec = strategy.reducer.codec
    return {"model": args.model, "dataset": {"name": data_name, "fingerprint": fingerprint},
            "batch_size": args.batch_size, "lr": args.lr, "seed": args.seed, "epochs": args.epochs,
            "strategy": args.strategy, "allreduce": args.allreduce, "devices": args.devices,
            "stages": args.stages, "boundaries": args.boundaries, "micro_batches": args.micro_batches,
            "tensor": args.tensor, "schedule": args.schedule, "virtual_stages": args.virtual_stages,
            "workers": 1 if job is None else job.num_workers, "optimizer": optimizer.config(), "zero": args.zero,
            "accumulate": args.accumulate, "compression": "none" if codec is None else codec.spec}


def check_resume(checkpoint, record, dataset):
    """Refuse to resume ``checkpoint`` when it is corrupt (a configuration without what every run records,
    ``check_run_config``; a position this run's epochs do not have) or with a configuration that changes the
    computation (``check_compatible``)."""
    if checkpoint is None:
        return
    with users_input(CheckpointError):
        check_run_config(checkpoint)
    saved = {"optimizer": SGD(checkpoint.config["lr"]).config(),   # version 1 trained plain SGD at its lr
             "compression": "none", **checkpoint.config}            # and before compression, compressed nothing
    with users_input(CheckpointError, flags=FLAGS):   # the advice names the flag: "the same --optimizer"
        check_compatible(saved, record)
    try:   # same batch size, dataset and seed: a position outside the run's epochs is the checkpoint's fault
        check_start(checkpoint.state, record["seed"], num_batches(len(dataset.train_labels), record["batch_size"]))
    except ValueError as e:
        raise UsageError(f"{checkpoint.path}: corrupt, {e.render({**FLAGS, 'resume': 'it'})}; the checkpoint cannot be "
                         "resumed") from None


def open_report(args, strategy, optimizer, dataset, data_name, job):
    """The run's ``Report`` (rank 0 of a job alone prints and writes), after its opening lines."""
    workers = 1 if job is None else job.num_workers
    used = len(strategy.ctx_list)
    layout = f"{used} context(s)" if job is None else f"{workers} worker(s) x {used} context(s)"
    report = Report(strategy, model_info(args.model).title, data_name, layout, workers, job is None or job.rank == 0,
                    {"--metrics-json": args.metrics_json, "--plot": args.plot},
                    memory=lambda: memory_of(strategy, optimizer))
    report.say(f"training {report.title} on {data_name}: {len(dataset.train_labels)} train / "
               f"{len(dataset.test_labels)} test examples, batch {args.batch_size}, lr {args.lr}, on {layout}")
    report.say(f"strategy {strategy.name}: {strategy.describe(args.accumulate)}; operator threads: OMP_NUM_THREADS="
               f"{os.environ.get('OMP_NUM_THREADS', 'unset (MXNet default: half the cores)')}")
    if optimizer.describe() != SGD(args.lr).describe() or args.accumulate > 1:   # more than the textbook's step
        accumulate = f"; {args.accumulate} micro-batches per batch" if args.accumulate > 1 else ""
        report.say(f"optimizer {optimizer.describe(zero_shards(strategy))}{accumulate}")
    return report   # it says what each context holds after the first step (Report.step)


def announce_start(args, checkpoint, report):
    """Say where a resumed run starts: the checkpoint's position (nothing for a new run); in a restarted job,
    which restart this is."""
    restart = restart_count()
    if restart and checkpoint is None:
        report.say(f"restart {restart} of the job: " + ("no checkpoint to resume, starting over"
                                                         if args.checkpoint_dir is None else
                                                         f"no checkpoint in {args.checkpoint_dir} yet, starting over"))
    if checkpoint is None:
        return
    start = checkpoint.state
    if args.handed_over:
        report.say(f"restart {restart} of the job: resuming from the state a worker committed in memory: epoch "
                   f"{start.epoch}, after {start.batch} batch(es)")
        return
    if restart:
        report.say(f"restart {restart} of the job: resuming from its last checkpoint")
    if start.epoch > args.epochs:
        report.say(f"the checkpoint in {args.checkpoint_dir} has finished all {args.epochs} epochs; nothing to "
                   "train (give a larger --epochs to train further)"
                   + ("; --trace writes no trace, no step runs" if args.trace is not None else ""))
    else:
        report.say(f"resuming from {checkpoint.path}: epoch {start.epoch}, after {start.batch} batch(es)")


def train(args, strategy, optimizer, dataset, checkpoint, stop, report, record):
    """``fit`` with the run's configuration, from the checkpoint when there is one, writing checkpoints of
    ``record`` into ``--checkpoint-dir`` (rank 0); raises ``TrainingStopped`` when a signal stopped it."""
    write = None   # every worker of a job takes part in gathering a checkpoint's state; rank 0 writes it
    if args.checkpoint_dir is not None:
        write = (CheckpointWriter(args.checkpoint_dir, record, args.model, args.checkpoint_lock) if report.main_rank
                 else _gathered)
    config = dataclasses.replace(run_config(args), progress=shows_progress(args.no_progress, report.main_rank))
    server = StateServer() if elastic() else None
    try:
        if server is not None:   # commit every --commit-every steps; the checkpoints stay where they were
            per_epoch = num_batches(len(dataset.train_labels), args.batch_size)
            write = _Committer(server, record, args.model, per_epoch, write, args.commit_every,
                               args.checkpoint_every if args.checkpoint_dir is not None else None, stop)
            every = args.commit_every if write.checkpoint_every is None else math.gcd(args.commit_every,
                                                                                      args.checkpoint_every)
            config = dataclasses.replace(config, checkpoint_every=every)   # fit's snapshots: both cadences
            print(server.announcement(), flush=True)
        with users_input(NonFiniteLossError, CheckpointWriteError, flags=FLAGS):
            fit(dataset, strategy, optimizer, config, on_epoch=report.epoch, on_checkpoint=write, stop=stop,
                resume=checkpoint, on_step=report.step)
    finally:
        if server is not None:
            server.close()


class _Committer:
    """``fit``'s ``on_checkpoint`` in an elastic job (``fit`` snapshots at both cadences): a snapshot is committed
    in memory and served (every worker serves its own: any may be the one that survives) every ``commit_every``
    steps, and handed to ``write`` (the checkpoint writer, or None) every ``checkpoint_every`` steps (None: at the
    epoch's end only); both at an epoch's end and when ``stop`` stops the run."""

    def __init__(self, server, record, model, per_epoch, write, commit_every, checkpoint_every, stop):
        self.server, self.record, self.model, self.per_epoch = server, record, model, per_epoch
        self.write, self.commit_every, self.checkpoint_every, self.stop = write, commit_every, checkpoint_every, stop

    def __call__(self, snapshot):
        state = snapshot.state
        step = (state.epoch - 1) * self.per_epoch + state.batch
        always = state.batch == 0 or (self.stop is not None and self.stop())
        if always or step % self.commit_every == 0:
            self.server.commit(step, packer(snapshot, self.record, self.model))
        if self.write is not None and (always or self.checkpoint_every and step % self.checkpoint_every == 0):
            self.write(snapshot)


def _gathered(snapshot):
    """What a worker but rank 0 does with a checkpoint it helps gather: reads the arrays gathered as the checkpoint
    is written (ZeRO-3's, one at a time, in the writer's order), and drops them."""
    read_all(snapshot)


def announce_trace(args, job, report):
    """``--trace``: the run's last line says where the timeline was written and what opens it (rank 0 names every
    worker's file)."""
    if args.trace is None or not report.main_rank:
        return
    where = worker_path(args.trace, job, rank=0)
    if job is not None and job.num_workers > 1:
        where += f" .. {worker_path(args.trace, job, rank=job.num_workers - 1)} (a file a worker)"
    print(f"trace written to {where}: open it in Perfetto (ui.perfetto.dev) or chrome://tracing", flush=True)


def export(args, strategy, initial, report):
    """``--export``: the trained model as MXNet's symbol + params pair (rank 0 of a job alone)."""
    if args.export is None:
        return
    if not report.main_rank:
        if strategy.gathers_collectively:   # ZeRO-3 in a job: every worker gathers the model
            strategy.params()
        return
    try:
        model_info(args.model).behaviour.export(args.export, strategy.params(), strategy.aux(), initial)
    except OSError as e:
        raise UsageError(f"cannot write --export {args.export!r}: {e.strerror or e}") from None
    print(f"exported {report.title} to {' and '.join(export_files(args.export))}", flush=True)
