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
import os
import sys
import time

sys.path.append(os.path.dirname(os.path.abspath(__file__)))   # harness.py, beside this script
import harness  # noqa: E402

#: The optimizers of the update comparison: the package's, and gluon.Trainer's name and arguments for the same.
UPDATE_OPTIMIZERS = {
    "sgd": ({}, "sgd", {}),
    "momentum": ({"momentum": 0.9}, "sgd", {"momentum": 0.9}),
    "nesterov": ({"momentum": 0.9, "nesterov": True}, "nag", {"momentum": 0.9}),
    "adam": ({}, "adam", {}),
}


#: The update comparison's methods: the Trainer, and the package with each ZeRO stage.
UPDATE_METHODS = ("trainer", "parallel", "parallel/zero1", "parallel/zero2")
#: The parts a run may measure (``--parts``).
PARTS = ("memory", "update", "step")


def _optimizer(name, zero=0, lr=0.01):
    from parallel.optim import SGD, Adam
    if name == "adam":
        return Adam(lr, zero=zero)
    return SGD(lr, zero=zero, **UPDATE_OPTIMIZERS[name][0])


def _replicas(network, ctx_list):
    import parallel
    block = harness.gluon_network(network)
    return block, [parallel.get_params(block, ctx) for ctx in ctx_list], parallel.GluonNet(block,
                                                                                          sync_batchnorm=False)


def memory(network, optimizer, zero, ctx_list, batch_size):
    """Bytes per parameter on the busiest context: parameters, gradients, state, and their sum."""
    import parallel
    from parallel.optim import memory_per_context
    block, device_params, net = _replicas(network, ctx_list)
    opt = _optimizer(optimizer, zero)
    X, y = harness.random_batch(batch_size)
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

    import parallel
    from parallel.optim import optimizer_step
    X, y = harness.random_batch(batch_size)
    if method == "trainer":
        block = harness.gluon_network(network)
        _, name, args = UPDATE_OPTIMIZERS[optimizer]
        trainer = harness.gluon_trainer(block, ctx_list, name, {"learning_rate": 0.01, **args})
        harness.gluon_step(block, trainer, X, y, ctx_list)()   # gradients in place
        return harness.trainer_update(block, trainer, batch_size)
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
    X, y = harness.random_batch(batch_size)
    return lambda: parallel.train_step(X, y, device_params, ctx_list, net=net, optimizer=opt)


def _memory_records(args, ctx_all, batch):
    return [{"part": "memory", "network": network, "optimizer": optimizer, "k": k, "zero": zero,
             **memory(network, optimizer, zero, ctx_all[:k], batch[network])}
            for network in args.networks for optimizer in ("momentum", "adam") for k in args.ks for zero in (0, 1, 2)]


def _timed_records(args, part, steps):
    """The records of a timed part: each of ``steps`` (key -> function) timed in every repeat, interleaved."""
    fields = ("network", "method", "optimizer", "k") if part == "update" else ("network", "optimizer", "zero", "k")
    samples = harness.time_interleaved(steps, args.repeats, warmup=2,
                                       calls=lambda key: args.lenet_steps if key[0] == "lenet" else args.steps)
    return [{"part": part, **dict(zip(fields, key)), "median_ms": harness.median(ms), "ms": ms}
            for key, ms in samples.items()]


def run(args):
    import parallel
    ctx_all = parallel.parse_devices(f"cpu:{max(args.ks)}")
    batch = {"lenet": harness.LENET_BATCH, "resnet18": args.resnet_batch}
    records = _memory_records(args, ctx_all, batch) if "memory" in args.parts else []
    if "update" in args.parts:
        steps = {(network, method, optimizer, k): build_update(network, method, optimizer, ctx_all[:k], batch[network])
                 for network in args.networks for optimizer in UPDATE_OPTIMIZERS for k in args.ks
                 for method in UPDATE_METHODS}
        records += harness.add_ratios(_timed_records(args, "update", steps),
                                      group=lambda r: (r["network"], r["optimizer"], r["k"]),
                                      reference=lambda r: r["method"] == "trainer")
    if "step" in args.parts:
        steps = {(network, optimizer, zero, k): build_step(network, optimizer, zero, ctx_all[:k], batch[network])
                 for network in args.networks for optimizer in ("momentum", "adam") for k in args.ks
                 for zero in (0, 1, 2)}
        records += harness.add_ratios(_timed_records(args, "step", steps),
                                      group=lambda r: (r["network"], r["optimizer"], r["k"]),
                                      reference=lambda r: r["zero"] == 0)
    return records


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


def parse_args(argv=None):
    """The benchmark's arguments (``--quick`` applied)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    harness.add_network_flags(parser, calls="calls")
    parser.add_argument("--parts", action=harness.CommaList, names=PARTS, default=list(PARTS),
                        help="comma-separated: memory, update, step")
    parser.add_argument("--quick", action="store_true", help="smoke test: LeNet, K=1,2, 2 repeats of 1 call")
    harness.add_out(parser, "optimizers.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.ks, args.networks, args.repeats, args.steps, args.lenet_steps = [1, 2], ["lenet"], 2, 1, 1
    return args


def main(argv=None):
    args = parse_args(argv)
    path = harness.results_path(args.out, "optimizers.json")
    start = time.perf_counter()
    records = run(args)
    settings = {**harness.run_settings(), **harness.network_settings(args), "parts": args.parts,
                "seconds": time.perf_counter() - start,
                "order": "every timed configuration once per repeat, in a fresh shuffled order (seed 0)"}
    result = {"settings": settings, "records": records}
    print_tables(result)
    print(f"wrote {harness.write_json(path, result)}")
    return 0


if __name__ == "__main__":
    sys.exit(harness.command(main))
