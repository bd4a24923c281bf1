"""How fast is one training step? This project against the textbook and MXNet's own gluon Trainer.

Run::

    python benchmarks/step_time.py                   # full run, a few minutes on 2 cores
    python benchmarks/step_time.py --quick           # smoke test, seconds
    python benchmarks/step_time.py --devices gpu:0,1 --ks 1,2 --threads 0

Measures, in ONE run, interleaved (every repeat visits every configuration in turn), the median ms per
LeNet training step (batch 256) at K contexts for:

- ``parallel/<algorithm>``: ``parallel.train_batch`` with each allreduce algorithm (the textbook calling
  pattern, default network);
- ``parallel/<algorithm>/imperative``: the same with the op-by-op ``lenet`` (no cached graph);
- ``textbook``: the algorithm as published: plain per-context parameter lists, per-tensor naive
  allreduce, per-tensor SGD, op-by-op LeNet;
- ``gluon``: a hybridized gluon LeNet of the same architecture
  (``hybridize(static_alloc=True, static_shape=True)``) trained by ``gluon.Trainer`` with
  ``kvstore='device'``.

Each thread setting (``OMP_NUM_THREADS``, which MXNet reads at start-up) runs in its own worker
process; the parent asks the workers in turn, so only one measures at a time. Each configuration is
reported at its best thread setting. Also measured: a whole epoch through ``parallel.fit`` (data
loading, loss accumulation and NaN checks included) against the pure step time, and the resident
memory over many steps. Writes ``step_time.json`` and ``step_time.png`` to ``--out``.
"""
import argparse
import json
import os
import platform
import select
import signal
import subprocess
import sys

sys.path.append(os.path.dirname(os.path.abspath(__file__)))   # harness.py, beside this script
import harness  # noqa: E402

WORKER_FLAG = "--worker"


# ----------------------------------------------------------------------------------------------
# Worker: builds configurations and times them on request (one JSON request/answer per line)
# ----------------------------------------------------------------------------------------------

def _rss_mib():
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


class Worker:
    """One thread setting's process: builds the configurations and times them when the parent asks."""

    def __init__(self, devices, batch_size, lr):
        import mxnet as mx
        import parallel

        self.mx, self.parallel = mx, parallel
        self.ctx_all = parallel.parse_devices(devices)
        self.batch_size, self.lr = batch_size, lr
        self.X, self.y = harness.random_batch(batch_size)
        self.steps = {}
        self.dataset = None

    def _build(self, variant, k):
        mx, parallel = self.mx, self.parallel
        from mxnet import gluon

        ctx_list = self.ctx_all[:k]
        X, y, lr = self.X, self.y, self.lr
        if variant == "gluon":
            net = gluon.nn.HybridSequential()
            net.add(gluon.nn.Conv2D(20, 3, activation="relu"), gluon.nn.AvgPool2D(2, 2),
                    gluon.nn.Conv2D(50, 5, activation="relu"), gluon.nn.AvgPool2D(2, 2),
                    gluon.nn.Dense(128, activation="relu"), gluon.nn.Dense(10))
            net.initialize(mx.init.Normal(0.01), ctx=ctx_list)
            trainer = harness.gluon_trainer(net, ctx_list, "sgd", {"learning_rate": lr})
            return harness.gluon_step(net, trainer, X, y, ctx_list)
        if variant == "textbook":
            device_params = []
            for ctx in ctx_list:   # the textbook's get_params: a copy per tensor, attach_grad on each
                params = [p.copyto(ctx) for p in parallel.init_lenet_params(seed=0)]
                for p in params:
                    p.attach_grad()
                device_params.append(params)
            return lambda: parallel.train_batch(X, y, device_params, ctx_list, lr, net=parallel.lenet,
                                                reducer="naive")
        _, algorithm, *rest = variant.split("/")
        # the default network of train_batch, or the op-by-op lenet (".../imperative") or the cached graph
        # (".../cached") explicitly
        options = {"imperative": {"net": parallel.lenet}, "cached": {"net": parallel.lenet_cached}}.get(
            rest[0] if rest else None, {})
        device_params = [parallel.get_params(parallel.init_lenet_params(seed=0), c) for c in ctx_list]
        return lambda: parallel.train_batch(X, y, device_params, ctx_list, lr, reducer=algorithm, **options)

    def measure(self, variant, k, steps):
        """Median-free single sample: ms per step over ``steps`` steps (the parent takes medians)."""
        key = (variant, k)
        if key not in self.steps:
            self.steps[key] = self._build(variant, k)
            harness.warm_up([self.steps[key]], 3)    # graph caching, memory pools
        return harness.timed(self.steps[key], steps) * 1000   # no host sync inside the timed steps

    def epoch(self, k, num_batches):
        """Seconds per step of one epoch through parallel.fit (data loading included)."""
        from parallel import RunConfig, fit, init_model, make_strategy
        if self.dataset is None or len(self.dataset.train_labels) != num_batches * self.batch_size:
            self.dataset = self.parallel.synthetic_dataset(num_batches * self.batch_size, self.batch_size)
        strategy = make_strategy("data", init_model("lenet"), self.ctx_all[:k])
        history, _ = fit(self.dataset, strategy, self.lr, RunConfig(epochs=1, batch_size=self.batch_size))
        return history[0]["seconds"] / num_batches * 1000

    def memory(self, k, steps, every):
        """The resident memory (MiB, and its peak) every ``every`` of ``steps`` steps of the default step."""
        self.measure("parallel/" + self.parallel.DEFAULT_ALGORITHM, k, 1)
        step = self.steps[("parallel/" + self.parallel.DEFAULT_ALGORITHM, k)]
        trace = []
        for i in range(1, steps + 1):
            step()
            if i % every == 0:
                self.mx.nd.waitall()
                trace.append([i, *_rss_mib()])
        return trace


def worker_main(argv):
    """A worker process: answers the parent's requests, one JSON line each, until its stdin closes."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices")
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--lr", type=float)
    args = parser.parse_args(argv)
    worker = Worker(args.devices, args.batch_size, args.lr)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        kind = request.pop("kind")
        result = getattr(worker, kind)(**request)
        print(json.dumps({"result": result}), flush=True)


# ----------------------------------------------------------------------------------------------
# Parent: spawns one worker per thread setting and interleaves the measurements
# ----------------------------------------------------------------------------------------------

#: Seconds a worker process may take to answer one request (a whole measurement) before it counts as hung.
WORKER_TIMEOUT = 900


class WorkerProcess:
    """The parent's end of one worker process (one ``OMP_NUM_THREADS`` setting), asked one request at a time."""

    def __init__(self, threads, args):
        env = dict(os.environ)
        if threads:
            env["OMP_NUM_THREADS"] = str(threads)
        else:
            env.pop("OMP_NUM_THREADS", None)
        self.threads = threads
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), WORKER_FLAG, "--devices", args.devices,
             "--batch-size", str(args.batch_size), "--lr", str(args.lr)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, start_new_session=True)
        self._read()

    def _read(self):
        ready, _, _ = select.select([self.proc.stdout], [], [], WORKER_TIMEOUT)
        if not ready:   # a worker that hangs (a deadlocked operator) must not hang the benchmark
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            raise RuntimeError(f"benchmark worker (OMP_NUM_THREADS={self.threads}) answered nothing within "
                               f"{WORKER_TIMEOUT} s; killed it")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"benchmark worker (OMP_NUM_THREADS={self.threads}) died; see its stderr above")
        return json.loads(line)

    def ask(self, kind, **request):
        self.proc.stdin.write(json.dumps({"kind": kind, **request}) + "\n")
        self.proc.stdin.flush()
        return self._read()["result"]

    def close(self):
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def thread_label(threads):
    return f"OMP_NUM_THREADS={threads}" if threads else "OMP_NUM_THREADS unset (MXNet default)"


def _sample_rounds(args, workers, configs, ks):
    """Every configuration on every worker, then the epoch at every K, in each of ``--repeats`` repeats (the order
    rotates every repeat); the samples, by ``(variant, k, threads)`` and ``(k, threads)``."""
    samples = {(v, k, w.threads): [] for v, k in configs for w in workers}
    epoch_samples = {(k, w.threads): [] for k in ks for w in workers}
    for repeat, order in enumerate(harness.round_orders(configs, args.repeats, "rotate"), 1):
        for variant, k in order:
            for w in workers:
                samples[(variant, k, w.threads)].append(w.ask("measure", variant=variant, k=k, steps=args.steps))
        for k in ks:
            for w in workers:
                epoch_samples[(k, w.threads)].append(w.ask("epoch", k=k, num_batches=args.epoch_batches))
        print(f"repeat {repeat}/{args.repeats} done", file=sys.stderr, flush=True)
    return samples, epoch_samples


def _best(args, configs, median, ks, epoch_samples):
    """Each configuration at its best thread setting, and the epoch at the default's, against its pure step."""
    from parallel import DEFAULT_ALGORITHM
    best = {}
    for variant, k in configs:
        threads = min(args.threads, key=lambda t: median[(variant, k, t)])
        best[(variant, k)] = (median[(variant, k, threads)], threads)
    default, epoch = f"parallel/{DEFAULT_ALGORITHM}", {}
    for k in ks:
        threads = best[(default, k)][1]
        per_step = harness.median(epoch_samples[(k, threads)])
        epoch[k] = {"threads": threads, "epoch_ms_per_step": per_step,
                    "pure_step_ms": median[(default, k, threads)],
                    "ratio": per_step / median[(default, k, threads)]}
    return best, epoch


def run(args):
    import mxnet as mx
    from parallel import ALLREDUCE_ALGORITHMS, DEFAULT_ALGORITHM, parse_devices

    num_contexts = len(parse_devices(args.devices))
    ks = [k for k in args.ks if k <= num_contexts]
    variants = args.variants or ([f"parallel/{a}" for a in sorted(ALLREDUCE_ALGORITHMS)]
                                 + [f"parallel/{DEFAULT_ALGORITHM}/imperative", "textbook", "gluon"])
    configs = [(v, k) for k in ks for v in variants]
    workers = [WorkerProcess(t, args) for t in args.threads]
    try:
        samples, epoch_samples = _sample_rounds(args, workers, configs, ks)
        memory = {k: workers[0].ask("memory", k=k, steps=args.memory_steps, every=max(1, args.memory_steps // 10))
                  for k in ks}
    finally:
        for w in workers:
            w.close()
    median = harness.medians(samples)
    best, epoch = _best(args, configs, median, ks, epoch_samples)
    return {
        "command": "python benchmarks/step_time.py " + " ".join(args.argv),
        "machine": {"nproc": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "mxnet": mx.__version__, "gpus": mx.context.num_gpus(),
                    "MXNET_CPU_WORKER_NTHREADS": os.environ.get("MXNET_CPU_WORKER_NTHREADS", "unset (1)")},
        "settings": {"devices": args.devices, "batch_size": args.batch_size, "steps_per_sample": args.steps,
                     "repeats": args.repeats, "threads": [thread_label(t) for t in args.threads],
                     "default_algorithm": DEFAULT_ALGORITHM},
        "samples": [{"variant": v, "k": k, "threads": t, "ms": samples[(v, k, t)], "median_ms": median[(v, k, t)]}
                    for (v, k, t) in samples],
        "best": [{"variant": v, "k": k, "median_ms": ms, "threads": t,
                  "ratio_to_gluon": ms / best[("gluon", k)][0]} for (v, k), (ms, t) in best.items()],
        "epoch": [{"k": k, **e} for k, e in epoch.items()],
        "memory": [{"k": k, "trace": [{"step": s, "rss_mib": r, "peak_mib": p} for s, r, p in trace]}
                   for k, trace in memory.items()],
    }


def render_table(result):
    ks = sorted({b["k"] for b in result["best"]})
    best = {(b["variant"], b["k"]): b for b in result["best"]}
    variants = list(dict.fromkeys(b["variant"] for b in result["best"]))
    lines = ["| variant | " + " | ".join(f"K={k} ms/step (x gluon, threads)" for k in ks) + " |",
             "|---|" + "---|" * len(ks)]
    for v in variants:
        cells = []
        for k in ks:
            b = best[(v, k)]
            cells.append(f"{b['median_ms']:.1f} ({b['ratio_to_gluon']:.2f}x, {b['threads'] or 'default'})")
        lines.append(f"| {v} | " + " | ".join(cells) + " |")
    default = "parallel/" + result["settings"]["default_algorithm"]
    if 1 in ks:
        for k in ks[1:]:
            lines.append(f"\n{default}: K={k} step / K=1 step = "
                         f"{best[(default, k)]['median_ms'] / best[(default, 1)]['median_ms']:.2f}")
    for e in result["epoch"]:
        lines.append(f"epoch pipeline K={e['k']}: {e['epoch_ms_per_step']:.1f} ms/step vs pure step "
                     f"{e['pure_step_ms']:.1f} ms = {e['ratio']:.2f}x")
    for m in result["memory"]:
        trace = m["trace"]
        lines.append(f"memory K={m['k']}: RSS {trace[0]['rss_mib']:.0f} MiB after {trace[0]['step']} steps, "
                     f"{trace[-1]['rss_mib']:.0f} MiB after {trace[-1]['step']}; peak {trace[-1]['peak_mib']:.0f} MiB")
    return "\n".join(lines)


def plot(result, path):
    ks = sorted({b["k"] for b in result["best"]})
    variants = list(dict.fromkeys(b["variant"] for b in result["best"]))
    best = {(b["variant"], b["k"]): b["median_ms"] for b in result["best"]}
    fig, ax = harness.figure(figsize=(10, 4.5))
    width = 0.8 / len(variants)
    for i, v in enumerate(variants):
        ax.bar([j + i * width for j in range(len(ks))], [best[(v, k)] for k in ks], width, label=v)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(ks))])
    ax.set_xticklabels([f"K={k}" for k in ks])
    ax.set_ylabel("ms per step (median, best thread setting)")
    ax.set_title(f"LeNet step, batch {result['settings']['batch_size']}, "
                 f"{result['machine']['nproc']} cores, {result['settings']['devices']}")
    ax.legend(fontsize=8, ncol=2)
    ax.grid(axis="y", alpha=0.3)
    harness.save_figure(fig, path)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == WORKER_FLAG:
        return worker_main(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", default="cpu:4")
    parser.add_argument("--ks", action=harness.CommaList, item=int, minimum=1, default=[1, 2, 4],
                        help="numbers of contexts, e.g. 1,2,4")
    parser.add_argument("--threads", action=harness.CommaList, item=int, minimum=0, default=[1, 2],
                        help="OMP_NUM_THREADS settings to try, one worker process each (0 = unset)")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--steps", type=int, default=10, help="steps per sample")
    parser.add_argument("--repeats", type=int, default=7, help="samples per configuration (median taken)")
    parser.add_argument("--epoch-batches", type=int, default=40, help="batches in the timed epoch")
    parser.add_argument("--memory-steps", type=int, default=1000)
    parser.add_argument("--variants", action=harness.CommaList, default=None,
                        help="only these variants, e.g. parallel/fused/cached,gluon (default: all)")
    parser.add_argument("--quick", action="store_true", help="a smoke test: tiny sizes, seconds")
    harness.add_out(parser, "step_time.json and step_time.png")
    args = parser.parse_args(argv)
    args.argv = argv
    if args.quick:
        args.steps, args.repeats, args.epoch_batches, args.memory_steps = 2, 2, 3, 20
        args.batch_size, args.ks, args.threads = 32, [k for k in args.ks if k <= 2] or [1], args.threads[:1]
    result = run(args)
    harness.write_json(os.path.join(args.out, "step_time.json"), result)
    plot(result, os.path.join(args.out, "step_time.png"))
    print(f"{result['command']}\nmachine: {result['machine']}\nsettings: {result['settings']}\n")
    print(render_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(harness.command(main))
