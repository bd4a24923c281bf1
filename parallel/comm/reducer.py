"""The Reducer: how a step's gradients are summed, in buckets that travel while the backward pass still runs.

A ``Reducer`` owns the whole of it, as PyTorch DDP's does: the allreduce ``algorithm`` between the contexts of a
process, the ``bucket_mb`` its replicas' gradients are laid out in (``replicate``), the distributed ``job`` whose
workers sum them too, and one *communication hook* that reduces a bucket: by default the hierarchical allreduce
(``allreduce_hook``: the contexts with ``algorithm``, then the workers through the kvstore), with ``compression``
a codec's hook (``CompressionHook``), or the user's own (``register_comm_hook``).

Overlap. A bucket is its own gradient buffer (``parallel.comm.replica``), the last layers in the first bucket.
``Reducer.reduce`` is called right after ``backward()`` returns, long before the gradients exist (MXNet's engine
runs asynchronously): it queues every bucket's reduction, and the engine starts each one as soon as the backward
pass has written that bucket, while it goes on computing the earlier layers; across processes each bucket's push
and pull go out with a priority that favours the first layers' buckets, which the next forward needs first.
Bucketing changes when bytes move, never what is summed: every bucket size trains the same model, bit for bit
where the sums are taken in the same order (``tests/test_reducer.py``).

Gradients that are not a flat replica's (replicas that are plain lists of arrays, a gluon ``Trainer``'s through
``parallel.AllreduceKVStore``) go through the same buckets and hook: ``Reducer.reduce_arrays`` lays them out in
buckets, packs a bucket of several tensors into flat buffers it keeps, and unpacks the sums.

>>> import mxnet as mx
>>> from parallel import init_lenet_params
>>> reducer = Reducer("ring", bucket_mb=0.1)
>>> device_params = reducer.replicate(init_lenet_params(seed=0), [mx.cpu(0), mx.cpu(1)])
>>> [(b.first, b.stop) for b in device_params[0].buckets]   # LeNet's arrays, in buckets of at most 0.1 MiB
[(5, 8), (4, 5), (0, 4)]
"""
import mxnet as mx
import numpy as np

from ..compress import COMPRESSIONS
from ..compress.registry import as_codec
from ..engine import fence
from ..job import Job, allreduce_across, bucket_key
from ..trace import issued
from ..validate import check_choice, check_int
from . import ALGORITHMS, DEFAULT_ALGORITHM, DEFAULT_BUCKET_MB, SHARDED_ALGORITHMS
from .algorithms import allreduce, check_same_arrays, exclusive, receive, reduce_scatter, scratch, shard_range
from .replica import Bucket, FlatReplica, bucket_bytes, bucket_ranges, get_params, grads_of

__all__ = ["Reducer", "GradBucket", "BucketComm", "allreduce_hook", "CompressionHook", "as_reducer",
           "allreduce_grads", "compressed_allreduce", "CROSS_HOLD"]

#: With a cross barrier in a job, the buckets that leave as soon as backward writes them (the first in backward's
#: order: the last layers'); the others wait for the end of backward, then leave first layers first, so that the
#: sums the next forward needs first land first. 2 kept a 100 Mbit/s link busy through a ResNet-18 backward pass in
#: the prototype's runs (benchmarks/README.md, "The cross barrier").
CROSS_HOLD = 2


class GradBucket:
    """What a communication hook reduces: one bucket of every replica of a group.

    Attributes
    ----------
    index : int
        The bucket's place in the reduction order (0: the last layers, whose gradients come first).
    num_buckets : int
    grads : list of NDArray
        The bucket's flat gradient buffer on each context (replica order); the hook leaves the sum in each.
    shapes : list of tuple
        The shapes of the parameters laid out one after another in the buffer.
    first : int
        The index (in the replica) of the bucket's first parameter.
    regions : list of (int, int) or None
        None: an allreduce, every context must end with the whole sum. Else a *reduce-scatter* (ZeRO-2's and
        ZeRO-3's): context ``i`` needs the sum only in its elements ``regions[i]`` (``shard_range(size, K, i)``,
        where ``parallel.comm.reduce_scatter`` leaves it); its other elements may hold anything. A hook that
        allreduces satisfies it too.
    """

    #: Whether the reducer checked ``grads`` (one shape and dtype, distinct contexts) when it laid the bucket out:
    #: then the transport sums this very list without checking it again at every step.
    checked = False

    def __init__(self, index, num_buckets, grads, shapes, first=0, regions=None):
        self.index, self.num_buckets, self.grads, self.shapes, self.first = index, num_buckets, grads, shapes, first
        self.regions = regions

    @property
    def priority(self):
        """Its priority across workers: the first layers' bucket (reduced last, needed first by the next forward)
        the highest, 0, the others below it in reduction order."""
        return self.index - self.num_buckets + 1

    def __repr__(self):
        kind = "" if self.regions is None else ", reduce-scatter"
        return (f"GradBucket({self.index} of {self.num_buckets}: {len(self.shapes)} tensor(s), "
                f"{self.grads[0].size} elements, {len(self.grads)} context(s){kind})")

    def tensors(self, k):
        """The bucket's parameters' gradients on context ``k``, as views of their shapes."""
        views, offset = [], 0
        for shape in self.shapes:
            size = int(_size(shape))
            views.append(self.grads[k][offset:offset + size].reshape(shape))
            offset += size
        return views


def _size(shape):
    n = 1
    for d in shape:
        n *= d
    return n


class BucketComm:
    """The transport a communication hook uses for one bucket: between this process's contexts, and between the
    workers of the job (under the bucket's own kvstore keys, with its priority).

    Attributes
    ----------
    algorithm : str
        The allreduce between contexts.
    num_workers, rank : int
        The job's (1 and 0 in one process).

    ``checked``: the bucket's list of buffers when the reducer checked it as it laid the bucket out
    (``GradBucket.checked``); ``allreduce_contexts`` sums that very list without checking it again.
    """

    def __init__(self, algorithm, job=None, bucket=0, priority=0, checked=None):
        self.algorithm, self.job, self.bucket, self.priority = algorithm, job, bucket, priority
        self.num_workers = 1 if job is None else job.num_workers
        self.rank = 0 if job is None else job.rank
        self._checked = checked   # the bucket's own list of buffers, checked when the reducer laid it out

    def allreduce(self, arrays):
        """Sum ``arrays`` (one a context, one shape and dtype) over the contexts and, in a job, over the workers,
        in place: the hierarchical allreduce (``allreduce_contexts``, then ``allreduce_across``)."""
        self.allreduce_contexts(arrays)
        if self.job is not None:
            self.allreduce_across(arrays)
        return arrays

    def allreduce_contexts(self, arrays):
        """Sum ``arrays`` over this process's contexts, in place, with the reducer's algorithm."""
        return allreduce(arrays, self.algorithm, check=arrays is not self._checked)

    def reduce_scatter_contexts(self, arrays):
        """The first half of the reducer's algorithm (``parallel.comm.reduce_scatter``): ``arrays[i]`` ends with the
        sum over the contexts in its elements ``shard_range(size, K, i)``."""
        return reduce_scatter(arrays, self.algorithm)

    def allreduce_across(self, arrays, part=0):
        """Sum ``arrays[0]`` over the workers (this bucket's key ``part``) and copy it to the other arrays."""
        return allreduce_across(self.job, arrays, bucket_key(self.bucket, part), self.priority)

    def allsum(self, array, part=0):
        """Sum ``array`` over the workers, in place (this bucket's kvstore key ``part``, 1 .. 3 for a hook's own
        rounds); a collective call: every worker makes the same calls in the same order."""
        return self.job.allsum(bucket_key(self.bucket, part), array, self.priority)

    def allgather(self, array, part=0):
        """Every worker's 1-D ``array``, in rank order (``Job.allgather`` under this bucket's key ``part``)."""
        return self.job.allgather(bucket_key(self.bucket, part), array, self.priority)

    def receive(self, array, ctx, slot=0):
        """``array`` copied to ``ctx`` into a persistent receive buffer (``parallel.comm.algorithms.receive``)."""
        return receive(array, ctx, slot)

    def scratch(self, ctx, shape, dtype, slot):
        """A persistent buffer on ``ctx`` (``parallel.comm.algorithms.scratch``)."""
        return scratch(ctx, shape, dtype, slot)


def allreduce_hook(bucket, comm):
    """The default communication hook: the bucket's sum over the contexts (``comm.algorithm``; ``naive``: one
    reduction a tensor, as in the textbook) and, in a job, over the workers. A reduce-scatter (``bucket.regions``)
    with an algorithm that splits into halves (``SHARDED_ALGORITHMS``) runs its first half, then sums each context's
    region over the workers under a key of its own; with another algorithm, the allreduce (which leaves every
    region its sum)."""
    if bucket.regions is not None and comm.algorithm in SHARDED_ALGORITHMS:
        comm.reduce_scatter_contexts(bucket.grads)
        for i, (start, stop) in enumerate(bucket.regions if comm.job is not None else ()):
            if stop > start:
                comm.allsum(bucket.grads[i][start:stop], 4 + i)
        return
    if comm.algorithm == "naive":
        for views in zip(*[bucket.tensors(k) for k in range(len(bucket.grads))]):
            comm.allreduce_contexts(list(views))
        if comm.job is not None:
            comm.allreduce_across(bucket.grads)
        return
    comm.allreduce(bucket.grads)


class CompressionHook:
    """A codec (``parallel.compress``) as a communication hook: its payloads instead of the buffers between the
    contexts (``Codec.reduce``) and between the workers (``Codec.across``), with error feedback.

    Attributes
    ----------
    codec : parallel.compress.Codec
    """

    def __init__(self, codec):
        self.codec = codec

    def __repr__(self):
        return f"CompressionHook({self.codec.spec!r})"

    def __call__(self, bucket, comm):
        grads = bucket.grads
        if len(grads) > 1:
            self.codec.reduce(grads, comm, bucket.shapes)
        if comm.num_workers > 1:
            self.codec.across(grads[0], comm, bucket.shapes)
            for grad in grads[1:]:
                grads[0].copyto(grad)


class Reducer:
    """How gradients are summed: the algorithm, the buckets, the communication hook, the job across processes.

    Parameters
    ----------
    algorithm : str
        The allreduce between this process's contexts, one of ``parallel.comm.ALGORITHMS``.
    bucket_mb : float or None
        The most MiB of gradients a bucket holds (``DEFAULT_BUCKET_MB``, 25, as PyTorch DDP); None: one bucket.
        It lays out the replicas ``replicate`` makes; a reducer sums flat replicas in the buckets they have, and
        gradients kept an array a tensor (replicas that are plain lists, gluon's) in buckets of this size
        (``reduce_arrays``).
    compression : str or parallel.compress.Codec, optional
        A codec spec (``"fp16"``, ``"2bit"``, ``"topk:0.01"``, ``"powersgd:4"``) or codec: its
        ``CompressionHook`` reduces every bucket. Keep the reducer for the run: its residuals carry over.
    job : parallel.job.Job, optional
        The distributed job whose workers sum the gradients too (``parallel.job.join()``).
    bucket_note : str
        Why ``bucket_mb`` is what it is, in words, said after it by ``describe`` (``python -m parallel.train``'s
        choice for a job across hosts, ``parallel.comm.bucket_mb_for``); "" says nothing.
    warmup : int
        Optimizer steps whose gradients are summed uncompressed (``allreduce_hook``) before the hook (a codec's, or
        your own) takes over, as DDP's PowerSGD hook waits for ``start_powerSGD_iter``: a codec that drops most of
        the gradient learns far less in the first steps, when the gradients change fastest. 0: from the first.
    cross_barrier : bool
        Let each layer's next forward wait only for its own bucket's update (BytePS's *cross barrier*): strategies
        built with this reducer split their flat replicas' parameters into one buffer a bucket
        (``FlatReplica.split_parameters``), the update writes them bucket by bucket, first layers first, and, in a
        job, the buckets travel in the order the next forward needs them (``CROSS_HOLD``). Worth it where the link
        is slow (the sums take longer than the compute); it costs a copy of the parameters a step and their memory
        twice. The same sums and updates: the same model. False by default.

    Attributes
    ----------
    algorithm, bucket_mb, job, bucket_note, warmup, cross_barrier
    steps : int
        The optimizer steps this reducer's sums have fed so far: the package's update counts them
        (``parallel.optim.update_groups``; ``fit`` sets it where a resumed run starts). Below ``warmup``, buckets
        are summed uncompressed.
    hook : callable
        ``hook(bucket, comm)``: reduces a ``GradBucket`` in place through ``comm`` (a ``BucketComm``).
    codec : parallel.compress.Codec or None
        The compression hook's codec, when the hook is one.
    """

    def __init__(self, algorithm=DEFAULT_ALGORITHM, bucket_mb=DEFAULT_BUCKET_MB, compression=None, job=None,
                 bucket_note="", warmup=0, cross_barrier=False):
        self.algorithm = check_choice(algorithm, "algorithm", ALGORITHMS)
        if not isinstance(cross_barrier, bool):
            raise TypeError(f"cross_barrier must be a bool, got {type(cross_barrier).__name__}")
        self.cross_barrier = cross_barrier
        self.warmup, self.steps = check_int(warmup, "warmup", low=0), 0
        if not isinstance(bucket_note, str):
            raise TypeError(f"bucket_note must be a str, got {type(bucket_note).__name__}")
        self.bucket_note = bucket_note
        bucket_bytes(bucket_mb)   # checks it
        if job is not None and not isinstance(job, Job):
            raise TypeError(f"job must be a parallel.job.Job (parallel.job.join() gives it) or None, got "
                            f"{type(job).__name__}")
        self.bucket_mb, self.job = bucket_mb, job
        self._buckets = {}   # the GradBuckets of each group reduced: (its replicas, its buckets)
        self._kept = {}      # each layout reduce_arrays sums (names, contexts, shapes) -> {(first, stop): buffers}
        codec = as_codec(compression)
        self.hook = allreduce_hook if codec is None else CompressionHook(codec)

    def __repr__(self):
        hook = getattr(self.hook, "__name__", self.hook)
        return f"Reducer({self.algorithm!r}, bucket_mb={self.bucket_mb!r}, hook={hook})"

    @property
    def codec(self):
        return self.hook.codec if isinstance(self.hook, CompressionHook) else None

    def register_comm_hook(self, hook):
        """Reduce every bucket with ``hook(bucket, comm)`` from now on (PyTorch DDP's ``register_comm_hook``): given
        a ``GradBucket`` and its ``BucketComm``, it must leave in each of ``bucket.grads`` the same reduction,
        over the contexts and, in a job, the workers (every worker calling the same collectives in the same
        order); for a reduce-scatter (``bucket.regions``, ZeRO-2 and 3), the sum at least in each context's region.
        Returns the reducer."""
        if not callable(hook):
            raise TypeError(f"hook must be callable as hook(bucket, comm), got {hook!r}")
        self.hook = hook
        return self

    def replicate(self, params, ctx_list):
        """One replica of ``params`` per context (``get_params``), its gradients in this reducer's buckets; with a
        cross barrier, its parameters split into one buffer a bucket (``FlatReplica.split_parameters``)."""
        replicas = [get_params(params, ctx, self.bucket_mb) for ctx in ctx_list]
        for replica in replicas if self.cross_barrier else ():
            if isinstance(replica, FlatReplica):
                replica.split_parameters()
        return replicas

    def describe(self, num_contexts=2):
        """How a group of ``num_contexts`` replicas is summed, in words ("" when there is nothing to sum)."""
        if num_contexts < 2 and self.job is None:
            return ""
        codec = self.codec
        if codec is not None:
            line = f"gradients summed as {codec.spec} payloads with error feedback"
        elif self.hook is not allreduce_hook:
            line = f"gradients summed by the hook {getattr(self.hook, '__name__', type(self.hook).__name__)}"
        else:
            line = f"gradients summed with the {self.algorithm} allreduce"
        if self.warmup and self.hook is not allreduce_hook:
            line += f" after {self.warmup} uncompressed step(s)"
        if self.bucket_mb is not None:
            line += f" in buckets of {self.bucket_mb:g} MiB"
            if self.bucket_note:
                line += f" ({self.bucket_note})"
        if self.cross_barrier:
            line += "; a cross barrier: each bucket's parameters updated as its sum lands, first layers first"
        return line

    def buckets(self, group, scatter=False):
        """The ``GradBucket`` of each bucket of ``group`` (flat replicas), in reduction order; ``scatter``: each
        with its contexts' regions of a reduce-scatter (``shard_range``). Made once for a group and kept (a step
        reduces the same replicas every time)."""
        key = (tuple(id(replica) for replica in group), scatter)
        kept = self._buckets.get(key)
        if kept is not None and all(a is b for a, b in zip(kept[0], group)):
            return kept[1]
        first, k = group[0], len(group)
        buckets = [GradBucket(b, len(first.buckets), [replica.grads[b] for replica in group],
                              [param.shape for param in first[layout.first:layout.stop]], layout.first,
                              [shard_range(layout.end - layout.start, k, i) for i in range(k)] if scatter else None)
                   for b, layout in enumerate(first.buckets)]
        for bucket in buckets:   # once: each step then sums these very lists unchecked (BucketComm)
            check_same_arrays(bucket.grads, "the group's gradient buffers")
            bucket.checked = True
        if len(self._buckets) >= 1024:   # groups of another layout: forget the oldest
            self._buckets.pop(next(iter(self._buckets)))
        self._buckets[key] = (list(group), buckets)
        return buckets

    def _comm(self, bucket, first_bucket=0):
        return BucketComm(self.algorithm, self.job, first_bucket + bucket.index, priority=bucket.priority,
                          checked=bucket.grads if bucket.checked else None)

    def reduce(self, group, active=None, first_bucket=0):
        """Sum the gradients of ``group`` (the replicas of the same parameters, one a context) in place, bucket by
        bucket, through the hook: afterwards every replica holds the sum over its contexts and the job's workers.
        ``first_bucket``: in a job, where this group's buckets start among the kvstore's keys (a step of several
        groups gives each its own keys: ``optimizer_step``).

        ``active``: replicas ``active..`` computed nothing this step (a batch smaller than the group): their
        gradients are zeroed first, so they add nothing and no stale gradient leaks in. Queued, not waited for,
        except the kvstore's first use of a key (a barrier of the workers).
        """
        self._issue(group, active, first_bucket, scatter=False)

    def reduce_scatter(self, group, active=None, first_bucket=0):
        """ZeRO's reduction (stages 2 and 3): each bucket's gradients summed over the contexts and the workers, each
        replica ``i`` needing the sum only in its elements ``shard_range(size, K, i)`` of the bucket (a
        ``GradBucket`` with ``regions``): the hook's reduce-scatter, which the default makes with the algorithm's
        first half and the fused allreduce's additions (bitwise an allreduce's sums); a hook that allreduces (a
        codec's) works too. Other elements hold partial sums. ``active`` and ``first_bucket`` as in ``reduce``."""
        self._issue(group, active, first_bucket, scatter=True)

    def _issue(self, group, active, first_bucket, scatter):
        for replica in group[len(group) if active is None else active:]:
            for grad in grads_of(replica):
                grad[:] = 0
        if len(group) == 1 and self.job is None:
            return
        if not all(isinstance(replica, FlatReplica) for replica in group):
            self.reduce_arrays(*_tensor_grads(group), first_bucket=first_bucket)
            return
        buckets = self.buckets(group, scatter)
        kind = "reduce-scatter" if scatter else "allreduce"
        with exclusive():
            if self.cross_barrier and self.job is not None and len(buckets) > CROSS_HOLD + 1:
                free, held = buckets[:CROSS_HOLD], buckets[CROSS_HOLD:]
                for bucket in free:
                    self._run_hook(bucket, kind, first_bucket)
                # the rest leave once backward has written the first layers' gradients (its last), first layers first
                fence(held[-1].grads, [grad for bucket in held[:-1] for grad in bucket.grads])
                buckets = held[::-1]
            for bucket in buckets:
                self._run_hook(bucket, kind, first_bucket)

    def _run_hook(self, bucket, kind, first_bucket):
        """``hook(bucket, comm)``, bracketed for a trace as the work of bucket ``first_bucket + bucket.index``."""
        number, grad = first_bucket + bucket.index, bucket.grads[0]
        hook = self.hook if self.steps >= self.warmup else allreduce_hook   # warm-up: the plain sums
        with issued(kind, lambda: bucket.grads, lambda: f"{kind} bucket {number}", bucket=number,
                    priority=bucket.priority, dense=hook is not self.hook,
                    bytes=lambda: grad.size * np.dtype(grad.dtype).itemsize):
            hook(bucket, self._comm(bucket, first_bucket))

    def reduce_arrays(self, grads, names=None, first_bucket=0):
        """Sum gradients kept an array a tensor (not in a flat replica's buckets) in place, in this reducer's
        buckets, through its hook: a gluon ``Trainer``'s (``parallel.AllreduceKVStore``), and replicas that are
        plain lists of arrays (``reduce`` hands them here: a gluon Block in ``DataParallel``, the textbook's
        copies), so a codec or a hook of your own reaches them too.

        The tensors are laid out in buckets of at most ``bucket_mb`` MiB (``bucket_ranges``), the last tensors
        first. A bucket holds consecutive tensors of one dtype: where the dtype changes, a bucket ends (mixed
        dtypes give each run of one dtype its own buckets). A bucket of several tensors is packed into one flat
        buffer a context, kept from step to step (a codec's residuals stay with it), reduced by
        ``hook(bucket, comm)`` and unpacked; a bucket of one tensor is reduced in place, through flat views of its
        arrays, kept while the same arrays come back (gluon's ``list_grad()``); new arrays for it (``NDArray.grad``
        makes a new object at each call) get new views, and the reducer's codec's state follows them (``Codec.move``;
        a hook of your own that keeps state per bucket keys it by ``bucket.index``, not by its buffers).

        Parameters
        ----------
        grads : list of list of NDArray
            For each tensor, its gradient on each context (the same contexts, in the same order, for every
            tensor); each ends with the sum over the contexts.
        names : sequence of hashable, optional
            One a tensor, the same for the same tensor at every step (gluon's keys): the kept buffers belong to
            the names and the contexts. Default: the tensors' places in ``grads``.
        first_bucket : int
            The number of the first bucket, for the trace and for the hook's ``comm.bucket``.

        Raises ``TypeError`` in a job (its workers sum flat replicas). One context: nothing to do. The work is
        queued; nothing waits for the devices.
        """
        if self.job is not None:
            raise TypeError("a distributed step needs flat replicas: build device_params with get_params, whose "
                            "parameters share one dtype")
        if not grads or len(grads[0]) < 2:
            return
        kept = self._kept_for(grads, names)
        buckets = self._array_buckets(grads, kept)
        with exclusive():
            for bucket in buckets:
                members = grads[bucket.first:bucket.first + len(bucket.shapes)]
                if len(members) > 1:   # packed into the kept buffers, unpacked after the sum
                    for i, flat in enumerate(bucket.grads):
                        mx.nd.concat(*[grad[i].reshape((-1,)) for grad in members], dim=0, out=flat)
                self._run_hook(bucket, "allreduce", first_bucket)
                if len(members) > 1:
                    _unpack(bucket.grads, members)

    def _kept_for(self, grads, names):
        """The kept buffers of this layout (the tensors' names, shapes and dtypes, the contexts): made empty at
        its first step."""
        names = tuple(range(len(grads))) if names is None else tuple(names)
        if len(names) != len(grads):
            raise ValueError(f"names has {len(names)} entries but grads {len(grads)} tensors; give one a tensor")
        key = (names, tuple(array.context for array in grads[0]),
               tuple((grad[0].shape, grad[0].dtype) for grad in grads))
        kept = self._kept.get(key)
        if kept is None:
            if len(self._kept) >= 64:   # layouts of another model: forget the oldest, and its buffers
                self._kept.pop(next(iter(self._kept)))
            kept = self._kept[key] = {}
        return kept

    def _array_buckets(self, grads, kept):
        """The ``GradBucket`` of each bucket of ``grads`` (``reduce_arrays``' layout), in reduction order, its
        ``grads`` the kept buffers (a bucket of several tensors, not packed here) or flat views (of one)."""
        ranges = _dtype_ranges(grads, bucket_bytes(self.bucket_mb))
        buckets = []
        for b, (first, stop) in enumerate(ranges):
            found = kept.get((first, stop))
            if stop - first > 1 and found is None:
                size = sum(grad[0].size for grad in grads[first:stop])
                found = kept[(first, stop)] = [mx.nd.empty((size,), ctx=array.context, dtype=array.dtype)
                                               for array in grads[first]]
            elif stop - first == 1 and (found is None or any(x is not y for x, y in zip(found[0], grads[first]))):
                views = [array.reshape((-1,)) for array in grads[first]]
                for old, new in zip(found[1] if found is not None and self.codec is not None else (), views):
                    self.codec.move(old, new)   # the same tensor in new arrays: its error feedback follows
                found = kept[(first, stop)] = (list(grads[first]), views)
            flats = found if stop - first > 1 else found[1]
            buckets.append(GradBucket(b, len(ranges), flats, [grad[0].shape for grad in grads[first:stop]], first))
        return buckets

    def _layouts(self, group):
        """``(GradBucket, Bucket)`` of each bucket of ``group``, in reduction order: a flat replica's own, or those
        ``reduce_arrays`` keeps for a group of plain lists (made at its first step), with their tensors' elements
        in the flat layout of the whole replica (``Bucket.start``, ``Bucket.end``)."""
        if all(isinstance(replica, FlatReplica) for replica in group):
            return list(zip(self.buckets(group), group[0].buckets))
        grads, names = _tensor_grads(group)
        offsets = np.cumsum([0] + [grad[0].size for grad in grads])
        return [(bucket, Bucket(bucket.first, bucket.first + len(bucket.shapes), int(offsets[bucket.first]),
                                int(offsets[bucket.first + len(bucket.shapes)])))
                for bucket in self._array_buckets(grads, self._kept_for(grads, names))]

    def state(self, group):
        """The communication hook's error feedback for ``group`` (a codec's residuals and ``Q`` matrices), whatever
        the buckets: ``{"residual/c<k>": context k's residual over the whole flat buffer, "residual/across": ...,
        "query/c<k>/<t>": ...}`` with ``t`` the parameter's index (``parallel.compress.Codec.state``'s names); ``{}``
        without a codec. A group of plain lists is laid out as its flat replica would be (its tensors one after
        another; in float32 when their dtypes differ). Waits for the devices."""
        codec = self.codec
        if codec is None:
            return {}
        state, pieces = {}, {}
        layouts = self._layouts(group)
        for bucket, _ in layouts:
            across = bucket.grads[0] if self.job is not None else None
            for name, value in codec.state(bucket.grads, across).items():
                kind, where = name.split("/", 1)
                if kind == "query":
                    where, t = where.rsplit("/", 1)
                    state[f"query/{where}/{bucket.first + int(t)}"] = value
                else:
                    pieces.setdefault(name, {})[bucket.index] = value
        dtypes = {bucket.grads[0].dtype for bucket, _ in layouts}
        dtype = dtypes.pop() if len(dtypes) == 1 else np.float32
        for name, found in pieces.items():   # the buckets' residuals, laid out as the flat buffer
            parts = [found[bucket.index].astype(dtype, copy=False) if bucket.index in found else
                     mx.nd.zeros((layout.end - layout.start,), dtype=dtype)
                     for bucket, layout in sorted(layouts, key=lambda item: item[1].start)]
            state[name] = mx.nd.concat(*parts, dim=0) if len(parts) > 1 else parts[0]
        return state

    def load_state(self, state, group):
        """Continue from ``state`` (``state``'s form, numpy arrays or NDArrays) on ``group``: each bucket gets its
        part of every residual and the ``Q`` of its parameters. ``ValueError`` naming ``compression_state`` for an
        entry this layout does not have."""
        codec = self.codec
        if codec is None:
            if state:
                raise ValueError("compression_state: the checkpoint holds compression residuals but this run "
                                 "compresses nothing; resume it with the same compression")
            return
        codec.reset()
        layouts = self._layouts(group)
        size = max((layout.end for _, layout in layouts), default=0)
        for bucket, layout in layouts:
            local = {}
            for name, value in state.items():
                kind, where = name.split("/", 1) if "/" in name else (name, "")
                if kind == "query":
                    where, t = where.rsplit("/", 1)
                    if t.isdigit() and layout.first <= int(t) < layout.stop:
                        local[f"query/{where}/{int(t) - layout.first}"] = value
                elif kind == "residual":
                    if value.shape[0] != size:
                        raise ValueError(f"compression_state: {name} has {value.shape[0]} elements, the model "
                                         f"{size}; it belongs to another model")
                    local[name] = value[layout.start:layout.end]
                else:
                    local[name] = value
            codec.load_state(local, bucket.grads, bucket.grads[0] if self.job is not None else None)


def _tensor_grads(group):
    """A group of plain lists (replicas) as ``reduce_arrays`` takes it: each tensor's gradients, one a replica, and
    the tensors' names (the identity of the first replica's arrays, which stay while their gradients are new
    NDArray objects at every read)."""
    grads = list(zip(*[grads_of(replica) for replica in group]))
    return [list(arrays) for arrays in grads], [id(array) for array in group[0]]


def _dtype_ranges(grads, limit):
    """``bucket_ranges`` of each run of consecutive tensors of one dtype, the last run first: ``(first, stop)``
    ranges of ``grads`` in reduction order."""
    ranges, stop = [], len(grads)
    while stop > 0:
        start, dtype = stop - 1, grads[stop - 1][0].dtype
        while start > 0 and grads[start - 1][0].dtype == dtype:
            start -= 1
        sizes = [grad[0].size for grad in grads[start:stop]]
        ranges += [(start + a, start + b) for a, b in bucket_ranges(sizes, np.dtype(dtype).itemsize, limit)]
        stop = start
    return ranges


def _unpack(flats, members):
    """Each context's flat sum back into its tensors' arrays (``members``: for each tensor, its arrays)."""
    for i, flat in enumerate(flats):
        offset = 0
        for grad in members:
            mx.nd.slice_axis(flat, axis=0, begin=offset, end=offset + grad[i].size, out=grad[i].reshape((-1,)))
            offset += grad[i].size


def as_reducer(reducer, name="reducer"):
    """``reducer`` as a ``Reducer``: an algorithm's name gives ``Reducer(reducer)``, None the default, a
    ``Reducer`` itself; ``TypeError`` naming ``name`` for anything else."""
    if reducer is None:
        return Reducer()
    if isinstance(reducer, str):
        if reducer.partition(":")[0] in COMPRESSIONS[1:]:
            raise TypeError(f"{name}={reducer!r} is a compression spec, but a step needs a Reducer, whose residuals "
                            f"carry over between steps: pass parallel.Reducer(compression={reducer!r}) and reuse it at "
                            "every step")
        return Reducer(reducer)
    if not isinstance(reducer, Reducer):
        raise TypeError(f"{name} must be a parallel.Reducer or an allreduce algorithm's name such as 'ring', got "
                        f"{reducer!r}")
    return reducer


def allreduce_grads(device_params, reducer=DEFAULT_ALGORITHM, active=None):
    """Sum the replicas' gradients, in place: afterwards every replica's ``param.grad`` holds the sum.

    Parameters
    ----------
    device_params : list of list of NDArray
        One replica per context (from ``get_params``).
    reducer : str or Reducer
        An allreduce algorithm's name (see ``parallel.comm.allreduce``): the gradients are reduced in one call a
        bucket (a flat replica's, or ``Reducer.reduce_arrays``' for plain lists), unless ``"naive"``: one call per
        tensor, as in the textbook. Or a ``Reducer`` (its algorithm, buckets, hook and job).
    active : int, optional
        Replicas ``active..`` computed nothing this step (a batch smaller than the number of replicas):
        their gradients are zeroed first, so they contribute nothing and stale gradients never leak in.
    """
    as_reducer(reducer).reduce(device_params, active)


def compressed_allreduce(arrays, codec, algorithm="fused", shapes=None):
    """Sum the flat ``arrays`` (one per context) in place, moving a codec's payloads between the contexts: one
    bucket through the codec's ``CompressionHook``.

    Parameters
    ----------
    arrays : list of NDArray
        One flat (1-D) gradient buffer per context, of one size and dtype (float32). Modified in place: each
        then holds the same decoded sum.
    codec : parallel.compress.Codec or str or None
        ``None``/``"none"``: ``allreduce(arrays, algorithm)``, bitwise. Otherwise its residuals (one per array)
        are read and updated: pass the same object at every step.
    algorithm : str
        The allreduce ``PowerSGD`` sums its small factors with (the others gather and broadcast payloads).
    shapes : list of tuple, optional
        The shapes of the tensors laid out one after another in each buffer (``PowerSGD`` compresses the
        matrices among them); default: one vector.

    Returns
    -------
    list of NDArray
        ``arrays``. The work is queued; nothing waits for the devices.
    """
    check_same_arrays(arrays)
    check_choice(algorithm, "algorithm", ALGORITHMS)
    codec = as_codec(codec)
    if codec is None:
        return allreduce(arrays, algorithm)
    if len(arrays[0].shape) != 1:
        raise ValueError(f"compressed_allreduce takes flat (1-D) buffers, got shape {arrays[0].shape}")
    shapes = [arrays[0].shape] if shapes is None else [tuple(s) for s in shapes]
    if sum(_size(s) for s in shapes) != arrays[0].size:
        raise ValueError(f"shapes hold {sum(_size(s) for s in shapes)} elements, the buffers {arrays[0].size}")
    if len(arrays) > 1:
        with exclusive():
            CompressionHook(codec)(GradBucket(0, 1, arrays, shapes), BucketComm(algorithm))
    return arrays
