"""Where does a training step's time go? MXNet's profiler on one step of LeNet and of ResNet-18.

Run from the repository root (state the thread setting with the numbers)::

    OMP_NUM_THREADS=2 python benchmarks/profile_step.py
    OMP_NUM_THREADS=1 python benchmarks/profile_step.py --quick     # smoke test

For each network, on one CPU context: a few warm-up steps, then ``--steps`` steps of ``parallel.train_step``
under ``mx.profiler`` (``profile_all``, aggregated per operator), with MXNet's bulk execution turned off
(``MXNET_EXEC_BULK_EXEC_TRAIN=0``, set here before MXNet starts) so that every operator is timed on its
own instead of in fused groups. LeNet is the package's from-scratch ``lenet_cached`` (batch 256), ResNet-18
the textbook's variant through ``GluonNet`` (batch ``--resnet-batch``).

The convolutions' arithmetic (2 x multiply-adds of every output, from the graph's shapes; the backward pass
counted as twice the forward: the gradients of the input and of the weights) divided by their measured
time gives their FLOP rate, compared with this machine's measured peak: the best of a large float32
matrix product through numpy's BLAS and through MXNet (``mx.nd.dot``), on the same threads.
Writes ``profile_step.json`` to ``--out``.
"""
import argparse
import json
import os
import sys
import time

sys.path.append(os.path.dirname(os.path.abspath(__file__)))   # harness.py, beside this script
import harness  # noqa: E402

os.environ.setdefault("MXNET_EXEC_BULK_EXEC_TRAIN", "0")
os.environ.setdefault("MXNET_EXEC_BULK_EXEC_INFERENCE", "0")


def conv_flops(symbol, data_shape):
    """Forward FLOPs of every Convolution of ``symbol`` for an input of ``data_shape``: {node name: flops}."""
    graph = json.loads(symbol.tojson())
    internals = symbol.get_internals()
    outputs = internals.list_outputs()
    flops = {}
    for node in graph["nodes"]:
        if node["op"] != "Convolution":
            continue
        out = internals[outputs.index(node["name"] + "_output")]
        arg_shapes, out_shapes, _ = out.infer_shape(data=data_shape)
        weight = dict(zip(out.list_arguments(), arg_shapes))[graph["nodes"][node["inputs"][1][0]]["name"]]
        per_output = 1
        for d in weight[1:]:   # (out channels, in channels / groups, kh, kw)
            per_output *= d
        size = 1
        for d in out_shapes[0]:
            size *= d
        flops[node["name"]] = 2 * size * per_output
    return flops


def measured_peak(seconds=1.0):
    """GFLOP/s of a 2048x2048 float32 matrix product, best of numpy and MXNet (``mx.nd.dot``)."""
    import mxnet as mx
    import numpy as np
    n = 2048
    a = np.random.RandomState(0).rand(n, n).astype(np.float32)
    best = {}
    for name, product in (("numpy", lambda: a @ a),
                          ("mxnet", lambda: mx.nd.dot(A, A).wait_to_read())):
        if name == "mxnet":
            A = mx.nd.array(a)
        product()
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            product()
            count += 1
        best[name] = 2 * n ** 3 * count / (time.perf_counter() - start) / 1e9
    return best


def profile(network, batch_size, steps, filename):
    """``steps`` steps of ``network`` on one context under MXNet's profiler: the operators' times, and the
    convolutions' arithmetic and FLOP rate."""
    import mxnet as mx

    import parallel
    from parallel.export import lenet_symbol

    ctx = mx.cpu(0)
    X, y = harness.random_batch(batch_size)
    if network == "lenet":
        params = [parallel.get_params(parallel.init_lenet_params(seed=0), ctx)]
        net, symbol = parallel.lenet_cached, lenet_symbol()
    else:
        block = parallel.init_resnet18(seed=0)
        params = [parallel.get_params(block, ctx)]
        net = parallel.GluonNet(block)
        symbol = net.symbol
    for _ in range(2):
        parallel.train_step(X, y, params, [ctx], 0.05, net=net)
    mx.nd.waitall()
    mx.profiler.set_config(profile_all=True, aggregate_stats=True,
                           filename=filename)
    mx.profiler.set_state("run")
    start = time.perf_counter()
    for _ in range(steps):
        parallel.train_step(X, y, params, [ctx], 0.05, net=net)
    mx.nd.waitall()
    wall_ms = (time.perf_counter() - start) * 1000 / steps
    mx.profiler.set_state("stop")
    stats = json.loads(mx.profiler.dumps(reset=True, format="json"))["Time"]["operator"]
    operators = sorted(({"operator": name, "count": s["Count"] // steps, "ms": s["Total"] / steps}
                        for name, s in stats.items()), key=lambda r: -r["ms"])
    total = sum(r["ms"] for r in operators)
    for r in operators:
        r["fraction"] = r["ms"] / total
    forward = sum(conv_flops(symbol, (batch_size, 1, 28, 28)).values())
    conv_ms = sum(r["ms"] for r in operators if r["operator"] in ("Convolution", "_backward_Convolution"))
    return {"network": network, "batch_size": batch_size, "steps": steps, "wall_ms_per_step": wall_ms,
            "operator_ms_per_step": total, "operators": operators,
            "conv_forward_gflop": forward / 1e9, "conv_step_gflop": 3 * forward / 1e9,
            "conv_ms": conv_ms, "conv_fraction": conv_ms / total,
            "conv_gflops": 3 * forward / (conv_ms / 1000) / 1e9 if conv_ms else 0.0}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--resnet-batch", type=int, default=32, help="ResNet-18's batch; default 32")
    parser.add_argument("--steps", type=int, default=3, help="profiled steps; default 3")
    parser.add_argument("--quick", action="store_true", help="smoke test: 1 step, ResNet-18 batch 2")
    harness.add_out(parser, "profile_step.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.resnet_batch = 1, 2
    path = harness.results_path(args.out, "profile_step.json")
    peak = measured_peak(0.2 if args.quick else 2.0)
    import mxnet as mx

    from parallel.files import scratch_file
    profiled = scratch_file("parallel-profile-", ".json")   # MXNet's profiler writes there; it goes at exit
    results = [profile("lenet", harness.LENET_BATCH, args.steps, profiled),
               profile("resnet18", args.resnet_batch, args.steps, profiled)]
    mx.profiler.dump()   # now, into the scratch file that goes at exit: else MXNet writes it at its teardown
    best_peak = max(peak.values())
    settings = {**harness.run_settings(), "MXNET_EXEC_BULK_EXEC_TRAIN": os.environ["MXNET_EXEC_BULK_EXEC_TRAIN"]}
    for r in results:
        r["conv_fraction_of_peak"] = r["conv_gflops"] / best_peak
        print(f"\n{r['network']}, batch {r['batch_size']}, one context, OMP_NUM_THREADS="
              f"{settings['OMP_NUM_THREADS']}: {r['wall_ms_per_step']:.1f} ms per step (profiled), operators "
              f"{r['operator_ms_per_step']:.1f} ms")
        print(f"{'operator':<44}{'calls':>6}{'ms':>10}{'share':>8}")
        for op in r["operators"][:12]:
            print(f"{op['operator'][:43]:<44}{op['count']:>6}{op['ms']:>10.2f}{op['fraction']:>8.1%}")
        print(f"convolutions: {r['conv_step_gflop']:.2f} GFLOP per step (forward {r['conv_forward_gflop']:.2f} x 3) "
              f"in {r['conv_ms']:.1f} ms = {r['conv_gflops']:.1f} GFLOP/s, {r['conv_fraction_of_peak']:.0%} of "
              f"the measured peak {best_peak:.1f} GFLOP/s")
    print(f"\nmeasured peak, 2048x2048 float32 matrix product: numpy {peak['numpy']:.1f} GFLOP/s, "
          f"mx.nd.dot {peak['mxnet']:.1f} GFLOP/s")
    print(f"wrote {harness.write_json(path, {'settings': settings, 'peak_gflops': peak, 'results': results})}")
    return 0


if __name__ == "__main__":
    sys.exit(harness.command(main))
