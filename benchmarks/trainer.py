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
- **Overlapping the reduction with the backward pass** (DDP's gradient buckets), K > 1: the step of
  ``parallel``, written out, with each replica's gradients in one buffer (``buckets=1``) or in ``--buckets``
  buffers of about equal size in the parameters' order (``buckets=B``). The reduction of every bucket is queued
  right after the backward, the bucket of the last layers first: MXNet's engine tracks dependencies per
  buffer, so a bucket can start moving as soon as the backward has written its own gradients, while the
  backward of the earlier layers still runs; one buffer must wait for the whole backward.

With ``--kvstores fused,ring,...`` it answers another question instead: the same Trainer step with the package's
allreduce as its kvstore (``parallel.AllreduceKVStore(ALG)``, ``trainer/kv=ALG``) against ``kvstore="device"``,
whole steps and ``reduce+update`` alone, written to ``trainer_kvstore.json``::

    OMP_NUM_THREADS=2 python benchmarks/trainer.py --kvstores fused,ring,tree,naive --ks 2,4

Writes ``trainer.json`` to ``--out``.
"""
import argparse
import json
import os
import platform
import random
import statistics
import sys
import time

LENET_BATCH = 256


def build(network, method, ctx_list, batch_size, lr=0.05):
    """A function that runs one training step of ``network`` by ``method`` on ``ctx_list``."""
    import mxnet as mx
    import numpy as np
    from mxnet import autograd, gluon

    import parallel
    from parallel.comm import DEFAULT_BUCKET_MB
    from parallel.export import to_gluon

    rng = np.random.RandomState(0)
    X = mx.nd.array(rng.rand(batch_size, 1, 28, 28))
    y = mx.nd.array(rng.randint(0, 10, batch_size))
    if network == "lenet":
        lenet_params = parallel.init_lenet_params(seed=0)
        block = to_gluon(lenet_params)
    else:
        block = parallel.init_resnet18(seed=0)
    if method.startswith("trainer"):
        block.collect_params().reset_ctx(ctx_list)
        block.hybridize(static_alloc=True, static_shape=True)
        kvstore = "device"
        if method.startswith("trainer/kv="):   # trainer/kv=ALG[@BUCKET_MB][/reduce+update]
            algorithm, _, bucket_mb = method.split("=")[1].split("/")[0].partition("@")
            kvstore = parallel.AllreduceKVStore(algorithm,
                                                bucket_mb=float(bucket_mb) if bucket_mb else DEFAULT_BUCKET_MB)
        trainer = gluon.Trainer(block.collect_params(), "sgd", {"learning_rate": lr}, kvstore=kvstore)
        loss = gluon.loss.SoftmaxCrossEntropyLoss()

        def step():
            X_shards = gluon.utils.split_and_load(X, ctx_list, even_split=False)
            y_shards = gluon.utils.split_and_load(y, ctx_list, even_split=False)
            with autograd.record():
                losses = [loss(block(X_shard), y_shard) for X_shard, y_shard in zip(X_shards, y_shards)]
            for l in losses:
                l.backward()
            trainer.step(batch_size)
        if method.endswith("reduce+update"):
            step()   # gradients in place, then only the Trainer's reduction and update
            arrays = [array for param in block.collect_params().values() if param.grad_req != "null"
                      for array in param.list_data()]

            def reduce_update():
                for array in arrays:   # what backward() sets: without it, step() skips every parameter
                    array._fresh_grad = True
                trainer.step(batch_size)
            return reduce_update
        return step
    if method == "parallel/lenet":
        device_params = [parallel.get_params(lenet_params, ctx) for ctx in ctx_list]
        return lambda: parallel.train_step(X, y, device_params, ctx_list, lr)
    device_params = [parallel.get_params(block, ctx) for ctx in ctx_list]
    if method.startswith("parallel/buckets="):
        return bucketed_step(block, device_params, ctx_list, X, y, lr, int(method.split("=")[1]))
    net = parallel.GluonNet(block, sync_batchnorm=method == "parallel/syncbn")
    if method == "parallel/reduce+update":
        parallel.train_step(X, y, device_params, ctx_list, lr, net=net)   # gradients in place, then only:
        return lambda: (parallel.allreduce_grads(device_params),
                        parallel.update_replicas(device_params, lr, batch_size))
    return lambda: parallel.train_step(X, y, device_params, ctx_list, lr, net=net)


def bucket_gradients(replica, num_buckets):
    """Give ``replica``'s parameters their gradients in ``num_buckets`` separate buffers, of about equal size,
    in the parameters' order; returns ``[(data, grad), ...]``: each bucket's slice of the replica's flat
    parameter buffer and its own gradient buffer."""
    import mxnet as mx
    from mxnet import autograd

    sizes = [param.size for param in replica]
    total, bounds, start = sum(sizes), [0], 0
    for i in range(1, len(sizes)):   # close a bucket where the running size passes its share
        start += sizes[i - 1]
        if start >= total * len(bounds) / num_buckets and len(bounds) < num_buckets:
            bounds.append(i)
    bounds.append(len(sizes))
    buckets, offset = [], 0
    for first, stop in zip(bounds, bounds[1:]):
        size = sum(sizes[first:stop])
        grad = mx.nd.zeros((size,), ctx=replica.data.context, dtype=replica.data.dtype)
        views, at = [], 0
        for param in replica[first:stop]:
            views.append(grad[at:at + param.size].reshape(param.shape))
            at += param.size
        autograd.mark_variables(list(replica[first:stop]), views)
        buckets.append((replica.data[offset:offset + size], grad))
        offset += size
    return buckets


def bucketed_step(block, device_params, ctx_list, X, y, lr, num_buckets):
    """The ``parallel`` step written out (per-context BatchNorm, fused allreduce, ``sgd_update``), with each
    replica's gradients in ``num_buckets`` buffers, every bucket reduced and updated on its own."""
    import mxnet as mx
    from mxnet import autograd

    import parallel

    net = parallel.GluonNet(block, sync_batchnorm=False)
    buckets = [bucket_gradients(params, num_buckets) for params in device_params]
    loss = parallel.softmax_cross_entropy
    n = X.shape[0]

    def step():
        X_shards, y_shards = parallel.split_and_load(X, ctx_list), parallel.split_and_load(y, ctx_list)
        with autograd.record():
            losses = [loss(net(X_shard, params), y_shard)
                      for X_shard, y_shard, params in zip(X_shards, y_shards, device_params)]
        autograd.backward(losses)
        for b in reversed(range(len(buckets[0]))):   # the backward writes the last layers' gradients first
            parallel.allreduce([replica[b][1] for replica in buckets], "fused")
            for replica in buckets:
                data, grad = replica[b]
                mx.nd.sgd_update(data, grad, lr=lr, wd=0.0, rescale_grad=1.0 / n, out=data)
    return step


def configurations(ks, networks, buckets, kvstores=()):
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
    import mxnet as mx

    import parallel

    ctx_all = parallel.parse_devices(f"cpu:{max(args.ks)}")
    batch = {"lenet": LENET_BATCH, "resnet18": args.resnet_batch}
    configs = configurations(args.ks, args.networks, args.buckets, args.kvstores)
    steps = {}
    for network, method, k in configs:   # build and warm up (graphs, receive buffers) before any timing
        steps[network, method, k] = build(network, method, ctx_all[:k], batch[network])
        for _ in range(2):
            steps[network, method, k]()
        mx.nd.waitall()
    samples = {config: [] for config in configs}
    order = random.Random(0)
    for _ in range(args.repeats):
        for config in order.sample(configs, len(configs)):
            count = args.lenet_steps if config[0] == "lenet" else args.steps
            mx.nd.waitall()
            start = time.perf_counter()
            for _ in range(count):
                steps[config]()
            mx.nd.waitall()
            samples[config].append((time.perf_counter() - start) / count * 1000)
    records = []
    for network, method, k in configs:
        median = statistics.median(samples[network, method, k])
        records.append({"network": network, "method": method, "k": k, "batch_size": batch[network],
                        "median_ms": median, "ms": samples[network, method, k]})
    for r in records:
        key = (r["network"], r["k"], reference(r["method"]))
        ref = next(t for t in records if (t["network"], t["k"], t["method"]) == key)
        r["reference"] = ref["method"]
        r["ratio"] = r["median_ms"] / ref["median_ms"]
    return records


def print_table(result):
    settings = result["settings"]
    print(f"ms per training step, median of {settings['repeats']} interleaved repeats of {settings['lenet_steps']} "
          f"(LeNet) / {settings['steps']} (ResNet-18) step(s); OMP_NUM_THREADS={settings['OMP_NUM_THREADS']}, "
          f"{settings['cores']} cores")
    print(f"{'network':<10}{'K':>3}  {'method':<24}{'ms':>10}{'ratio':>8}  to")
    for r in result["records"]:
        print(f"{r['network']:<10}{r['k']:>3}  {r['method']:<24}{r['median_ms']:>10.2f}{r['ratio']:>8.2f}  "
              f"{r['reference']}")


def _int_list(text):
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ks", type=_int_list, default=[1, 2, 4], help="numbers of CPU contexts; default 1,2,4")
    parser.add_argument("--networks", default="lenet,resnet18",
                        help="comma-separated: lenet, resnet18; default both")
    parser.add_argument("--resnet-batch", type=int, default=32, help="ResNet-18's global batch; default 32")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved repeats; default 5")
    parser.add_argument("--steps", type=int, default=2, help="ResNet-18 steps timed per repeat; default 2")
    parser.add_argument("--lenet-steps", type=int, default=8, help="LeNet steps timed per repeat; default 8")
    parser.add_argument("--buckets", type=int, default=8,
                        help="gradient buckets of the overlap measurement (K > 1); default 8")
    parser.add_argument("--kvstores", default="",
                        help="compare gluon.Trainer with parallel.AllreduceKVStore(ALG, bucket_mb=MB) for these "
                             "comma-separated ALG[@MB] (MB default 25) against kvstore='device' instead (writes "
                             "trainer_kvstore.json)")
    parser.add_argument("--quick", action="store_true", help="smoke test: K=1,2, 2 repeats of 1 step, batch 4")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"),
                        help="directory for trainer.json; default benchmarks/results")
    args = parser.parse_args(argv)
    args.networks = args.networks.split(",")
    args.kvstores = [a for a in args.kvstores.split(",") if a]
    from parallel.comm import ALGORITHMS
    if not {a.partition("@")[0] for a in args.kvstores} <= set(ALGORITHMS):
        parser.error(f"--kvstores takes {', '.join(ALGORITHMS)}, got {','.join(args.kvstores)!r}")
    if not set(args.networks) <= {"lenet", "resnet18"} or not args.networks:
        parser.error(f"--networks takes lenet and/or resnet18, got {','.join(args.networks)!r}")
    if args.quick:
        args.ks, args.repeats, args.steps, args.lenet_steps, args.resnet_batch = [1, 2], 2, 1, 1, 4
    from parallel.files import atomic_write, check_writable
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "trainer_kvstore.json" if args.kvstores else "trainer.json")
    check_writable(path)
    start = time.perf_counter()
    records = run(args)
    settings = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "unset (MXNet: half the cores)"),
                "cores": os.cpu_count(), "ks": args.ks, "networks": args.networks, "repeats": args.repeats,
                "steps": args.steps, "lenet_steps": args.lenet_steps, "buckets": args.buckets,
                "lenet_batch": LENET_BATCH, "resnet_batch": args.resnet_batch, "kvstores": args.kvstores,
                "machine": platform.processor() or platform.machine(), "seconds": time.perf_counter() - start,
                "order": "every configuration once per repeat, in a fresh shuffled order (seed 0)"}
    result = {"settings": settings, "records": records}
    print_table(result)
    with atomic_write(path) as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
