"""What activation recomputation (``--recompute``) costs and saves: step time and memory, with and without it.

Each configuration (model x recompute off/on) trains a few steps of the data strategy on K CPU contexts in a
process of its own, interleaved over the rounds, and reports:

- the median step time over the timed steps (after warm-up; every step waited for);
- the process's peak resident memory (``ru_maxrss``, which holds MXNet and the data as well: compare the two rows
  of a model, not the numbers alone);
- the activations a step keeps for its backward pass, counted from the graph's shapes on one context's shard (no
  array allocated): without recomputation every operator's output; with it the blocks' inputs, plus the largest
  block's operator outputs (one block's activations exist at a time during backward), plus the last block's.

    python benchmarks/recompute.py                      # LeNet (batch 256) and ResNet-18 (batch 64) on 2 contexts
    python benchmarks/recompute.py --models lenet --rounds 1 --steps 3

Writes ``benchmarks/results/recompute.json`` (``--out``) and prints one line a configuration.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

BATCH = {"lenet": 256, "resnet18": 64}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="lenet,resnet18", help="comma-separated models of parallel.models")
    parser.add_argument("--devices", type=int, default=2, help="CPU contexts")
    parser.add_argument("--steps", type=int, default=8, help="timed steps a run (after 2 of warm-up)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved runs of each configuration")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                       "recompute.json"))
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)   # MODEL:RECOMPUTE, in a child process
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
    if hasattr(net, "symbol"):
        return net.symbol, dict(zip(net.names, (p.shape for p in params)))
    return net._symbol(len(params)), {f"param{i}": p.shape for i, p in enumerate(params)}


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


def _worker(model, recompute, devices, steps):
    """Train ``steps`` + 2 steps; print one JSON line: step times and peak memory."""
    import resource
    import time

    import mxnet as mx
    import numpy as np
    from parallel.models import MODELS
    from parallel.optim import SGD
    from parallel.strategies import make_strategy
    ctx_list = [mx.cpu(i) for i in range(devices)]
    strategy = make_strategy("data", MODELS[model].behaviour.init(seed=0), ctx_list, recompute=recompute)
    rng = np.random.RandomState(0)
    X = mx.nd.array(rng.rand(BATCH[model], 1, 28, 28))
    y = mx.nd.array(rng.randint(0, 10, BATCH[model]))
    optimizer = SGD(0.05, momentum=0.9)
    times = []
    for step in range(steps + 2):
        start = time.perf_counter()
        loss, _ = strategy.train_step(X, y, optimizer=optimizer)
        for param in strategy.params():
            param.wait_to_read()
        loss.wait_to_read()
        if step >= 2:
            times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"times": times, "peak_rss": peak, "loss": float(loss.asscalar())}))


def main(argv=None):
    args = parse_args(argv)
    if args.worker is not None:
        model, recompute = args.worker.split(":")
        _worker(model, recompute == "1", args.devices, args.steps)
        return 0
    models = args.models.split(",")
    configs = [(model, recompute) for model in models for recompute in (False, True)]
    runs = {config: [] for config in configs}
    for _ in range(args.rounds):
        for model, recompute in configs:
            command = [sys.executable, os.path.abspath(__file__), "--worker", f"{model}:{int(recompute)}",
                       "--devices", str(args.devices), "--steps", str(args.steps)]
            result = subprocess.run(command, capture_output=True, text=True, timeout=1800, check=True,
                                    start_new_session=True)
            runs[(model, recompute)].append(json.loads(result.stdout.strip().splitlines()[-1]))
    rows = []
    for model in models:
        shard = -(-BATCH[model] // args.devices)
        whole, kept = counted_activations(model, shard)
        base = None
        for recompute in (False, True):
            got = runs[(model, recompute)]
            step = statistics.median(t for run in got for t in run["times"])
            peak = statistics.median(run["peak_rss"] for run in got)
            base = step if base is None else base
            row = {"model": model, "recompute": recompute, "batch": BATCH[model], "devices": args.devices,
                   "step_seconds": step, "time_ratio": step / base, "peak_rss": peak,
                   "activation_bytes": kept if recompute else whole, "losses": [run["loss"] for run in got]}
            rows.append(row)
            print(f"{model:9s} recompute={'on ' if recompute else 'off'} step {step * 1e3:7.1f} ms "
                  f"({row['time_ratio']:.2f}x)  peak RSS {peak / 2**20:7.1f} MiB  activations kept "
                  f"{row['activation_bytes'] / 2**20:6.1f} MiB a context", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    from parallel.files import atomic_write
    with atomic_write(args.out) as f:
        json.dump({"omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "rounds": args.rounds, "steps": args.steps,
                   "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
