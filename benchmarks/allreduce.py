"""How fast is each allreduce on this machine, and how close does it come to the memory-copy bound?

Run from the repository root::

    python benchmarks/allreduce.py --devices cpu:4              # the full run: about a minute
    python benchmarks/allreduce.py --quick --out /tmp/results   # smoke test: a few seconds

One run measures, as medians of ``--repeats`` timings:

a. ``allreduce`` of 1 KB .. 64 MB of float32 over K = 2 and 4 contexts (K up to the number of contexts in
   ``--devices``), for every algorithm in ``ALLREDUCE_ALGORITHMS`` and for MXNet's own
   ``kvstore('device')`` push + pull (the same in-place sum);
b. one large copy between two contexts with MXNet (and with numpy, for reference): the memory-copy
   bandwidth, hence each algorithm's bound ``bytes_moved(...).total / bandwidth`` and the fraction of
   it that the algorithm achieves (bound time / measured time; 1 would be a perfect memcpy), for every
   algorithm, K and size (the JSON's ``fraction_of_bound`` table: K -> algorithm -> bytes -> fraction);
c. LeNet's gradient (the 8 tensors of ``LENET_SHAPES``, 129,068 floats): the textbook's per-tensor
   ``naive`` allreduce against one allreduce of the flat gradient buffer with each algorithm.

Every configuration is measured in every repeat, in a fresh shuffled order (round-robin, not one
configuration after another), so a slow spell caused by other processes hits all configurations alike.
Each timing is ``waitall(); start; call; waitall(); stop``: the work is asynchronous.
``allreduce`` receives into persistent buffers (``parallel.comm.buffer_info``): the warm-up call of each
configuration allocates them, the timed calls reuse them; the JSON's ``buffers`` says how many there are
and whether any was dropped for the cache's bound (``evictions``: then timed calls allocated again).
Prints tables and writes ``allreduce.json`` and ``allreduce.png`` to ``--out``.
"""
import argparse
import os
import platform
import sys
import time

sys.path.append(os.path.dirname(os.path.abspath(__file__)))   # harness.py, beside this script
import harness  # noqa: E402
from harness import KB, MB  # noqa: E402

import mxnet as mx  # noqa: E402
import numpy as np  # noqa: E402

from parallel import ALLREDUCE_ALGORITHMS, LENET_SHAPES, allreduce, parse_devices  # noqa: E402
from parallel import comm  # noqa: E402
from parallel.comm import bytes_moved  # noqa: E402

SIZES = [1 * KB, 4 * KB, 16 * KB, 64 * KB, 256 * KB, 1 * MB, 4 * MB, 16 * MB, 64 * MB]
QUICK_SIZES = [1 * KB, 64 * KB, 1 * MB]
ALGORITHMS = list(ALLREDUCE_ALGORITHMS)
METHODS = ALGORITHMS + ["kvstore"]
LENET_SIZE = sum(int(np.prod(shape)) for shape in LENET_SHAPES)   # 129,068 floats
ITEMSIZE = 4                                                      # float32


def thread_settings():
    """The settings that decide how many threads do the work, as strings."""
    env = {name: os.environ.get(name, "unset (MXNet default)")
           for name in ("OMP_NUM_THREADS", "MXNET_CPU_WORKER_NTHREADS")}
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {**env, "nproc": affinity, "cpu_count": os.cpu_count(), "mxnet": mx.__version__,
            "numpy": np.__version__, "python": platform.python_version()}


def measure(cases, repeats):
    """Time every case once per repeat, in a fresh random order each repeat (``harness.time_interleaved``, after
    one untimed call each: first-touch allocations, kvstore merge buffers); returns raw times.

    Parameters
    ----------
    cases : dict
        Key -> callable with no arguments.
    repeats : int
        Timings per case.

    Returns
    -------
    dict
        Key -> list of ``repeats`` times in seconds.
    """
    return harness.time_interleaved(cases, repeats, warmup=1, unit="s")


def allreduce_cases(ctx_list, ks, sizes, kv):
    """Part a: key ("allreduce", k, nbytes, method) -> callable. Arrays are zeros (sums stay zero)."""
    cases = {}
    for k in ks:
        for nbytes in sizes:
            arrays = [mx.nd.zeros(nbytes // ITEMSIZE, ctx=ctx) for ctx in ctx_list[:k]]
            for algorithm in ALGORITHMS:
                cases["allreduce", k, nbytes, algorithm] = (
                    lambda arrays=arrays, algorithm=algorithm: allreduce(arrays, algorithm))
            cases["allreduce", k, nbytes, "kvstore"] = kvstore_allreduce(kv, f"{k}-{nbytes}", arrays)
    return cases


def kvstore_allreduce(kv, key, arrays):
    """MXNet's own allreduce: push sums the arrays into the store, pull copies the sum back."""
    kv.init(key, mx.nd.zeros(arrays[0].shape, ctx=arrays[0].context))

    def push_pull():
        kv.push(key, arrays)
        kv.pull(key, out=arrays)
    return push_pull


def memcpy_cases(ctx_list, nbytes):
    """Part b: one copy of ``nbytes`` between two contexts with MXNet, and one numpy copy."""
    src = mx.nd.zeros(nbytes // ITEMSIZE, ctx=ctx_list[0])
    dst = mx.nd.zeros(nbytes // ITEMSIZE, ctx=ctx_list[1])
    src_np, dst_np = np.zeros(nbytes // ITEMSIZE, "float32"), np.ones(nbytes // ITEMSIZE, "float32")
    return {("memcpy", "mxnet"): lambda: src.copyto(dst),
            ("memcpy", "numpy"): lambda: np.copyto(dst_np, src_np)}


def lenet_cases(ctx_list, ks, kv):
    """Part c: LeNet's gradients as views into one flat buffer per context, as ``get_params`` lays them out.

    "per-tensor naive" is the textbook (one naive allreduce per tensor, what ``train_step`` does with
    ``algorithm="naive"``); "flat <method>" is one allreduce of the whole flat buffer.
    """
    cases = {}
    for k in ks:
        flats = [mx.nd.zeros(LENET_SIZE, ctx=ctx) for ctx in ctx_list[:k]]
        tensors, offset = [[] for _ in flats], 0
        for shape in LENET_SHAPES:
            size = int(np.prod(shape))
            for views, flat in zip(tensors, flats):
                views.append(flat[offset:offset + size].reshape(shape))
            offset += size

        def per_tensor(tensors=tensors):
            for i in range(len(LENET_SHAPES)):
                allreduce([views[i] for views in tensors], "naive")
        cases["lenet", k, "per-tensor naive"] = per_tensor
        for algorithm in ALGORITHMS:
            cases["lenet", k, f"flat {algorithm}"] = lambda flats=flats, a=algorithm: allreduce(flats, a)
        cases["lenet", k, "flat kvstore"] = kvstore_allreduce(kv, f"lenet-{k}", flats)
    return cases


def summarize(times, ks, sizes, memcpy_bytes):
    """Turn raw times into the JSON's records: medians, bounds, fractions of the bound, speed-ups."""
    median = harness.medians(times)
    bandwidth = {lib: memcpy_bytes / median["memcpy", lib] for lib in ("mxnet", "numpy")}
    records = []
    for k in ks:
        for nbytes in sizes:
            for method in METHODS:
                key = ("allreduce", k, nbytes, method)
                record = {"k": k, "nbytes": nbytes, "method": method, "median_s": median[key],
                          "times_s": times[key], "bytes_total": None, "bytes_per_context_max": None,
                          "bound_s": None, "per_context_bound_s": None,
                          "fraction_of_bound": None}
                if method in ALLREDUCE_ALGORITHMS:
                    moved = bytes_moved(method, nbytes, k, itemsize=ITEMSIZE)
                    bound = moved.total / bandwidth["mxnet"]
                    record.update(bytes_total=moved.total, bytes_per_context_max=moved.per_context_max,
                                  bound_s=bound, fraction_of_bound=bound / median[key],
                                  per_context_bound_s=moved.per_context_max / bandwidth["mxnet"])
                records.append(record)
    lenet = []
    for k in ks:
        textbook = median["lenet", k, "per-tensor naive"]
        for method in ["per-tensor naive"] + [f"flat {m}" for m in METHODS]:
            key = ("lenet", k, method)
            lenet.append({"k": k, "method": method, "median_s": median[key], "times_s": times[key],
                          "speedup_vs_per_tensor_naive": textbook / median[key]})
    memcpy = {"nbytes": memcpy_bytes,
              "mxnet_bytes_per_s": bandwidth["mxnet"], "numpy_bytes_per_s": bandwidth["numpy"],
              "mxnet_times_s": times["memcpy", "mxnet"], "numpy_times_s": times["memcpy", "numpy"],
              "definition": "bytes copied once (not read + write) / median time of one copy; "
                            "mxnet: cpu context 0 -> 1 with copyto, numpy: np.copyto"}
    fastest = {}
    for k in ks:
        flat = [r for r in lenet if r["k"] == k and r["method"].startswith("flat ")
                and r["method"][5:] in ALLREDUCE_ALGORITHMS]
        fastest[str(k)] = min(flat, key=lambda r: r["median_s"])["method"][5:]
    return records, lenet, memcpy, fastest


def fraction_table(records):
    """The fraction of the memcpy bound for every K, algorithm and size: {"K": {algorithm: {"bytes": f}}}."""
    table = {}
    for r in records:
        if r["method"] in ALLREDUCE_ALGORITHMS:
            table.setdefault(str(r["k"]), {}).setdefault(r["method"], {})[str(r["nbytes"])] = \
                r["fraction_of_bound"]
    return table


def fmt_time(seconds):
    return f"{seconds * 1e3:9.3f}"


def print_tables(result):
    settings, memcpy = result["settings"], result["memcpy"]
    print(f"mxnet {settings['mxnet']}, numpy {settings['numpy']}, nproc {settings['nproc']}, "
          f"OMP_NUM_THREADS={settings['OMP_NUM_THREADS']}, "
          f"MXNET_CPU_WORKER_NTHREADS={settings['MXNET_CPU_WORKER_NTHREADS']}")
    print(f"devices {settings['devices']}; median of {settings['repeats']} interleaved repeats\n")
    print(f"memcpy bandwidth ({harness.size_label(memcpy['nbytes'])}): MXNet cpu(0)->cpu(1) "
          f"{memcpy['mxnet_bytes_per_s'] / 1e9:.2f} GB/s, numpy {memcpy['numpy_bytes_per_s'] / 1e9:.2f} GB/s")
    for k in settings["ks"]:
        rows = {(r["nbytes"], r["method"]): r for r in result["allreduce"] if r["k"] == k}
        print(f"\nallreduce time (ms), K={k}; bound = 2(K-1)n bytes / MXNet memcpy bandwidth")
        print(f"{'size':>6}" + "".join(f"{m:>10}" for m in METHODS) + f"{'bound':>10}")
        for nbytes in settings["sizes"]:
            bound = rows[nbytes, ALGORITHMS[0]]["bound_s"]
            print(f"{harness.size_label(nbytes):>6}" + "".join(f"{fmt_time(rows[nbytes, m]['median_s']):>10}"
                                                      for m in METHODS) + f"{fmt_time(bound):>10}")
        print(f"fraction of the memcpy bound (bound / measured, 2 significant digits), K={k}; "
              "kvstore/fused = time ratio")
        print(f"{'size':>6}" + "".join(f"{m:>10}" for m in ALGORITHMS) + f"{'kv/fused':>10}")
        for nbytes in settings["sizes"]:
            ratio = rows[nbytes, "kvstore"]["median_s"] / rows[nbytes, "fused"]["median_s"]
            print(f"{harness.size_label(nbytes):>6}" + "".join(f"{rows[nbytes, m]['fraction_of_bound']:>10.2g}"
                                                      for m in ALGORITHMS) + f"{ratio:>10.2f}")
    largest = max(settings["sizes"])
    print(f"\nfraction of the memcpy bound at {harness.size_label(largest)}: " + "; ".join(
        f"K={k}: " + ", ".join(f"{m} {result['fraction_of_bound'][str(k)][m][str(largest)]:.2f}"
                               for m in ALGORITHMS) for k in settings["ks"]))
    buffers = result["buffers"]
    print(f"receive buffers: {buffers['entries']} kept, {buffers['nbytes'] / MB:.1f} MB of a "
          f"{buffers['limit'] / MB:.0f} MB bound, {buffers['allocations']} allocated, "
          f"{buffers['evictions']} dropped" + ("" if not buffers["evictions"] else
                                              " (some timed calls allocated afresh: raise the bound)"))
    for k in settings["ks"]:
        print(f"\nLeNet gradient allreduce, K={k} ({len(LENET_SHAPES)} tensors, {LENET_SIZE:,} floats)")
        print(f"{'method':<20}{'ms':>10}{'speed-up':>10}")
        for r in (r for r in result["lenet"] if r["k"] == k):
            print(f"{r['method']:<20}{fmt_time(r['median_s']):>10}{r['speedup_vs_per_tensor_naive']:>9.2f}x")
    print("\nfastest flat LeNet allreduce: "
          + ", ".join(f"K={k}: {a}" for k, a in result["fastest_lenet_flat"].items()))


def plot(result, path):
    """Time against size, log-log, one line per method and the memcpy bound; one panel per K."""
    ks, sizes = result["settings"]["ks"], result["settings"]["sizes"]
    fig, axes = harness.figure(1, len(ks), figsize=(6 * len(ks), 4.5), squeeze=False)
    for ax, k in zip(axes[0], ks):
        rows = {(r["nbytes"], r["method"]): r for r in result["allreduce"] if r["k"] == k}
        for method in METHODS:
            ax.plot(sizes, [rows[n, method]["median_s"] for n in sizes], marker="o", label=method)
        ax.plot(sizes, [rows[n, ALGORITHMS[0]]["bound_s"] for n in sizes], "k--", label="memcpy bound")
        ax.set(xscale="log", yscale="log", xlabel="message size (bytes)", ylabel="median time (s)",
               title=f"allreduce over K={k} contexts")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    harness.save_figure(fig, path)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", default="cpu:4", help="contexts to use, e.g. cpu:4 (default)")
    parser.add_argument("--quick", action="store_true", help="few sizes, 2 repeats: a smoke test")
    parser.add_argument("--repeats", type=int, default=None, help="timings per configuration "
                        "(default 31, or 2 with --quick)")
    harness.add_out(parser, "allreduce.json and allreduce.png")
    return parser.parse_args(argv)


def _check(args):
    """The arguments' values (``ValueError`` naming the flag): the contexts, and the JSON's path (checked
    writable)."""
    if args.repeats < 1:
        raise ValueError(f"--repeats {args.repeats} is too small; give at least 1")
    ctx_list = parse_devices(args.devices)
    if len(ctx_list) < 2:
        raise ValueError(f"--devices {args.devices!r} gives {len(ctx_list)} context; allreduce needs "
                         "at least 2, use e.g. --devices cpu:4")
    return ctx_list, harness.results_path(args.out, "allreduce.json")


def run(args, ctx_list):
    """Every case timed in every repeat; the JSON's record of them."""
    ks = sorted({k for k in (2, 4, len(ctx_list)) if k <= len(ctx_list)})
    sizes = QUICK_SIZES if args.quick else SIZES
    memcpy_bytes = max(sizes)
    kv = mx.kv.create("device")
    comm.free_buffers()              # count only this run's receive buffers
    cases = {**allreduce_cases(ctx_list, ks, sizes, kv), **memcpy_cases(ctx_list, memcpy_bytes),
             **lenet_cases(ctx_list, ks, kv)}
    start = time.perf_counter()
    times = measure(cases, args.repeats)
    records, lenet, memcpy, fastest = summarize(times, ks, sizes, memcpy_bytes)
    settings = {**thread_settings(), "devices": args.devices, "contexts": [str(c) for c in ctx_list],
                "repeats": args.repeats, "quick": args.quick, "ks": ks, "sizes": sizes, "algorithms": ALGORITHMS,
                "methods": METHODS, "dtype": "float32", "lenet_size": LENET_SIZE,
                "seconds": time.perf_counter() - start,
                "order": "every configuration once per repeat, in a fresh shuffled order (seed 0)"}
    return {"settings": settings, "memcpy": memcpy, "allreduce": records,
            "fraction_of_bound": fraction_table(records), "lenet": lenet, "fastest_lenet_flat": fastest,
            "buffers": comm.buffer_info()._asdict()}


def _run_and_write(args, ctx_list, json_path):
    result = run(args, ctx_list)
    print_tables(result)
    harness.write_json(json_path, result)
    png_path = os.path.join(args.out, "allreduce.png")
    plot(result, png_path)
    print(f"\nwrote {json_path} and {png_path}")


def main(argv=None):
    """Run the benchmark; returns an exit code (0 on success, 2 for bad arguments)."""
    args = parse_args(argv)
    if args.repeats is None:
        args.repeats = 2 if args.quick else 31
    return harness.command_status(lambda: _check(args), lambda checked: _run_and_write(args, *checked))


if __name__ == "__main__":
    sys.exit(harness.command(main))
