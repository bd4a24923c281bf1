"""What healing costs: checkpoints every N steps against none, and a job whose worker is SIGKILLed mid-epoch.

Run from the repository root (about 20 minutes on 2 cores)::

    OMP_NUM_THREADS=2 python benchmarks/healing.py --data-dir digits
    OMP_NUM_THREADS=1 python benchmarks/healing.py --quick            # smoke test, synthetic data

Two parts, one after the other:

- ``cost``: ``fit`` on one context with a checkpoint (``save_checkpoint`` into a temporary directory, momentum
  state included) every 10 steps, every 50 steps, or only at the epoch's end, for LeNet (batch 64) and ResNet-18
  (batch 32) on synthetic data; ``--repeats`` rounds, each running every configuration once in a fresh
  shuffled order; the median seconds per epoch, and each against no checkpoint inside the epoch.
- ``job``: ``python -m parallel.launch -n 2 --max-restarts 1`` running ``python -m parallel.train`` for 3 LeNet
  epochs on ``--data-dir`` (batch 32, ``--checkpoint-every 20``), once uninterrupted and once with one worker
  SIGKILLed a second into epoch 2; the time from the kill to the restarted job's ``restart 1 of the job``
  line (the launcher's stop, the new start, joining the job, reading the checkpoint and the data), to its next
  completed epoch line, and the total time of each job.

Writes ``healing.json`` to ``--out``.
"""
import os
import signal
import subprocess
import sys
import tempfile
import time

sys.path.append(os.path.dirname(os.path.abspath(__file__)))   # harness.py, beside this script
import harness  # noqa: E402
from harness import BenchmarkError  # noqa: E402


def measure_cost(args):
    """The cost part: seconds per epoch of ``fit`` with a checkpoint every N steps or only at the epoch's end,
    each configuration once a round in a fresh shuffled order; a row each, its ratio to the epoch end only's."""
    import mxnet as mx
    from parallel import RunConfig, fit, init_model, make_strategy, synthetic_dataset
    from parallel.checkpoint import CheckpointWriter
    from parallel.optim import make_optimizer

    models = {"lenet": (64, 20 if args.quick else 100), "resnet18": (32, 2 if args.quick else 100)}
    everys = [None, 10, 50] if not args.quick else [None, 1]
    samples = {(model, every): [] for model in models for every in everys}
    print(f"cost: {args.repeats} round(s) of {len(samples)} timed epochs, then the job part: 2 jobs of "
          f"{args.epochs} epochs ({'about a minute' if args.quick else 'about 20 minutes on 2 cores'})",
          file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        def saver(model, directory):
            return CheckpointWriter(directory, {}, model)
        for repeat, order in enumerate(harness.round_orders(samples, args.repeats)):
            for model, every in order:
                batch, steps = models[model]
                dataset = synthetic_dataset(num_train=batch * steps, num_test=batch, seed=repeat)
                directory = os.path.join(tmp, f"{model}-{every}-{repeat}")
                history, _ = fit(dataset, make_strategy("data", init_model(model), [mx.cpu(0)]),
                                 make_optimizer("sgd", 0.01, momentum=0.9),
                                 RunConfig(epochs=1, batch_size=batch, checkpoint_every=every),
                                 on_checkpoint=saver(model, directory))
                samples[model, every].append(history[0]["seconds"])
                print(f"cost: round {repeat + 1}/{args.repeats}, {model} with a checkpoint "
                      f"{'at the epoch end only' if every is None else f'every {every} steps'}: "
                      f"{history[0]['seconds']:.2f} s", file=sys.stderr, flush=True)
    rows = [{"model": model, "checkpoint_every": every, "steps": models[model][1], "batch_size": models[model][0],
             "seconds": samples[model, every], "median_seconds": harness.median(samples[model, every])}
            for model in models for every in everys]
    return harness.add_ratios(rows, group=lambda row: row["model"], value="median_seconds",
                              reference=lambda row: row["checkpoint_every"] is None)


def run_job(args, directory, kill):
    """One 3-epoch job; with ``kill``, SIGKILL a worker a second into epoch 2. Returns its timings."""
    command = [sys.executable, "-m", "parallel.launch", "-n", "2", "--max-restarts", "1", "--grace", "2",
               sys.executable, "-m", "parallel.train", "--data-dir", os.path.abspath(args.data_dir), "--devices",
               "cpu:1", "--epochs", str(args.epochs), "--batch-size", "32", "--lr", "0.1", "--momentum", "0.9",
               "--no-progress", "--checkpoint-dir", "ckpt", "--checkpoint-every", "20"]
    started = time.monotonic()
    process = subprocess.Popen(command, cwd=directory, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    timings, killed = {}, None
    try:
        for line in process.stdout:
            now = time.monotonic()
            if kill and killed is None and " epoch 1, loss " in line:
                time.sleep(0.0 if args.quick else 1.0)
                workers = _workers_of(process.pid)
                killed = time.monotonic()
                os.kill(workers[-1], signal.SIGKILL)
            elif killed is not None and "restart 1 of the job: " in line and "resumed" not in timings:
                timings["resumed"] = now - killed   # resuming from the checkpoint, or (none yet) starting over
                timings["from_checkpoint"] = "resuming from its last checkpoint" in line
            elif killed is not None and "resumed" in timings and " epoch " in line and ", loss " in line \
                    and "first_epoch_after" not in timings:
                timings["first_epoch_after"] = now - killed
        process.wait(timeout=600)
    finally:
        if process.poll() is None:
            harness.stop_group(process)
    stderr = process.stderr.read()
    if process.returncode != 0:
        raise BenchmarkError(f"the job failed ({process.returncode}): {stderr[-2000:]}")
    timings["total"] = time.monotonic() - started
    timings["restarts"] = sum(line.startswith("restart ") for line in stderr.splitlines())
    return timings


def _workers_of(launcher_pid):
    """The pids of the job's worker processes (``DMLC_ROLE=worker`` in their environment), below the launcher."""
    found = sorted(int(name) for name in os.listdir("/proc") if name.isdigit()
                   and harness.proc_parent(name) == launcher_pid
                   and (harness.proc_environ(name) or {}).get("DMLC_ROLE") == "worker")
    if not found:
        raise BenchmarkError("no worker of the job found")
    return found


def measure_job(args):
    """The job part: the job uninterrupted, then with a worker killed; their timings."""
    with tempfile.TemporaryDirectory() as tmp:
        results = {}
        for name, kill in (("uninterrupted", False), ("killed", True)):
            directory = os.path.join(tmp, name)
            os.mkdir(directory)
            results[name] = run_job(args, directory, kill)
            print(f"job: {name} done", file=sys.stderr, flush=True)
    results["total_ratio"] = results["killed"]["total"] / results["uninterrupted"]["total"]
    return results


def main(argv=None):
    parser = harness.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data-dir", type=harness.mnist_dir, default=None, help="MNIST-format data for the job part (digits); "
                                                         "default: synthetic data written to a temporary directory")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds of the cost part; default 5")
    parser.add_argument("--epochs", type=int, default=3, help="epochs of the job part; default 3")
    parser.add_argument("--quick", action="store_true", help="smoke test: tiny sizes, seconds")
    harness.add_out(parser, "healing.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.epochs = 1, 3
    result = {"command": "python benchmarks/healing.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "unset"), "cost": measure_cost(args)}
    with tempfile.TemporaryDirectory() as data:
        if args.data_dir is None:   # a small synthetic MNIST-format set
            from parallel import synthetic_dataset
            args.data_dir = harness.write_dataset(data, synthetic_dataset(num_train=640 if args.quick else 1500,
                                                                          num_test=64, seed=0))
        result["job"] = measure_job(args)
    for row in result["cost"]:
        every = row["checkpoint_every"] or "epoch end only"
        print(f"{row['model']:9} checkpoint every {every!s:>14}: {row['median_seconds']:7.2f} s/epoch "
              f"({row['ratio']:.2f}x)")
    job = result["job"]
    print(f"job: uninterrupted {job['uninterrupted']['total']:.1f} s; killed {job['killed']['total']:.1f} s "
          f"({job['total_ratio']:.2f}x); kill -> resuming {job['killed'].get('resumed', float('nan')):.1f} s, "
          f"-> next epoch line {job['killed'].get('first_epoch_after', float('nan')):.1f} s")
    harness.write_json(os.path.join(args.out, "healing.json"), result)
    return 0


if __name__ == "__main__":
    sys.exit(harness.command(main))
