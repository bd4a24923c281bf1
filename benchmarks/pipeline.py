"""What does pipelining cost or save? ms per LeNet training step, pipeline vs. model vs. data parallelism.

For K = 2 and 4 stages and M = 1, 2, 4, 8 micro-batches, the pipeline's time per training step (batch 256)
with the GPipe and the 1F1B schedules, next to their bubble fraction (K-1)/(M+K-1) and the micro-batches each
stage holds at once, with model parallelism (K stages, no micro-batches) and
single-context data parallelism as references, and a control: the same micro-batches on one context and
one stage (K = 1), which separates what micro-batching alone does from what overlapping stages does.
All configurations are measured in one run, interleaved (one round visits every configuration, then the
next round), and each number is the median of the rounds.
Run from the repo root::

    python benchmarks/pipeline.py                  # cpu:4, a minute or two on 2 cores
    python benchmarks/pipeline.py --quick          # a few seconds: a smoke test of the script

It prints a table and writes benchmarks/results/pipeline.json and pipeline.png. On CPU contexts that
share the same cores the stages cannot compute at the same time, so the table shows the pipeline's
overhead (more, smaller operations), not a speedup; on separate GPUs the bubble would be the idle time.
"""
import argparse
import os
import sys

sys.path.append(os.path.dirname(os.path.abspath(__file__)))   # harness.py, beside this script
import harness  # noqa: E402
from harness import RESULTS  # noqa: E402

import mxnet as mx  # noqa: E402

from parallel import get_params, init_lenet_params, parse_devices, train_step  # noqa: E402
from parallel.strategies import ModelParallel, Pipeline, bubble_fraction  # noqa: E402

STAGES = (2, 4)            # pipelines measured; K = 1 (micro-batches on one context) is the control
MICRO_BATCHES = (1, 2, 4, 8)
LR = 0.01   # small: many steps on one batch must not diverge (the value does not change the time)


def thread_settings():
    """The settings that decide how many threads compute: as set in the environment, and the GPU count."""
    return {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "unset"),
            "MXNET_CPU_WORKER_NTHREADS": os.environ.get("MXNET_CPU_WORKER_NTHREADS", "unset"),
            "num_gpus": mx.context.num_gpus(), "cpu_count": os.cpu_count()}


def configurations(ctx_list, X, y):
    """Every configuration to time: a dict of its description and ``step()``, one training step."""
    def data_step(device_params=[get_params(init_lenet_params(seed=0), ctx_list[0])]):
        return train_step(X, y, device_params, ctx_list[:1], LR)[0]

    configs = [{"strategy": "data", "stages": 1, "micro_batches": None, "bubble_fraction": None,
                "contexts": 1, "step": data_step}]
    for k in (1,) + STAGES:
        if k > len(ctx_list):
            continue
        if k > 1:
            model = ModelParallel(init_lenet_params(seed=0), ctx_list, stages=k)
            configs.append({"strategy": "model", "stages": k, "micro_batches": None,
                            "bubble_fraction": bubble_fraction(k, 1), "contexts": k,
                            "step": lambda model=model: model.train_step(X, y, LR)[0]})
        for schedule in ("gpipe",) + (("1f1b",) if k > 1 else ()):
            for m in MICRO_BATCHES:
                pipe = Pipeline(init_lenet_params(seed=0), ctx_list, stages=k, micro_batches=m, schedule=schedule)
                configs.append({"strategy": "pipeline", "schedule": schedule, "stages": k, "micro_batches": m,
                                "bubble_fraction": bubble_fraction(k, m), "contexts": k,
                                "stashed_peak": pipe.plan().stashed_peak,
                                "step": lambda pipe=pipe: pipe.train_step(X, y, LR)[0]})
    return configs


def label(config):
    if config["strategy"] == "data":
        return "data, 1 context"
    if config["strategy"] == "model":
        return f"model, K={config['stages']}"
    if config["stages"] == 1:
        return f"micro-batches, K=1 M={config['micro_batches']}"
    return f"{config['schedule']}, K={config['stages']} M={config['micro_batches']}"


def format_table(results, reference):
    lines = [f"{'configuration':<24}{'K':>3}{'M':>4}{'bubble':>9}{'ms/step':>10}{'vs data':>9}  held"]
    for r in results:
        m = "-" if r["micro_batches"] is None else str(r["micro_batches"])
        bubble = "-" if r["bubble_fraction"] is None else f"{r['bubble_fraction']:.3f}"
        held = "" if "stashed_peak" not in r or r["stages"] == 1 else f"  {r['stashed_peak']}"
        lines.append(f"{label(r):<24}{r['stages']:>3}{m:>4}{bubble:>9}{r['ms_per_step']:>10.1f}"
                     f"{r['ms_per_step'] / reference:>8.2f}x{held}")
    return "\n".join(lines)


def plot(report, path):
    results = report["results"]
    fig, (ax_time, ax_bubble) = harness.figure(1, 2, figsize=(10, 3.8))
    for k in sorted({r["stages"] for r in results if r["strategy"] == "pipeline"}):
        rows = [r for r in results if r["strategy"] == "pipeline" and r["stages"] == k and r["schedule"] == "gpipe"]
        line, = ax_time.plot([r["micro_batches"] for r in rows], [r["ms_per_step"] for r in rows],
                             "o-" if k > 1 else "s--",
                             label=f"gpipe, K={k}" if k > 1 else "micro-batches only, K=1")
        later = [r for r in results if r["strategy"] == "pipeline" and r["stages"] == k and r["schedule"] == "1f1b"]
        if later:
            ax_time.plot([r["micro_batches"] for r in later], [r["ms_per_step"] for r in later], "^:",
                         color=line.get_color(), label=f"1f1b, K={k}")
        ax_bubble.plot([r["micro_batches"] for r in rows], [r["bubble_fraction"] for r in rows], "o-",
                       color=line.get_color(), label=f"K={k}")
        for r in results:
            if r["strategy"] == "model" and r["stages"] == k:
                ax_time.axhline(r["ms_per_step"], color=line.get_color(), ls=":", label=f"model, K={k}")
    data = next(r for r in results if r["strategy"] == "data")
    ax_time.axhline(data["ms_per_step"], color="black", ls="--", label="data, 1 context")
    ax_time.set_ylabel(f"ms per step (batch {report['batch_size']}, median)")
    ax_time.set_ylim(bottom=0)
    ax_bubble.set_ylabel("bubble fraction (K-1)/(M+K-1)")
    ax_bubble.set_ylim(0, 1)
    for ax in (ax_time, ax_bubble):
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(MICRO_BATCHES))
        ax.set_xticklabels([str(m) for m in MICRO_BATCHES])
        ax.set_xlabel("micro-batches M")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    threads = report["threads"]
    fig.suptitle(f"LeNet pipeline on {report['devices']} (OMP_NUM_THREADS={threads['OMP_NUM_THREADS']}, "
                 f"{threads['cpu_count']} cores, {threads['num_gpus']} GPUs)", fontsize=10)
    harness.save_figure(fig, path)


def build_parser():
    parser = argparse.ArgumentParser(prog="python benchmarks/pipeline.py", description=__doc__.splitlines()[0])
    parser.add_argument("--devices", default="cpu:4", help="contexts, as for parallel.train; default cpu:4")
    parser.add_argument("--batch-size", type=int, default=256, help="default 256")
    parser.add_argument("--repeats", type=int, default=7, help="interleaved rounds; the median is reported")
    parser.add_argument("--steps", type=int, default=4, help="training steps per configuration per round")
    parser.add_argument("--quick", action="store_true", help="1 round of 1 step: a few seconds, for smoke tests")
    parser.add_argument("--json", default=os.path.join(RESULTS, "pipeline.json"), help="where the JSON goes")
    parser.add_argument("--plot", default=os.path.join(RESULTS, "pipeline.png"), help="where the PNG goes")
    return parser


def _check(args):
    """The arguments' values (``--quick`` applied); the contexts. ``ValueError`` naming the flag."""
    if args.quick:
        args.repeats, args.steps = 1, 1
    if args.repeats < 1 or args.steps < 1:
        raise ValueError(f"--repeats and --steps must be >= 1, got {args.repeats} and {args.steps}")
    if args.batch_size < max(MICRO_BATCHES):
        raise ValueError(f"--batch-size must be at least {max(MICRO_BATCHES)} (the most micro-batches), "
                         f"got {args.batch_size}")
    ctx_list = parse_devices(args.devices)
    if len(ctx_list) < min(STAGES):
        raise ValueError(f"a pipeline of {min(STAGES)} stages needs {min(STAGES)} contexts, {args.devices!r} "
                         f"gives {len(ctx_list)}; use --devices cpu:4")
    return ctx_list


def run(args, argv, ctx_list):
    """Every configuration timed in every round on ``ctx_list``; the table printed, the JSON and PNG written."""
    X, y = harness.random_batch(args.batch_size)
    configs = configurations(ctx_list, X, y)
    threads = thread_settings()
    print(f"threads: OMP_NUM_THREADS={threads['OMP_NUM_THREADS']}, "
          f"MXNET_CPU_WORKER_NTHREADS={threads['MXNET_CPU_WORKER_NTHREADS']}, "
          f"mx.context.num_gpus()={threads['num_gpus']}, os.cpu_count()={threads['cpu_count']}")
    print(f"LeNet, batch {args.batch_size}, on {args.devices}: median of {args.repeats} interleaved round(s) "
          f"of {args.steps} step(s) per configuration", flush=True)
    timings = harness.time_interleaved({i: config["step"] for i, config in enumerate(configs)}, args.repeats,
                                       calls=args.steps, order="fixed")   # every configuration once a round
    results = [{key: value for key, value in config.items() if key != "step"} for config in configs]
    for i, result in enumerate(results):
        result["ms_per_step"] = harness.median(timings[i])
        result["ms_per_step_rounds"] = timings[i]
    print(format_table(results, results[0]["ms_per_step"]))
    report = {"benchmark": "pipeline", "command": " ".join(["python benchmarks/pipeline.py", *argv]),
              "devices": args.devices, "batch_size": args.batch_size, "repeats": args.repeats,
              "steps_per_round": args.steps, "quick": args.quick, "threads": threads,
              "mxnet_version": mx.__version__, "results": results}
    harness.write_json(args.json, report)
    plot(report, args.plot)
    print(f"wrote {args.json} and {args.plot}")
    return report


def main(argv=None):
    """Run the benchmark; returns the exit status (2 with one ``error:`` line for bad arguments)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    return harness.command_status(lambda: _check(args), lambda ctx_list: run(args, argv, ctx_list))


if __name__ == "__main__":
    sys.exit(harness.command(main))
