"""Is the composed step slower than the steps it replaced? The ms per training step of the same layouts under this
work tree and under an earlier commit of the repository, interleaved in one run.

Issue 36 replaced the pipeline's, the hybrid strategy's, ZeRO-3's and tensor parallelism's steps of their own by one
composed step (``parallel.strategies.Hybrid``). This script times each layout both ways: the earlier commit
(``--base``, default ``cfc071f``, the last before the change) from a temporary ``git worktree`` of this repository,
this tree as it is; each (layout, version) in a process of its own, every round visiting every pair in a fresh
shuffled order; each sample the median of ``--steps`` timed steps after two of warm-up; the table gives the
medians over the rounds and this tree's time against the earlier one's. Run from the repository root (a clone
with its history)::

    OMP_NUM_THREADS=2 python benchmarks/versions.py --rounds 5
    python benchmarks/versions.py --quick                 # a smoke run: one round of two layouts, a few steps

It writes ``versions.json`` to ``--out`` (default ``benchmarks/results``). Measure on a quiet machine: the
layouts share the cores.
"""
import argparse
import os
import shlex
import shutil
import sys
import tempfile

sys.path.append(os.path.dirname(os.path.abspath(__file__)))   # harness.py, beside this script
import harness  # noqa: E402

#: The layouts timed: name -> (model, make_strategy's arguments, contexts, batch). All exist at the base commit.
LAYOUTS = {
    "data, LeNet, 2 contexts (unchanged: the control)": ("lenet", {"name": "data"}, 2, 256),
    "data, ResNet-18, 2 contexts (unchanged: a larger control)": ("resnet18", {"name": "data"}, 2, 64),
    "data, ZeRO-2, LeNet, 2": ("lenet", {"name": "data", "zero": 2}, 2, 256),
    "data, recompute, LeNet, 2": ("lenet", {"name": "data", "recompute": True}, 2, 256),
    "model, LeNet, 2 stages": ("lenet", {"name": "model", "stages": 2}, 2, 256),
    "pipeline GPipe, LeNet, 2 stages, M=4": ("lenet", {"name": "pipeline", "stages": (2, 4, "gpipe")}, 2, 256),
    "pipeline 1F1B, LeNet, 2 stages, M=4": ("lenet", {"name": "pipeline", "stages": (2, 4, "1f1b")}, 2, 256),
    "hybrid, LeNet, 2 x 2 stages": ("lenet", {"name": "hybrid", "stages": 2}, 4, 256),
    "data, ZeRO-3, ViT, 2": ("vit", {"name": "data", "zero": 3}, 2, 64),
    "data, tensor 2, ViT, 2": ("vit", {"name": "data", "tensor": 2}, 2, 64),
    "hybrid, 2 stages x tensor 2, ViT, 2 x 2 x 2": ("vit", {"name": "hybrid", "stages": 2, "tensor": 2}, 8, 64),
}
QUICK = ["data, LeNet, 2 contexts (unchanged: the control)", "hybrid, LeNet, 2 x 2 stages"]
VERSIONS = ("base", "this")


def child(name, steps):
    """Time ``steps`` steps of layout ``name`` with the package on ``PYTHONPATH``; report the median ms."""
    import mxnet as mx
    from parallel import init_model
    from parallel.optim import SGD
    from parallel.strategies import Stages, make_strategy
    model, options, contexts, batch = LAYOUTS[name]
    options = dict(options)
    if isinstance(options.get("stages"), tuple):
        count, micro, schedule = options["stages"]
        options["stages"] = Stages(count=count, micro_batches=micro, schedule=schedule)
    strategy = make_strategy(params=init_model(model, 0), ctx_list=[mx.cpu(i) for i in range(contexts)], **options)
    optimizer = SGD(0.01, momentum=0.9, zero=options.get("zero", 0))
    X, y = harness.random_batch(batch)

    def step():
        strategy.train_step(X, y, optimizer=optimizer)[0].wait_to_read()
    harness.warm_up([step], 2)
    harness.report_result({"ms": harness.median(1000 * harness.timed(step) for _ in range(steps))})


def _checkout(base):
    """A temporary worktree of this repository at ``base``; its directory."""
    where = tempfile.mkdtemp(prefix="parallel-base-")
    harness.run_process(["git", "worktree", "add", "--detach", "--force", where, base], timeout=300)
    return where


def _measure(roots, steps):
    """``measure((layout, version))``: one child process of that version's tree; its median ms."""
    def measure(key):
        name, version = key
        env = harness.child_env(PYTHONPATH=roots[version])
        out, _ = harness.run_process([sys.executable, os.path.abspath(__file__), "--child", name, "--steps",
                                      str(steps)], env=env, cwd=roots[version], timeout=1800)
        return harness.read_result(out, f"{name} ({version})")["ms"]
    return measure


def run(args, path):
    """Every layout under both versions, interleaved; the table and the JSON (at ``path``)."""
    names = QUICK if args.quick else [n for n in LAYOUTS if not args.layout or any(w in n for w in args.layout)]
    base = _checkout(args.base)
    try:
        roots = {"base": base, "this": harness.ROOT}
        samples = harness.interleave(_measure(roots, args.steps), [(n, v) for n in names for v in VERSIONS],
                                     args.rounds, "shuffle", progress="versions")
    finally:
        try:
            harness.run_process(["git", "worktree", "remove", "--force", base], timeout=300)
        except harness.BenchmarkError:   # a worktree already gone: its directory below, git's record at the next prune
            pass
        shutil.rmtree(base, ignore_errors=True)
    rows, records = [], []
    for name in names:
        base_ms, this_ms = (harness.median(samples[(name, v)]) for v in VERSIONS)
        records.append({"layout": name, "base_ms": base_ms, "this_ms": this_ms, "ratio": this_ms / base_ms,
                        "samples": {v: samples[(name, v)] for v in VERSIONS}})
        rows.append([name, f"{base_ms:.1f}", f"{this_ms:.1f}", f"{this_ms / base_ms:.2f}x"])
    print(f"ms a step, median of {args.rounds} interleaved round(s) of {args.steps} steps; base {args.base}\n")
    print("\n".join(harness.markdown_table(["layout", f"{args.base}", "this tree", "this / base"], rows)))
    harness.write_json(path, {"command": "python benchmarks/versions.py " + shlex.join(args.argv),
                                   "settings": harness.run_settings(), "base": args.base, "rounds": args.rounds,
                                   "steps": args.steps, "layouts": records})


def main(argv=None):
    """The command (see the module's docstring); its exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="cfc071f", help="the earlier commit to compare with; default cfc071f")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds; medians; default 5")
    parser.add_argument("--steps", type=int, default=10, help="timed steps a process; default 10")
    parser.add_argument("--quick", action="store_true", help="one round of two layouts, 3 steps: a smoke run")
    parser.add_argument("--layout", action="append", metavar="TEXT",
                        help="time only the layouts whose name contains TEXT (repeatable); default all")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    harness.add_out(parser, "versions.json")
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.child:
        return child(args.child, args.steps)
    if args.quick:
        args.rounds, args.steps = 1, 3

    def check():
        harness.check_minimum([("--rounds", args.rounds), ("--steps", args.steps)])
        for text in args.layout or ():
            if not any(text in n for n in LAYOUTS):
                raise ValueError(f"--layout {text!r} names no layout; give part of one of: {', '.join(LAYOUTS)}")
        return harness.results_path(args.out, "versions.json")
    return harness.command_status(check, lambda path: run(args, path))


if __name__ == "__main__":
    sys.exit(harness.command(main))
