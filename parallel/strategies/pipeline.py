"""Pipeline parallelism: micro-batches flow through the chunks of a model cut into stages, in a schedule's order.

The batch of each data-parallel replica splits into M micro-batches (sizes differ by at most one, as
``shard_sizes`` splits; a replica with fewer examples runs the rest empty). ``issue`` runs each micro-batch's
forward and backward through each chunk in the order of its schedule (``parallel.strategies.schedules``:
``"gpipe"``, every forward then every backward; ``"1f1b"``, each backward as soon as it can, so a stage holds at
most as many micro-batches as there are stages after it, itself included; with ``virtual`` chunks a device,
interleaved 1F1B), each op over every data-parallel replica at once (a chunk's BatchNorm normalises a
micro-batch over all of them). Each chunk's forward of a micro-batch is recorded on its own input (a copy of the
chunk before's output) and its backward runs from the gradient the chunk after left there; every chunk adds its
micro-batches' gradients, whatever the schedule; then one update for the batch (``parallel.step``). MXNet's
engine runs each context's work in the order it is issued but different contexts concurrently, so stage s can
work on micro-batch m+1 while stage s+1 works on micro-batch m. With K stages, each stage idles
``(K-1)/(M+K-1)`` of the step (GPipe and 1F1B alike): the *bubble fraction*:

>>> bubble_fraction(2, 4)   # (2-1) / (4+2-1)
0.2

The overlap needs stages that compute at the same time on separate hardware; CPU contexts that share the
same cores cannot (see benchmarks/pipeline.py).

BatchNorm. A network with BatchNorm cut into micro-batches is *not* trained as on one context: each micro-batch is
normalised by its own mean and variance, and the running statistics are updated once per micro-batch, as GPipe
does. Gradients are then those of M smaller batches, not of the batch; one micro-batch (the model and hybrid
strategies' default) trains the one-context model. Without BatchNorm (LeNet, the ViT) the pipeline is exact.
"""
from mxnet import autograd

from ..models.recompute import flat_arrays
from ..split import shard_sizes
from ..trace import backward_heads, issued, mark_backward_each, mark_forward_each
from ..validate import check_int

__all__ = ["issue", "micro_batches", "bubble_fraction"]


def bubble_fraction(stages, micro_batches):
    """GPipe's idle fraction ``(K-1)/(M+K-1)`` for K ``stages`` and M ``micro_batches`` (1F1B's too).

    Returns
    -------
    float
        0 for one stage; tends to 0 as M grows.
    """
    check_int(micro_batches, "micro_batches", low=1)
    check_int(stages, "stages", low=1)
    return (stages - 1) / (micro_batches + stages - 1)


def micro_batches(shards, m):
    """Each replica's shard cut into ``m`` micro-batches: ``parts[i]``, micro-batch ``i`` of every replica that has
    an example in it (a prefix of the replicas: the first shards are the largest), possibly none. One
    micro-batch is each shard itself (no view made every step)."""
    if m == 1:
        return [list(shards)]
    parts = [[] for _ in range(m)]
    for shard in shards:
        sizes = shard_sizes(shard.shape[0], min(m, shard.shape[0]))
        start = 0
        for i, size in enumerate(sizes):
            parts[i].append(shard[start:start + size])
            start += size
    return parts


def issue(schedule, chunks, X_parts, y_parts, loss):
    """Issue a step's work in ``schedule.order`` through ``chunks`` (each a ``parallel.strategies.hybrid.Chunk``):
    chunk ``c``'s forward of micro-batch ``i`` recorded on its own input (``Chunk.receive`` of the chunk before's
    output), each backward from the gradient the chunk after left on that input, the last chunk's from the losses.
    ``X_parts[i]``, ``y_parts[i]``: micro-batch ``i`` of each replica that has one (``micro_batches``); an empty
    micro-batch still runs every chunk's hooks (ZeRO-3's collectives). Returns the outputs, labels and losses, one
    a micro-batch of a replica, and each device's most micro-batches held at once (counted on what was kept).
    Nothing waits."""
    last, devices = len(chunks) - 1, schedule.devices
    inputs, outputs, pending, losses, kept = {}, {}, {}, {}, {}
    held, peak = [0] * devices, [0] * devices
    for device, op in schedule.order:
        c, i = op.chunk, op.micro
        chunk = chunks[c]
        if op.kind == "F":
            X = X_parts[i] if c == 0 else chunk.receive(outputs[(c - 1, i)])
            mark_forward_each(lambda: flat_arrays(X))   # where a trace's forward starts (parallel.trace)
            with autograd.record(), issued("forward", lambda: flat_arrays(X)) as made:
                outputs[(c, i)], pending[(c, i)] = chunk.forward(X)
                if c == last:   # one a rank of each replica (a tensor group's every rank)
                    losses[i] = [chunk.losses(out, y, loss) for out, y in zip(outputs[(c, i)], y_parts[i])]
                made += flat_arrays(outputs[(c, i)])   # the forward's bracket ends with its outputs and losses
                made += [value for values in losses[i] for value in values] if c == last else []
            inputs[(c, i)] = X
            held[device] += 1
            peak[device] = max(peak[device], held[device])
            continue
        if c == last:
            heads = [value for values in losses[i] for value in values]
            chunk.backward(pending.pop((c, i)), heads, backward_heads(heads))   # a trace's backward starts there
            kept[i] = [chunk.logits(out).detach() for out in outputs.pop((c, i))]
            losses[i] = [values[0].detach() for values in losses[i]]
        else:
            heads = flat_arrays(outputs.pop((c, i)))
            grads = chunks[c + 1].send_back(inputs.pop((c + 1, i)), chunk)
            mark_backward_each(grads, writes=True)
            chunk.backward(pending.pop((c, i)), heads, grads)
        held[device] -= 1
    order = range(len(X_parts))
    return ([out for i in order for out in kept[i]], [y for i in order for y in y_parts[i]],
            [value for i in order for value in losses[i]], peak)
