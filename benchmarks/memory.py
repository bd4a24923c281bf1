"""What activation recomputation (``--recompute``) and ZeRO (``--zero 0..3``) cost and save: step time and memory.

Part ``recompute``: each model with and without recomputation; part ``zero``: ResNet-18 with Adam at every ZeRO
stage (stage 3 with and without prefetch) on 2 and 4 contexts; part ``job``: the same stages in a job of 2 workers
(``python -m parallel.launch -n 2 -s 2``) of ``--job-devices`` contexts each, ZeRO-3 sharding over all of them
(``--zero-model vit``: the ViT in both, a quick check of the benchmark itself, as its test runs it).
Each configuration trains a few steps of the data strategy on K CPU contexts in a process (or a job) of its own,
interleaved over the rounds, and reports:

- the median step time over the timed steps (after warm-up; every step waited for);
- the process's peak resident memory (``ru_maxrss``, which holds MXNet and the data as well: compare the two rows
  of a model, not the numbers alone);
- recompute: the activations a step keeps for its backward pass, counted from the graph's shapes on one
  context's shard (no array allocated): without recomputation every operator's output; with it the blocks'
  inputs, plus the largest block's operator outputs (one block's activations exist at a time during backward),
  plus the last block's;
- zero: what the busiest context holds (``parallel.optim.memory_table``: parameters, gradients, optimizer state,
  gathered parameters, temporary buffers) and, at stage 3, the bytes a step copies between contexts against ZeRO's 3 Psi;
- job: the same, rank 0's, and the bytes a worker pushes to the servers a step (and pulls back as many).

    python benchmarks/memory.py                         # the recompute and zero parts
    python benchmarks/memory.py --part job --rounds 3   # 2 workers under the launcher
    python benchmarks/memory.py --part recompute --models lenet --rounds 1 --steps 3

Writes ``benchmarks/results/memory.json`` (``memory_job.json`` for the job part; ``--out``) and prints one line a
configuration.
"""
import argparse
import functools
import os
import sys

sys.path.append(os.path.dirname(os.path.abspath(__file__)))   # harness.py, beside this script
import harness  # noqa: E402

BATCH = {"lenet": 256, "resnet18": 64}
#: The models the zero and job parts can train (``--zero-model``), with their batch: ResNet-18 for the tables, the
#: ViT (80 times smaller) for a quick run that checks the benchmark itself.
ZERO_BATCH = {"resnet18": 64, "vit": 64}


@functools.lru_cache(maxsize=None)   # built from the model's layout, asked for once a row
def parameters(model):
    """The trainable parameters of ``model`` (Psi, the model's bytes, is 4 of them each): 11,175,818 for ResNet-18."""
    from parallel.models import MODELS
    return sum(map(_size, MODELS[model].behaviour.layout().shapes))


def _size(shape):
    size = 1
    for n in shape:
        size *= n
    return size


def parse_args(argv=None):
    """The benchmark's arguments (``--worker``: one configuration, in a child process)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=["recompute", "zero", "both", "job"], default="both")
    parser.add_argument("--models", action=harness.CommaList, names=list(BATCH), default=list(BATCH),
                        help="recompute: comma-separated models")
    parser.add_argument("--devices", type=int, default=2, help="recompute: CPU contexts")
    parser.add_argument("--zero-devices", action=harness.CommaList, item=int, minimum=1, default=[2, 4],
                        help="zero: comma-separated numbers of CPU contexts")
    parser.add_argument("--job-devices", action=harness.CommaList, item=int, minimum=1, default=[1, 2],
                        help="job: comma-separated contexts a worker")
    parser.add_argument("--zero-model", choices=list(ZERO_BATCH), default="resnet18",
                        help="zero, job: the model trained (the tables are ResNet-18's)")
    parser.add_argument("--steps", type=int, default=8, help="timed steps a run (after 2 of warm-up)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved runs of each configuration")
    parser.add_argument("--out", default=None, help="the JSON file (default: results/memory.json, "
                                                     "results/memory_job.json for --part job)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)   # a configuration, in a child process
    return parser.parse_args(argv)


def _outputs_bytes(symbol, known, data_shape):
    """Bytes of every operator output of ``symbol`` on ``data_shape`` (float32), inferred from its shapes."""
    internals = symbol.get_internals()
    inputs = set(symbol.list_inputs())
    _, shapes, _ = internals.infer_shape(data=data_shape, **known)
    total = 0
    for name, shape in zip(internals.list_outputs(), shapes):
        if name[:-len("_output")] not in inputs and name not in inputs:
            size = 4
            for n in shape:
                size *= n
            total += size
    return total


def _graph(net, params):
    """The graph a block or network runs on ``params`` (its arrays of a replica), and the shapes of its inputs by
    name: a GluonNet's (inputs named as the block's arrays), or a CachedNet's (``param0``, ``param1``, ...)."""
    from parallel.models import GluonNet
    if isinstance(net, GluonNet):
        return net.symbol, dict(zip(net.names, (p.shape for p in params)))
    return net.symbol_for(len(params)), {f"param{i}": p.shape for i, p in enumerate(params)}


def counted_activations(model, shard):
    """(without, with) recomputation: the activation bytes a step keeps on one context for a ``shard`` of images."""
    import mxnet as mx
    from parallel.models import MODELS
    from parallel import get_params
    behaviour = MODELS[model].behaviour
    initial = behaviour.init(seed=0)
    segments = behaviour.segments(initial)
    replica = get_params(initial, mx.cpu())
    data = (shard, 1, 28, 28)
    whole = _outputs_bytes(*_graph(behaviour.net(initial), replica), data)
    kept, largest, shape = 0, 0, data
    for i, segment in enumerate(segments):
        symbol, known = _graph(segment.net, replica[segment.first:segment.stop])
        inside = _outputs_bytes(symbol, known, shape)
        if i:
            kept += 4 * int(mx.nd.zeros(shape).size)   # the block's input
        largest = max(largest, inside) if i < len(segments) - 1 else largest
        last = inside
        _, (out_shape,), _ = symbol.infer_shape(data=shape, **known)
        shape = out_shape
    return whole, kept + largest + last


def _worker(config, steps):
    """Train ``steps`` + 2 steps of ``config`` (``_config``'s words); print one JSON line: step times, peak
    memory, the busiest context's bytes and, at stage 3, the bytes a step moves."""
    import resource

    import mxnet as mx
    from parallel.models import MODELS
    from parallel.optim import SGD, Adam
    from parallel.strategies import make_strategy
    from parallel.train_steps import memory_of
    from parallel import Reducer
    model, recompute, zero, prefetch, devices = config
    ctx_list = [mx.cpu(i) for i in range(devices)]
    initial = MODELS[model].behaviour.init(seed=0)
    job = None
    if os.environ.get("DMLC_ROLE"):   # a worker of the job part, under the launcher
        from parallel.job import join
        job = join()
    reducer = Reducer(job=job)
    if zero == 3:
        from parallel.strategies import FullyShardedDataParallel
        strategy = FullyShardedDataParallel(initial, ctx_list, reducer, prefetch=prefetch)
        sharded = strategy.group
    else:
        strategy = make_strategy("data", initial, ctx_list, recompute=bool(recompute), zero=zero, reducer=reducer)
        sharded = None
    X, y = harness.random_batch({**BATCH, **ZERO_BATCH}[model])
    optimizer = SGD(0.05, momentum=0.9) if recompute is not None else Adam(0.001, zero=zero)
    losses = []

    def step():
        losses.append(strategy.train_step(X, y, optimizer=optimizer)[0])
    harness.warm_up([step], 2)
    times = [harness.timed(step) for _ in range(steps)]   # every step waited for
    loss = losses[-1]
    table = memory_of(strategy, optimizer)
    busiest = max(table, key=lambda row: sum(v for k, v in row.items() if k != "context"))
    moved = None if sharded is None else sharded.bytes_moved()
    pushed = None if sharded is None else sharded.network_bytes()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if job is None or job.rank == 0:
        harness.report_result({"times": times, "peak_rss": peak, "loss": float(loss.asscalar()), "busiest": busiest,
                               "bytes_moved": moved, "pushed": pushed})


def _config(words):
    """``model:recompute:zero:prefetch:devices`` as a tuple (recompute None for the zero part's runs)."""
    model, recompute, zero, prefetch, devices = words.split(":")
    return model, None if recompute == "-" else recompute == "1", int(zero), prefetch == "1", int(devices)


def _words(config):
    model, recompute, zero, prefetch, devices = config
    return f"{model}:{'-' if recompute is None else int(recompute)}:{zero}:{int(prefetch)}:{devices}"


def _run_rounds(configs, args, workers=0):
    """Each configuration once a round, in a process of its own (``workers``: a job of that many workers and
    servers under the launcher); the RESULT line of each run."""
    def run(config):
        command = [sys.executable, os.path.abspath(__file__), "--worker", _words(config), "--steps", str(args.steps)]
        if workers:
            command = [sys.executable, "-m", "parallel.launch", "-n", str(workers), "-s", str(workers),
                       "--stall-timeout", "600", *command]
        out, _ = harness.run_process(command, timeout=1800)
        return harness.read_result(out, _words(config))
    return harness.interleave(run, configs, args.rounds, "fixed")


def _step(runs):
    """The median seconds of a step over every timed step of ``runs``."""
    return harness.median(t for run in runs for t in run["times"])


def _recompute_rows(args):
    configs = [(model, recompute, 0, False, args.devices) for model in args.models for recompute in (False, True)]
    runs, rows = _run_rounds(configs, args), []
    for model in args.models:
        whole, kept = counted_activations(model, -(-BATCH[model] // args.devices))
        for recompute in (False, True):
            got = runs[(model, recompute, 0, False, args.devices)]
            rows.append({"part": "recompute", "model": model, "recompute": recompute, "batch": BATCH[model],
                         "devices": args.devices, "step_seconds": _step(got),
                         "peak_rss": harness.median(run["peak_rss"] for run in got),
                         "activation_bytes": kept if recompute else whole, "losses": [run["loss"] for run in got]})
    harness.add_ratios(rows, group=lambda row: row["model"], value="step_seconds", field="time_ratio")
    for row in rows:
        print(f"{row['model']:9s} recompute={'on ' if row['recompute'] else 'off'} step "
              f"{row['step_seconds'] * 1e3:7.1f} ms ({row['time_ratio']:.2f}x)  peak RSS {row['peak_rss'] / 2**20:7.1f}"
              f" MiB  activations kept {row['activation_bytes'] / 2**20:6.1f} MiB a context", flush=True)
    return rows


def _zero_row(got, model, workers, k, zero, prefetch):
    """The row of one ZeRO configuration from its runs: the busiest context's bytes, the bytes moved and pushed."""
    busiest, count = got[0]["busiest"], parameters(model)
    held = busiest["parameters"] + busiest["gradients"] + busiest["optimizer_state"]
    row = {"part": "job" if workers else "zero", "model": model, "workers": workers or 1,
           "devices": k, "zero": zero, "prefetch": prefetch,
           "batch": ZERO_BATCH[model], "step_seconds": _step(got),
           "busiest": busiest, "bytes_a_parameter": held / count,
           "bytes_moved": got[0]["bytes_moved"], "pushed": got[0].get("pushed"),
           "losses": [run["loss"] for run in got]}
    if workers:   # a Reducer pushes each gradient once a step (zero 0, 1, 2); ZeRO-3 reports its own bytes
        row["pushed"] = row["pushed"] if zero == 3 else 4 * count
    return row


def _in_psi(row):
    """The bytes a step of ZeRO ``row`` copies between contexts (per context) and pushes to the servers (per
    worker), in units of Psi, the model's bytes; None where the row has none."""
    psi = 4 * parameters(row["model"])
    moved = None if row["bytes_moved"] is None else row["bytes_moved"] / (row["devices"] * psi)
    return moved, None if row["pushed"] is None else row["pushed"] / psi


def _print_zero_row(row, workers):
    busiest, k = row["busiest"], row["devices"]
    moved_psi, pushed_psi = _in_psi(row)
    moved = "" if moved_psi is None else f"  moved {moved_psi:.2f} Psi a context"
    if workers:
        moved += f"  pushed {pushed_psi:.2f} Psi a worker"
    where = f"W={workers} K={k}" if workers else f"K={k}"
    print(f"{row['model']} {where} zero={row['zero']}{' prefetch' if row['prefetch'] else ''}: step "
          f"{row['step_seconds'] * 1e3:7.1f} ms ({row['time_ratio']:.2f}x)  {row['bytes_a_parameter']:5.2f} B/param + "
          f"gathered {busiest['gathered_peak'] / 2**20:5.1f} MiB + temporary "
          f"{busiest['temporary_buffers'] / 2**20:5.1f} MiB{moved}", flush=True)


def _zero_rows(args, workers=0):
    stages = [(0, False), (1, False), (2, False), (3, True), (3, False)]
    devices = args.job_devices if workers else args.zero_devices
    model = args.zero_model
    configs = [(model, None, zero, prefetch, k) for k in devices for zero, prefetch in stages]
    runs = _run_rounds(configs, args, workers)
    rows = [_zero_row(runs[(model, None, zero, prefetch, k)], model, workers, k, zero, prefetch)
            for k in devices for zero, prefetch in stages]
    harness.add_ratios(rows, group=lambda row: row["devices"], value="step_seconds", field="time_ratio")
    for row in rows:
        _print_zero_row(row, workers)
    return rows


def _mib(n):
    return f"{n / 2**20:.1f} MiB" if n else "0"


def _ms(seconds):
    return f"{seconds * 1e3:.1f} ms" if seconds < 0.1 else f"{seconds * 1e3:.0f} ms"


def table_rows(rows):
    """The Markdown rows (below the header) of the docs' table of each part's ``rows`` (as written to the JSON):
    the recompute, zero or job table of benchmarks/README.md and docs/memory.md, one line a configuration."""
    from parallel.models import MODELS
    lines = []
    for row in rows:
        time = f"{_ms(row['step_seconds'])} | {row['time_ratio']:.2f}x"
        if row["part"] == "recompute":
            lines.append(f"| {MODELS[row['model']].title} ({row['batch']}) | {'on' if row['recompute'] else 'off'} | "
                         f"{time} | {row['peak_rss'] / 2**20:.1f} MiB | {row['activation_bytes'] / 2**20:.1f} MiB |")
            continue
        moved, pushed = _in_psi(row)
        last = pushed if row["part"] == "job" else moved
        where = f"{row['workers']} x {row['devices']}" if row["part"] == "job" else f"{row['devices']}"
        stage = f"{row['zero']}, prefetch" if row["prefetch"] else f"{row['zero']}"
        busiest = row["busiest"]
        lines.append(f"| {where} | {stage} | {time} | {row['bytes_a_parameter']:.2f} B | "
                     f"{_mib(busiest['gathered_peak'])} | {_mib(busiest['temporary_buffers'])} | "
                     + ("|" if last is None else f"{last:.2f} Psi |"))
    return lines


def main(argv=None):
    args = parse_args(argv)
    if args.worker is not None:
        _worker(_config(args.worker), args.steps)
        return 0
    rows = []
    if args.part in ("recompute", "both"):
        rows += _recompute_rows(args)
    if args.part in ("zero", "both"):
        rows += _zero_rows(args)
    if args.part == "job":
        rows += _zero_rows(args, workers=2)
    if args.out is None:
        args.out = os.path.join(harness.RESULTS, "memory_job.json" if args.part == "job" else "memory.json")
    harness.write_json(args.out, {"omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "rounds": args.rounds,
                                  "steps": args.steps, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(harness.command(main))
