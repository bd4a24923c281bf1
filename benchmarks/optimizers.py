"""Optimizers with state and ZeRO: the bytes each context holds, the update against ``gluon.Trainer.step``, the step
with each ZeRO stage.

Run from the repository root (thread settings change timings 1.5-2x: always state them)::

    OMP_NUM_THREADS=2 python benchmarks/optimizers.py            # about 10 minutes on 2 cores
    OMP_NUM_THREADS=1 python benchmarks/optimizers.py --quick    # smoke test

Three parts, each for LeNet (batch 256) and ResNet-18 (batch ``--resnet-batch``) on K CPU contexts:

- ``memory``: after one step, the bytes each context holds for the parameters, their gradients and the optimizer's
  state (``parallel.optim.memory_per_context``, measured on the arrays), per parameter, for SGD with momentum and
  Adam, ``zero`` 0, 1 and 2. No timing.
- ``update``: the update alone, with the gradients already computed: ``trainer``, ``gluon.Trainer.step`` on the
  same hybridized block on the K contexts (``kvstore="device"``: one reduction and one update per parameter
  array), against ``parallel``, ``parallel.optim.optimizer_step`` (one fused allreduce of the flat gradient
  buffer, one fused update operator per replica) with the same optimizer: ``sgd``, ``momentum`` (0.9),
  ``nesterov`` (the Trainer's ``nag``), ``adam``; and the same with ``zero=1`` (``parallel/zero1``: each context
  updates its shard, then an all-gather) and ``zero=2`` (``parallel/zero2``: reduce-scatter, shard update,
  all-gather). The ratio is the package's time over the Trainer's. On CPU contexts, which share the same cores,
  K replicated updates cost K times one update; the Trainer (``kvstore="device"``) updates once and copies.
- ``step``: the whole training step (``train_step``, per-context BatchNorm) with ``zero`` 0, 1 and 2, SGD with
  momentum and Adam; the ratio is each over ``zero=0``.

One process, one thread setting; in the timed parts every configuration runs once per repeat, in a fresh shuffled
order (interleaved: a slow spell hits all alike); medians. Writes ``optimizers.json`` to ``--out``.
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
#: The optimizers of the update comparison: the package's, and gluon.Trainer's name and arguments for the same.
UPDATE_OPTIMIZERS = {
    "sgd": ({}, "sgd", {}),
    "momentum": ({"momentum": 0.9}, "sgd", {"momentum": 0.9}),
    "nesterov": ({"momentum": 0.9, "nesterov": True}, "nag", {"momentum": 0.9}),
    "adam": ({}, "adam", {}),
}


#: The update comparison's methods: the Trainer, and the package with each ZeRO stage.
UPDATE_METHODS = ("trainer", "parallel", "parallel/zero1", "parallel/zero2")


def _block(network):
    import parallel
    from parallel.export import to_gluon
    return to_gluon(parallel.init_lenet_params(seed=0)) if network == "lenet" else parallel.init_resnet18(seed=0)


def _batch(batch_size):
    import mxnet as mx
    import numpy as np
    rng = np.random.RandomState(0)
    return mx.nd.array(rng.rand(batch_size, 1, 28, 28)), mx.nd.array(rng.randint(0, 10, batch_size))


def _optimizer(name, zero=0, lr=0.01):
    from parallel.optim import SGD, Adam
    if name == "adam":
        return Adam(lr, zero=zero)
    return SGD(lr, zero=zero, **UPDATE_OPTIMIZERS[name][0])


def _replicas(network, ctx_list):
    import parallel
    block = _block(network)
    return block, [parallel.get_params(block, ctx) for ctx in ctx_list], parallel.GluonNet(block,
                                                                                          sync_batchnorm=False)


def memory(network, optimizer, zero, ctx_list, batch_size):
    """Bytes per parameter on the busiest context: parameters, gradients, state, and their sum."""
    import parallel
    from parallel.optim import memory_per_context
    block, device_params, net = _replicas(network, ctx_list)
    opt = _optimizer(optimizer, zero)
    X, y = _batch(batch_size)
    parallel.train_step(X, y, device_params, ctx_list, net=net, optimizer=opt)
    use = memory_per_context(opt, [device_params])
    n = device_params[0].data.size
    busiest = max(use.values(), key=lambda u: u.params + u.grads + u.state)
    return {"parameters": n, "params_bytes": busiest.params, "grads_bytes": busiest.grads,
            "state_bytes": busiest.state, "bytes_per_parameter": (busiest.params + busiest.grads + busiest.state) / n,
            "state_bytes_per_parameter": busiest.state / n}


def build_update(network, method, optimizer, ctx_list, batch_size):
    """A function that runs one update (gradients in place) of ``network`` by ``method`` on ``ctx_list``."""
    import mxnet as mx
    from mxnet import autograd, gluon

    import parallel
    from parallel.optim import optimizer_step
    X, y = _batch(batch_size)
    if method == "trainer":
        block = _block(network)
        block.collect_params().reset_ctx(ctx_list)
        block.hybridize(static_alloc=True, static_shape=True)
        _, name, args = UPDATE_OPTIMIZERS[optimizer]
        trainer = gluon.Trainer(block.collect_params(), name, {"learning_rate": 0.01, **args}, kvstore="device")
        loss = gluon.loss.SoftmaxCrossEntropyLoss()
        X_shards = gluon.utils.split_and_load(X, ctx_list, even_split=False)
        y_shards = gluon.utils.split_and_load(y, ctx_list, even_split=False)
        with autograd.record():
            losses = [loss(block(Xs), ys) for Xs, ys in zip(X_shards, y_shards)]
        autograd.backward(losses)
        arrays = [a for p in block.collect_params().values() if p.grad_req != "null" for a in p.list_data()]

        def update():
            for array in arrays:   # what backward() sets: without it, step() skips every parameter
                array._fresh_grad = True
            trainer.step(batch_size)
        return update
    block, device_params, net = _replicas(network, ctx_list)
    opt = _optimizer(optimizer, zero=int(method[-1]) if method.startswith("parallel/zero") else 0)
    parallel.train_step(X, y, device_params, ctx_list, net=net, optimizer=opt)   # gradients in place
    mx.nd.waitall()
    return lambda: optimizer_step(opt, [device_params], batch_size)


def build_step(network, optimizer, zero, ctx_list, batch_size):
    """A function that runs one whole training step with ``zero``."""
    import parallel
    block, device_params, net = _replicas(network, ctx_list)
    opt = _optimizer(optimizer, zero)
    X, y = _batch(batch_size)
    return lambda: parallel.train_step(X, y, device_params, ctx_list, net=net, optimizer=opt)


def timed(steps, repeats, count):
    """Median ms per call of each function of ``steps`` (a dict), interleaved in shuffled order every repeat."""
    import mxnet as mx
    for step in steps.values():   # warm up: graphs, receive buffers, optimizer state
        for _ in range(2):
            step()
    mx.nd.waitall()
    samples = {key: [] for key in steps}
    order = random.Random(0)
    for _ in range(repeats):
        for key in order.sample(list(steps), len(steps)):
            calls = count(key)
            mx.nd.waitall()
            start = time.perf_counter()
            for _ in range(calls):
                steps[key]()
            mx.nd.waitall()
            samples[key].append((time.perf_counter() - start) / calls * 1000)
    return {key: (statistics.median(ms), ms) for key, ms in samples.items()}


def run(args):
    import parallel
    ctx_all = parallel.parse_devices(f"cpu:{max(args.ks)}")
    batch = {"lenet": LENET_BATCH, "resnet18": args.resnet_batch}
    count = lambda key: args.lenet_steps if key[0] == "lenet" else args.steps   # noqa: E731
    records = []
    if "memory" in args.parts:
        for network in args.networks:
            for optimizer in ("momentum", "adam"):
                for k in args.ks:
                    for zero in (0, 1, 2):
                        records.append({"part": "memory", "network": network, "optimizer": optimizer, "k": k,
                                        "zero": zero, **memory(network, optimizer, zero, ctx_all[:k], batch[network])})
    if "update" in args.parts:
        steps = {(network, method, optimizer, k): build_update(network, method, optimizer, ctx_all[:k], batch[network])
                 for network in args.networks for optimizer in UPDATE_OPTIMIZERS for k in args.ks
                 for method in UPDATE_METHODS}
        for (network, method, optimizer, k), (median, ms) in timed(steps, args.repeats, count).items():
            records.append({"part": "update", "network": network, "method": method, "optimizer": optimizer, "k": k,
                            "median_ms": median, "ms": ms})
    if "step" in args.parts:
        steps = {(network, optimizer, zero, k): build_step(network, optimizer, zero, ctx_all[:k], batch[network])
                 for network in args.networks for optimizer in ("momentum", "adam") for k in args.ks
                 for zero in (0, 1, 2)}
        for (network, optimizer, zero, k), (median, ms) in timed(steps, args.repeats, count).items():
            records.append({"part": "step", "network": network, "optimizer": optimizer, "zero": zero, "k": k,
                            "median_ms": median, "ms": ms})
    _ratios(records)
    return records


def _ratios(records):
    """Each timed record's ratio: the package's update over the Trainer's; a step over the same step at zero=0."""
    for r in records:
        if r["part"] == "update":
            ref = next(t for t in records if t["part"] == "update" and t["method"] == "trainer" and
                       (t["network"], t["optimizer"], t["k"]) == (r["network"], r["optimizer"], r["k"]))
        elif r["part"] == "step":
            ref = next(t for t in records if t["part"] == "step" and t["zero"] == 0 and
                       (t["network"], t["optimizer"], t["k"]) == (r["network"], r["optimizer"], r["k"]))
        else:
            continue
        r["ratio"] = r["median_ms"] / ref["median_ms"]


def print_tables(result):
    settings = result["settings"]
    records = result["records"]
    print(f"OMP_NUM_THREADS={settings['OMP_NUM_THREADS']}, {settings['cores']} cores, medians of "
          f"{settings['repeats']} interleaved repeats")
    for r in records:
        if r["part"] == "memory":
            print(f"memory  {r['network']:<9} {r['optimizer']:<9} K={r['k']} zero={r['zero']}: "
                  f"{r['bytes_per_parameter']:.2f} bytes per parameter on the busiest context "
                  f"(state {r['state_bytes_per_parameter']:.2f})")
    for r in records:
        if r["part"] == "update":
            print(f"update  {r['network']:<9} {r['optimizer']:<9} K={r['k']} {r['method']:<15} {r['median_ms']:9.2f} ms"
                  f"  x{r['ratio']:.2f} the Trainer")
    for r in records:
        if r["part"] == "step":
            print(f"step    {r['network']:<9} {r['optimizer']:<9} K={r['k']} zero={r['zero']} {r['median_ms']:9.2f} ms"
                  f"  x{r['ratio']:.2f} zero=0")


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
    parser.add_argument("--networks", default="lenet,resnet18", help="comma-separated: lenet, resnet18; default both")
    parser.add_argument("--parts", default="memory,update,step", help="comma-separated: memory, update, step")
    parser.add_argument("--resnet-batch", type=int, default=32, help="ResNet-18's global batch; default 32")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved repeats; default 5")
    parser.add_argument("--steps", type=int, default=2, help="ResNet-18 calls timed per repeat; default 2")
    parser.add_argument("--lenet-steps", type=int, default=8, help="LeNet calls timed per repeat; default 8")
    parser.add_argument("--quick", action="store_true", help="smoke test: LeNet, K=1,2, 2 repeats of 1 call")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"),
                        help="directory for optimizers.json; default benchmarks/results")
    args = parser.parse_args(argv)
    args.networks, args.parts = args.networks.split(","), args.parts.split(",")
    if not set(args.networks) <= {"lenet", "resnet18"} or not set(args.parts) <= {"memory", "update", "step"}:
        parser.error("--networks takes lenet and/or resnet18, --parts memory, update and/or step")
    if args.quick:
        args.ks, args.networks, args.repeats, args.steps, args.lenet_steps = [1, 2], ["lenet"], 2, 1, 1
    from parallel.files import atomic_write, check_writable
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "optimizers.json")
    check_writable(path)
    start = time.perf_counter()
    records = run(args)
    settings = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "unset (MXNet: half the cores)"),
                "cores": os.cpu_count(), "ks": args.ks, "networks": args.networks, "parts": args.parts,
                "repeats": args.repeats, "steps": args.steps, "lenet_steps": args.lenet_steps,
                "lenet_batch": LENET_BATCH, "resnet_batch": args.resnet_batch,
                "machine": platform.processor() or platform.machine(), "seconds": time.perf_counter() - start,
                "order": "every timed configuration once per repeat, in a fresh shuffled order (seed 0)"}
    result = {"settings": settings, "records": records}
    print_tables(result)
    with atomic_write(path) as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
