"""The from-scratch step against MXNet's ``gluon.Trainer`` on the same hybridized network, LeNet and ResNet-18.

Run from the repository root (thread settings change timings 1.5-2x: always state them)::

    OMP_NUM_THREADS=2 python benchmarks/trainer.py            # a few minutes on 2 cores
    OMP_NUM_THREADS=1 python benchmarks/trainer.py --quick    # smoke test

One process, one thread setting (``OMP_NUM_THREADS``, read by MXNet at start), every configuration
measured in every repeat in a fresh shuffled order (interleaved: a slow spell hits all alike); medians.
For each network (the textbook's LeNet, batch 256; ResNet-18, batch ``--resnet-batch``) and K contexts:

- ``trainer``: gluon's way, the concise chapter: the block initialized on the K contexts, hybridized
  (``static_alloc``, ``static_shape``), ``gluon.utils.split_and_load``, one backward per context and
  ``gluon.Trainer(..., "sgd", kvstore="device").step`` (one reduction and one update per parameter array);
- ``parallel``: this package's step on the very same block: ``get_params(block, ctx)`` flat replicas,
  ``train_step(..., net=GluonNet(block, sync_batchnorm=False))``: per-context BatchNorm, the same
  arithmetic as the Trainer, one flat allreduce and one fused ``sgd_update`` per replica;
- ``parallel/syncbn`` (ResNet-18, K > 1): the same with synchronized BatchNorm (the default of
  ``train_step(net=block)``): whole-batch statistics, the one-context model; runs the graph op by op;
- ``parallel/lenet`` (LeNet): the package's from-scratch ``lenet_cached`` (parameters as plain arrays).

Two more questions, each answered by a pair measured in the same repeats (the ratio column compares each
row with the first of its pair):

- **The part this package owns**, the reduction and the update, with the gradients already computed:
  ``trainer/reduce+update`` is ``Trainer.step`` alone (one kvstore push and pull, or one update, per parameter
  array: 8 for LeNet, 76 for ResNet-18), ``parallel/reduce+update`` is ``allreduce_grads`` (one fused reduction
  of the flat gradient buffer) + ``update_replicas`` (one ``sgd_update`` per replica).
- **Overlapping the reduction with the backward pass** (DDP's gradient buckets), K > 1: ``parallel``'s step with
  a ``Reducer("fused", bucket_mb=...)`` that lays each replica's gradients out in one buffer (``buckets=1``) or in
  at most ``--buckets`` (``buckets=B``: the smallest ``bucket_mb`` that gives no more), the last layers' bucket
  first. ``Reducer.reduce`` queues every bucket's sum right after the backward, and MXNet's engine starts each
  one as soon as the backward has written its gradients, while the earlier layers' backward still runs; one
  buffer must wait for the whole backward. (``benchmarks/overlap.py`` asks the same of ``train_batch`` in fresh
  processes, with and without the engine settings, and across processes; here it is the Trainer's block with
  per-context BatchNorm, beside the Trainer.)

With ``--kvstores fused,ring,...`` it answers another question instead: the same Trainer step with the package's
allreduce as its kvstore (``parallel.AllreduceKVStore(ALG)``, ``trainer/kv=ALG``) against ``kvstore="device"``,
whole steps and ``reduce+update`` alone, written to ``trainer_kvstore.json``::

    OMP_NUM_THREADS=2 python benchmarks/trainer.py --kvstores fused,ring,tree,naive --ks 2,4

Writes ``trainer.json`` to ``--out``.
"""
import argparse
import os
import sys
import time

sys.path.append(os.path.dirname(os.path.abspath(__file__)))   # harness.py, beside this script
import harness  # noqa: E402


def build(network, method, ctx_list, batch_size, lr=0.05):
    """One training step of ``network`` by ``method`` on ``ctx_list``, as a function of no arguments.

    Returns
    -------
    (callable, dict)
        The step, and what its record states besides its times (``buckets=B``: the ``bucket_mb`` and the buckets
        it gave).
    """
    import parallel

    X, y = harness.random_batch(batch_size)
    if method == "parallel/lenet":
        device_params = [parallel.get_params(parallel.init_lenet_params(seed=0), ctx) for ctx in ctx_list]
        return (lambda: parallel.train_step(X, y, device_params, ctx_list, lr)), {}
    block = harness.gluon_network(network)
    if method.startswith("trainer"):
        return _trainer_step(block, method, ctx_list, X, y, lr), {}
    net = parallel.GluonNet(block, sync_batchnorm=method == "parallel/syncbn")
    if method.startswith("parallel/buckets="):   # the Reducer's buckets, each summed while backward still runs
        reducer, device_params = bucketed_replicas(block, ctx_list, int(method.split("=")[1]))
        return (lambda: parallel.train_step(X, y, device_params, ctx_list, lr, net=net, reducer=reducer)), {
            "bucket_mb": reducer.bucket_mb, "buckets": len(device_params[0].buckets)}
    device_params = [parallel.get_params(block, ctx) for ctx in ctx_list]
    if method == "parallel/reduce+update":
        parallel.train_step(X, y, device_params, ctx_list, lr, net=net)   # gradients in place, then only:
        return (lambda: (parallel.allreduce_grads(device_params),
                         parallel.update_replicas(device_params, lr, batch_size))), {}
    return (lambda: parallel.train_step(X, y, device_params, ctx_list, lr, net=net)), {}


def _trainer_step(block, method, ctx_list, X, y, lr):
    """gluon's way (``trainer``), with the package's allreduce as its kvstore (``trainer/kv=ALG[@BUCKET_MB]``), or
    ``Trainer.step`` alone on gradients in place (``.../reduce+update``)."""
    import parallel
    from parallel.comm import DEFAULT_BUCKET_MB

    kvstore = "device"
    if method.startswith("trainer/kv="):   # trainer/kv=ALG[@BUCKET_MB][/reduce+update]
        algorithm, _, bucket_mb = method.split("=")[1].split("/")[0].partition("@")
        kvstore = parallel.AllreduceKVStore(algorithm, bucket_mb=float(bucket_mb) if bucket_mb else DEFAULT_BUCKET_MB)
    trainer = harness.gluon_trainer(block, ctx_list, "sgd", {"learning_rate": lr}, kvstore=kvstore)
    step = harness.gluon_step(block, trainer, X, y, ctx_list)
    if method.endswith("reduce+update"):
        step()   # gradients in place, then only the Trainer's reduction and update
        return harness.trainer_update(block, trainer, X.shape[0])
    return step


def bucket_mb_for(sizes, num_buckets, itemsize=4):
    """The smallest ``bucket_mb`` whose buckets (``parallel.comm.replica.bucket_ranges``) lay arrays of ``sizes``
    elements out in at most ``num_buckets``; None (one bucket) for ``num_buckets`` 1."""
    from parallel.comm.replica import bucket_ranges
    if num_buckets <= 1:
        return None
    low, high = max(sizes) * itemsize, sum(sizes) * itemsize   # bytes; fewer buckets as the bound grows
    while low < high:
        middle = (low + high) // 2
        if len(bucket_ranges(sizes, itemsize, middle)) <= num_buckets:
            high = middle
        else:
            low = middle + 1
    return low / 2 ** 20


def bucketed_replicas(block, ctx_list, num_buckets):
    """A ``Reducer("fused", bucket_mb)`` whose buckets lay each replica's gradients out in at most ``num_buckets``
    buffers (``bucket_mb_for``; one buffer for 1), and ``block``'s replicas on ``ctx_list``, laid out by it."""
    import parallel

    sizes = [param.size for param in parallel.get_params(block, ctx_list[0])]
    reducer = parallel.Reducer("fused", bucket_mb=bucket_mb_for(sizes, num_buckets))
    return reducer, reducer.replicate(block, ctx_list)


def configurations(ks, networks, buckets, kvstores=()):
    """``(network, method, k)`` of every configuration measured, each pair's reference first."""
    configs = []
    for network in networks:
        for k in ks:
            if kvstores:
                methods = ["trainer", *(f"trainer/kv={a}" for a in kvstores), "trainer/reduce+update",
                           *(f"trainer/kv={a}/reduce+update" for a in kvstores)]
                configs += [(network, method, k) for method in methods]
                continue
            methods = ["trainer", "parallel"]
            methods += ["parallel/lenet"] if network == "lenet" else (["parallel/syncbn"] if k > 1 else [])
            methods += ["trainer/reduce+update", "parallel/reduce+update"]
            methods += ["parallel/buckets=1", f"parallel/buckets={buckets}"] if k > 1 else []
            configs += [(network, method, k) for method in methods]
    return configs


def reference(method):
    """The method a record's ratio is taken against (the first of its pair; the Trainer for whole steps)."""
    if method.endswith("reduce+update"):
        return "trainer/reduce+update"
    return "parallel/buckets=1" if method.startswith("parallel/buckets=") else "trainer"


def run(args):
    """Every configuration timed in every repeat (``harness.time_interleaved``); the records, with their ratios."""
    import parallel

    ctx_all = parallel.parse_devices(f"cpu:{max(args.ks)}")
    batch = {"lenet": harness.LENET_BATCH, "resnet18": args.resnet_batch}
    steps, info = {}, {}
    for network, method, k in configurations(args.ks, args.networks, args.buckets, args.kvstores):
        steps[network, method, k], info[network, method, k] = build(network, method, ctx_all[:k], batch[network])
    samples = harness.time_interleaved(steps, args.repeats, warmup=2,
                                       calls=lambda key: args.lenet_steps if key[0] == "lenet" else args.steps)
    records = [{"network": network, "method": method, "k": k, "batch_size": batch[network],
                "median_ms": harness.median(ms), "ms": ms, "reference": reference(method),
                **info[network, method, k]} for (network, method, k), ms in samples.items()]
    return harness.add_ratios(records, group=lambda r: (r["network"], r["k"], r["reference"]),
                              reference=lambda r: r["method"] == r["reference"])


def print_table(result):
    settings = result["settings"]
    print(f"ms per training step, median of {settings['repeats']} interleaved repeats of {settings['lenet_steps']} "
          f"(LeNet) / {settings['steps']} (ResNet-18) step(s); OMP_NUM_THREADS={settings['OMP_NUM_THREADS']}, "
          f"{settings['cores']} cores")
    print(f"{'network':<10}{'K':>3}  {'method':<24}{'ms':>10}{'ratio':>8}  to")
    for r in result["records"]:
        print(f"{r['network']:<10}{r['k']:>3}  {r['method']:<24}{r['median_ms']:>10.2f}{r['ratio']:>8.2f}  "
              f"{r['reference']}")


def parse_args(argv=None):
    """The benchmark's arguments (``--quick`` applied)."""
    from parallel.comm import ALGORITHMS
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    harness.add_network_flags(parser)
    parser.add_argument("--buckets", type=int, default=8,
                        help="gradient buckets of the overlap measurement (K > 1); default 8")
    parser.add_argument("--kvstores", default="",
                        help="compare gluon.Trainer with parallel.AllreduceKVStore(ALG, bucket_mb=MB) for these "
                             "comma-separated ALG[@MB] (MB default 25) against kvstore='device' instead (writes "
                             "trainer_kvstore.json)")
    parser.add_argument("--quick", action="store_true", help="smoke test: K=1,2, 2 repeats of 1 step, batch 4")
    harness.add_out(parser, "trainer.json")
    args = parser.parse_args(argv)
    args.kvstores = [a for a in args.kvstores.split(",") if a]
    if not {a.partition("@")[0] for a in args.kvstores} <= set(ALGORITHMS):
        parser.error(f"--kvstores takes {', '.join(ALGORITHMS)}, got {','.join(args.kvstores)!r}")
    if args.quick:
        args.ks, args.repeats, args.steps, args.lenet_steps, args.resnet_batch = [1, 2], 2, 1, 1, 4
    return args


def main(argv=None):
    args = parse_args(argv)
    path = harness.results_path(args.out, "trainer_kvstore.json" if args.kvstores else "trainer.json")
    start = time.perf_counter()
    records = run(args)
    settings = {**harness.run_settings(), **harness.network_settings(args), "buckets": args.buckets,
                "kvstores": args.kvstores, "seconds": time.perf_counter() - start,
                "order": "every configuration once per repeat, in a fresh shuffled order (seed 0)"}
    result = {"settings": settings, "records": records}
    print_table(result)
    print(f"wrote {harness.write_json(path, result)}")
    return 0


if __name__ == "__main__":
    sys.exit(harness.command(main))
