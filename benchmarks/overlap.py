"""Do gradients that travel while backward still runs make a step faster? The Reducer's buckets, measured.

Run::

    OMP_NUM_THREADS=1 python benchmarks/overlap.py                       # everything, about 15 minutes on 2 cores
    python benchmarks/overlap.py --parts process --models lenet --rounds 1 --steps 3   # a smoke test

Every measurement is a fresh process (MXNet reads its engine settings when it starts) that trains ``--steps``
steps after two of warm-up and reports each step's time (``mx.nd.waitall`` after each, so a step is timed whole:
forward, backward, every bucket's sum, the update). Configurations are interleaved in ``--rounds`` rounds and the
median over every step of every round is reported, with its ratio to the row's baseline. Parts:

- ``process``: one process, K CPU contexts (``--ks``), LeNet (global batch 256) and ResNet-18 (global batch 32),
  ``OMP_NUM_THREADS`` as given (default 1). Rows: ``mxnet defaults`` (one bucket, 4 scratch copies, backward
  bulks of 15: the package before the Reducer), ``64 scratch copies`` (one bucket), ``+ bulks of 2`` (one bucket:
  what bounding the bulk costs the compute, no overlap possible), ``buckets 25 MB`` (the default) and
  ``small buckets`` (LeNet 0.1 MB, ResNet-18 5 MB), the last two with both settings.
- ``sweep``: K=2, the engine settings on, a range of bucket sizes for each model.
- ``job``: ``python -m parallel.launch -n 2``, one context a worker (``OMP_NUM_THREADS=1`` each), on the plain
  loopback and (``--links plain,1gbit``) inside a private network namespace whose loopback is shaped to 1 Gbit/s
  (``unshare -n``, then ``tc qdisc add dev lo root tbf rate 1gbit burst 128kb latency 200ms``; needs root):
  one bucket against buckets, the engine settings on.

Writes ``overlap.json`` to ``--out`` and prints a markdown table per part.
"""
import argparse
import os
import shlex
import sys

sys.path.append(os.path.dirname(os.path.abspath(__file__)))   # harness.py, beside this script
import harness  # noqa: E402

from parallel.threads import engine_settings  # noqa: E402

WORKER_FLAG = "--worker"
BATCH = {"lenet": 256, "resnet18": 32}
SMALL = {"lenet": 0.1, "resnet18": 5}
SWEEP = {"lenet": [None, 25, 0.5, 0.1, 0.02, 0.004], "resnet18": [None, 100, 25, 10, 5, 1]}
#: The engine settings (``parallel.engine_settings`` but the threads), on and off.
ENGINE = {name: value for name, value in engine_settings().items() if name != "OMP_NUM_THREADS"}
DEFAULTS = {"MXNET_CPU_TEMP_COPY": "4", "MXNET_EXEC_BULK_EXEC_MAX_NODE_TRAIN_BWD": "15"}
SHAPE = "ip link set lo up && tc qdisc add dev lo root tbf rate 1gbit burst 128kb latency 200ms"
PARTS, MODELS, LINKS = ("process", "sweep", "job"), ("lenet", "resnet18"), ("plain", "1gbit")


# ---- the worker: one configuration, its step times as one JSON line ---------------------------------------------

def _model(name, reducer, ctx_list):
    from parallel import init_lenet_params, init_resnet18
    from parallel.models.gluon import GluonNet
    if name == "lenet":
        return reducer.replicate(init_lenet_params(seed=0), ctx_list), {}
    block = init_resnet18(seed=0)
    return reducer.replicate(block, ctx_list), {"net": GluonNet(block)}


def worker(opts):
    """Train ``opts.steps`` steps (after 2 of warm-up) of one configuration; print their seconds as JSON."""
    import mxnet as mx
    from parallel import Reducer, train_batch
    from parallel.job import broadcast_params, join
    import parallel.models.lenet
    sys.modules["parallel.models.lenet"].BACKWARD_BULK_SIZE = opts.bulk   # the package's attribute is the function
    job = join() if os.environ.get("DMLC_ROLE") == "worker" else None
    ctx_list = [mx.cpu(i) for i in range(opts.k)]
    reducer = Reducer("fused", opts.bucket_mb, job=job)
    device_params, kwargs = _model(opts.model, reducer, ctx_list)
    if job is not None:
        broadcast_params(job, device_params)
    X, y = harness.random_batch(BATCH[opts.model])

    def step():
        train_batch(X, y, device_params, ctx_list, 0.01, reducer=reducer, **kwargs)
    harness.warm_up([step], 2)
    seconds = [harness.timed(step) for _ in range(opts.steps)]   # each step timed whole
    if job is None or job.rank == 0:
        harness.report_result({"seconds": seconds, "buckets": len(device_params[0].buckets)})


# ---- the parent: configurations, rounds, tables -------------------------------------------------------------------

def _run(argv, env, timeout, shaped=False):
    """Run ``argv`` (inside a shaped namespace if asked) in a session of its own; the RESULT line's JSON."""
    if shaped:
        argv = ["unshare", "-n", "sh", "-c", f"{SHAPE} && exec {' '.join(shlex.quote(a) for a in argv)}"]
    out, _ = harness.run_process(argv, env=env, timeout=timeout)
    return harness.read_result(out, " ".join(argv[:6]))


def _config(part, model, k, label, bucket_mb, engine, bulk, link="plain"):
    return {"part": part, "model": model, "k": k, "label": label, "bucket_mb": bucket_mb, "engine": engine,
            "bulk": bulk, "link": link}


def configurations(opts):
    """Every configuration the chosen parts measure, baselines first within each row group."""
    configs = []
    for model in opts.models:
        for k in opts.ks if "process" in opts.parts else []:
            configs += [_config("process", model, k, "mxnet defaults (one bucket)", None, DEFAULTS, 15),
                        _config("process", model, k, "64 scratch copies (one bucket)", None, ENGINE, 15),
                        _config("process", model, k, "+ backward bulks of 2 (one bucket)", None, ENGINE, 2),
                        _config("process", model, k, "buckets of 25 MB", 25, ENGINE, 2),
                        _config("process", model, k, f"buckets of {SMALL[model]:g} MB", SMALL[model], ENGINE, 2)]
        if "sweep" in opts.parts:
            configs += [_config("sweep", model, 2, f"bucket_mb={mb}", mb, ENGINE, 2) for mb in SWEEP[model]]
        if "job" in opts.parts:
            for link in opts.links:
                configs += [_config("job", model, 1, "one bucket", None, ENGINE, 2, link),
                            _config("job", model, 1, "buckets of 25 MB", 25, ENGINE, 2, link),
                            _config("job", model, 1, f"buckets of {SMALL[model]:g} MB", SMALL[model], ENGINE, 2,
                                    link)]
    return configs


def measure(config, opts):
    """One run of ``config``: a process (or, in the job part, a job of 2 workers); its RESULT."""
    env = harness.child_env(**config["engine"], OMP_NUM_THREADS=str(opts.threads))
    argv = [sys.executable, os.path.abspath(__file__), WORKER_FLAG, "--model", config["model"], "--k",
            str(config["k"]), "--steps", str(opts.steps), "--bulk", str(config["bulk"])]
    if config["bucket_mb"] is not None:
        argv += ["--bucket-mb", str(config["bucket_mb"])]
    if config["part"] == "job":
        argv = [sys.executable, "-m", "parallel.launch", "-n", "2", "--start-timeout", "120"] + argv
    return _run(argv, env, opts.timeout, shaped=config["link"] == "1gbit")


def _rows(configs, runs):
    """Each configuration with every step of its runs, its median step and its ratio to the first configuration
    of its group."""
    rows = [dict(config, seconds=[t for run in runs[i] for t in run["seconds"]], buckets=runs[i][-1]["buckets"])
            for i, config in enumerate(configs)]
    for row in rows:
        row["median_ms"] = harness.median(row["seconds"]) * 1000
    return harness.add_ratios(rows, group=lambda r: (r["part"], r["model"], r["k"], r["link"]))


def print_tables(rows):
    for part in dict.fromkeys(r["part"] for r in rows):
        print(f"\n### {part}\n")
        print("\n".join(harness.markdown_table(
            ["model", "K", "link", "configuration", "buckets", "median ms", "ratio"],
            [[r["model"], r["k"], r["link"], r["label"], r["buckets"], f"{r['median_ms']:.1f}", f"{r['ratio']:.2f}"]
             for r in rows if r["part"] == part])))


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python benchmarks/overlap.py", description=__doc__.splitlines()[0])
    parser.add_argument("--parts", action=harness.CommaList, names=PARTS, default=list(PARTS),
                        help="process, sweep, job (comma-separated)")
    parser.add_argument("--models", action=harness.CommaList, names=MODELS, default=list(MODELS),
                        help="lenet, resnet18 (comma-separated)")
    parser.add_argument("--ks", action=harness.CommaList, item=int, minimum=1, default=[2, 4],
                        help="contexts in the process part (comma-separated)")
    parser.add_argument("--links", action=harness.CommaList, names=LINKS, default=list(LINKS),
                        help="plain, 1gbit (comma-separated): the job part's links")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8, help="timed steps a process (after 2 of warm-up)")
    parser.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "1")))
    parser.add_argument("--timeout", type=float, default=900, help="seconds a process may take")
    harness.add_out(parser, "overlap.json")
    opts = parser.parse_args(argv)
    configs = configurations(opts)
    runs = harness.interleave(lambda i: measure(configs[i], opts), range(len(configs)), opts.rounds, "fixed")
    rows = _rows(configs, runs)
    print_tables(rows)
    path = harness.write_json(os.path.join(opts.out, "overlap.json"), {
        "rows": rows, "threads": opts.threads, "rounds": opts.rounds, "steps": opts.steps,
        "command": "python benchmarks/overlap.py " + " ".join(argv or sys.argv[1:])})
    print(f"\nwrote {path}")


def _worker_main(argv):
    parser = argparse.ArgumentParser()
    parser.add_argument(WORKER_FLAG, action="store_true")
    parser.add_argument("--model", required=True)
    parser.add_argument("--k", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--bulk", type=int, required=True)
    parser.add_argument("--bucket-mb", type=float, default=None)
    worker(parser.parse_args(argv))


if __name__ == "__main__":
    if WORKER_FLAG in sys.argv:
        _worker_main(sys.argv[1:])
    else:
        sys.exit(harness.command(main))
