"""Allreduce across contexts: the four algorithms (naive, fused, ring, tree), their receive buffers, and the
bytes each one moves.

``allreduce`` leaves the elementwise *sum* of all arrays in every array (not the mean): the SGD step
divides by the global batch size.

Every array an algorithm receives from another context lands in a *persistent receive buffer*, kept
between calls (see ``free_buffers``): MXNet 1.9's CPU contexts have no memory pool (each allocation is a
fresh ``malloc``, and a large one is a fresh ``mmap`` whose pages fault on first touch), so a new buffer
per receive made every step pay for its page faults as well as for its copies.
"""
import math
import threading
from collections import OrderedDict, namedtuple

import mxnet as mx

from ..validate import check_choice, check_int
from . import ALGORITHMS, SHARDED_ALGORITHMS

__all__ = ["allreduce", "reduce_scatter", "all_gather", "shard_range", "chunk_bounds", "copy_to", "copied_bytes",
           "check_same_arrays", "ALLREDUCE_ALGORITHMS", "bytes_moved", "BytesMoved", "free_buffers",
           "set_buffer_limit", "buffer_info", "BufferInfo", "DEFAULT_BUFFER_LIMIT", "receive", "scratch", "exclusive",
           "BufferCache", "BUFFERS"]


def check_same_arrays(arrays, name="arrays"):
    """Check that ``arrays`` are NDArrays of one shape and dtype on distinct contexts.

    Raises
    ------
    TypeError, ValueError
        Naming the offending index.
    """
    if not isinstance(arrays, (list, tuple)):
        raise TypeError(f"{name} must be a list of NDArrays, one per context, got {arrays!r}")
    if not arrays:
        raise ValueError(f"{name} is empty; give one NDArray per context")
    first = arrays[0]
    seen = {}
    for i, array in enumerate(arrays):
        if not isinstance(array, mx.nd.NDArray):
            raise TypeError(f"{name}[{i}] must be an NDArray, got {type(array).__name__}")
        if array.shape != first.shape:
            raise ValueError(f"{name}[{i}] has shape {array.shape} but {name}[0] has {first.shape}; "
                             "allreduce needs one shape")
        if array.dtype != first.dtype:
            raise ValueError(f"{name}[{i}] has dtype {array.dtype.__name__} but {name}[0] has "
                             f"{first.dtype.__name__}; allreduce needs one dtype")
        if array.context in seen:
            raise ValueError(f"{name}[{i}] and {name}[{seen[array.context]}] are both on {array.context}; "
                             "allreduce needs one array per context")
        seen[array.context] = i


#: The bytes ``copy_to`` has queued since the process started (``copied_bytes``).
_copied = [0]


def copy_to(src, dst):
    """Copy ``src`` to ``dst`` (a Context: returns a new array there; an NDArray: fills it, returns it).

    Every copy between contexts in the algorithms below goes through here, so a test can count the
    bytes they move, and ``copied_bytes`` counts them. Queued on the engine; does not block.
    """
    _copied[0] += src.size * src.dtype(0).itemsize
    return src.copyto(dst)


def copied_bytes():
    """The bytes every copy between contexts of the collectives here (``copy_to``: the allreduces, reduce-scatters
    and all-gathers, a codec's payloads, whoever calls them) has queued in this process so far: read it before and
    after a step for the step's (what ``bytes_moved`` predicts for one allreduce). Counted as a copy is queued,
    so reading it waits for nothing. Threads that reduce at once (workers in threads) share the count."""
    return _copied[0]


# ---- persistent receive buffers ----------------------------------------------------------------------

#: Default bound on the bytes held by the receive-buffer cache, over all contexts together (1 GiB).
DEFAULT_BUFFER_LIMIT = 1 << 30

BufferInfo = namedtuple("BufferInfo", ["entries", "nbytes", "limit", "allocations", "evictions"])
BufferInfo.__doc__ = """State of the receive-buffer cache (``buffer_info()``).

entries, nbytes : int
    Buffers cached now, and their total size in bytes (``nbytes <= limit`` always).
limit : int
    The bound on ``nbytes`` (``set_buffer_limit``).
allocations, evictions : int
    Buffers allocated, and dropped to stay within ``limit``, since the module was loaded or the last
    ``free_buffers()``. In a steady state (the same shapes reduced step after step) neither grows.
"""


class BufferCache:
    """Receive buffers by ``(context, shape, dtype, slot)``, least recently used dropped first.

    ``slot`` tells apart the buffers that one allreduce needs at the same time on one context (``_fused``
    gathers K-1 copies on the first context: slots 0 .. K-2). Reusing a buffer is safe because MXNet's
    engine orders every read and write of an array in the order they were queued: the copy of the next
    call into a buffer waits until this call's add has read it, without blocking Python. Dropping a
    buffer is safe as well: MXNet frees its memory only after the operations queued on it have run.
    """

    def __init__(self, limit):
        self.lock = threading.RLock()   # one reduction queues its copies at a time (see ``allreduce``, ``exclusive``)
        self.buffers = OrderedDict()
        self.limit = limit
        self.clear()

    def clear(self):
        self.buffers.clear()
        self.nbytes = self.allocations = self.evictions = 0

    def get(self, ctx, shape, dtype, slot):
        key = (ctx.device_typeid, ctx.device_id, shape, dtype, slot)
        buffer = self.buffers.get(key)
        if buffer is not None:
            self.buffers.move_to_end(key)
            return buffer
        buffer = mx.nd.empty(shape, ctx=ctx, dtype=dtype)   # every element is written before it is read
        self.allocations += 1
        size = buffer.size * buffer.dtype(0).itemsize
        if size > self.limit:   # too big to keep: used once, like a plain ``copyto(ctx)``
            return buffer
        self.shrink(self.limit - size)
        self.buffers[key] = buffer
        self.nbytes += size
        return buffer

    def flat(self, ctx, size, dtype, slot):
        """A 1-D buffer of ``size`` elements: a view of the one flat buffer kept for ``(ctx, dtype, slot)``, grown
        (allocated anew) when a larger one is asked for. Receives of many sizes (each block's piece of a ZeRO-3
        reduce-scatter) share it instead of keeping a buffer per size."""
        key = (ctx.device_typeid, ctx.device_id, "flat", dtype, slot)
        buffer = self.buffers.get(key)
        if buffer is not None and buffer.size >= size:
            self.buffers.move_to_end(key)
            return buffer[:size]
        if buffer is not None:
            del self.buffers[key]
            self.nbytes -= buffer.size * buffer.dtype(0).itemsize
        buffer = mx.nd.empty((size,), ctx=ctx, dtype=dtype)   # every element is written before it is read
        self.allocations += 1
        nbytes = buffer.size * buffer.dtype(0).itemsize
        if nbytes <= self.limit:
            self.shrink(self.limit - nbytes)
            self.buffers[key] = buffer
            self.nbytes += nbytes
        return buffer[:size]

    def shrink(self, limit):
        """Drop least recently used buffers until at most ``limit`` bytes are cached."""
        while self.nbytes > limit:
            _, buffer = self.buffers.popitem(last=False)
            self.nbytes -= buffer.size * buffer.dtype(0).itemsize
            self.evictions += 1


#: The process's one receive-buffer cache, which every reduction uses (``receive``, ``scratch``) and whose lock
#: ``exclusive()`` is; ``buffers`` holds its arrays by key. Public for what must see or change it whole: tests that
#: check its reuse, workers in threads of one process that each reduce on contexts of their own.
BUFFERS = BufferCache(DEFAULT_BUFFER_LIMIT)


def _receive(src, ctx, slot=0):
    """Copy ``src`` into the persistent buffer ``slot`` for its shape and dtype on ``ctx``; returns it.

    The buffer is overwritten by the next receive into the same slot (in this call or the next one):
    an algorithm gives distinct slots to the receives on one context that must coexist.
    """
    return copy_to(src, BUFFERS.get(ctx, src.shape, src.dtype, slot))


def _receive_flat(src, ctx, slot=0):
    """``_receive`` of a 1-D ``src`` into a view of the flat buffer ``slot`` of its dtype on ``ctx``
    (``BufferCache.flat``): one buffer a slot whatever the sizes received."""
    return copy_to(src, BUFFERS.flat(ctx, src.size, src.dtype, slot))


def receive(src, ctx, slot=0):
    """Copy ``src`` (on any context) into the persistent receive buffer ``slot`` of its shape and dtype on ``ctx``,
    and return that buffer: the transport a communication hook uses to move a payload between contexts
    (``parallel.comm.reducer``). The buffer is overwritten by the next receive into the same slot, so a reduction
    gives distinct slots to the receives that must coexist; call it inside ``exclusive()``. Queued, not waited for.
    """
    return _receive(src, ctx, slot)


def scratch(ctx, shape, dtype, slot):
    """A persistent buffer of ``shape`` and ``dtype`` on ``ctx`` (the receive buffers' cache, ``slot`` apart from
    theirs as the caller chooses), for what a reduction computes on the way (a decoded payload); its values are
    whatever was last written: write every element before reading it. Call it inside ``exclusive()``."""
    return BUFFERS.get(ctx, tuple(shape), dtype, slot)


def exclusive():
    """A context manager under which one thread queues a reduction's copies alone: ``allreduce`` and the other
    algorithms take it too (it is re-entrant), so that two threads never interleave their use of one buffer."""
    return BUFFERS.lock


def free_buffers():
    """Drop every cached receive buffer (their memory is freed once the work queued on them has run).

    The next allreduce allocates afresh: call this when a program is done reducing, or before it
    switches to other shapes, to give the memory back. Also resets ``buffer_info()``'s counters.
    """
    with BUFFERS.lock:
        BUFFERS.clear()


def set_buffer_limit(nbytes):
    """Bound the bytes the receive-buffer cache keeps, over all contexts; returns the previous bound.

    The default, ``DEFAULT_BUFFER_LIMIT`` (1 GiB), holds what ``benchmarks/allreduce.py`` reduces (every
    algorithm, 1 KB .. 64 MB, K = 2 and 4: about 0.5 GiB). When the buffers a program needs exceed the
    bound, the least recently used are dropped and allocated again when next needed: still correct,
    but the page faults come back. A buffer larger than the bound is never kept. 0 disables the cache.
    """
    check_int(nbytes, "nbytes", low=0)
    with BUFFERS.lock:
        previous, BUFFERS.limit = BUFFERS.limit, int(nbytes)
        BUFFERS.shrink(BUFFERS.limit)
    return previous


def buffer_info():
    """The receive-buffer cache now: a ``BufferInfo`` (entries, bytes, limit, allocations, evictions)."""
    with BUFFERS.lock:
        return BufferInfo(len(BUFFERS.buffers), BUFFERS.nbytes, BUFFERS.limit, BUFFERS.allocations,
                          BUFFERS.evictions)


def buffer_bytes():
    """``{context: bytes}`` the receive-buffer cache holds on each context now (what a run's memory table counts as
    temporary buffers); contexts without a buffer are left out."""
    per_context = {}
    with BUFFERS.lock:
        for buffer in BUFFERS.buffers.values():
            per_context[buffer.context] = per_context.get(buffer.context, 0) + buffer.size * buffer.dtype(0).itemsize
    return per_context


def add_into(dst, src):
    """``dst += src`` on ``dst``'s context, queued; the same additions ``dst[i] + src[i]``, bit for bit.

    ``NDArray.__iadd__`` runs ``broadcast_add``, which on MXNet 1.9's CPU contexts takes about twice as
    long as ``add_n`` for large arrays (64 MB, 2 OpenMP threads: 12.6 ms against 6.9 ms).
    """
    mx.nd.add_n(dst, src, out=dst)


def _naive(arrays):
    """The textbook: add every array into the first one, then copy the sum back to the others.

    Receives into one buffer on the first context, one array of extra memory there: the copy of
    ``arrays[j + 1]`` waits until ``arrays[j]``'s has been added (measured: no slower than K-1 buffers).
    """
    total = arrays[0]
    for array in arrays[1:]:
        add_into(total, _receive(array, total.context))   # runs on the first context
    for array in arrays[1:]:
        copy_to(total, array)                                # broadcast: one copy per other context


def _fused(arrays):
    """One reduction: gather copies on the first context, sum them with one add_n, broadcast back.

    The K-1 copies coexist: K-1 receive buffers of the whole array on the first context (slots 0 .. K-2).
    """
    ctx = arrays[0].context
    mx.nd.add_n(*[arrays[0]] + [_receive(array, ctx, slot) for slot, array in enumerate(arrays[1:])],
                out=arrays[0])
    for array in arrays[1:]:
        copy_to(arrays[0], array)


def chunk_bounds(n, k):
    """``k + 1`` offsets cutting ``n`` elements into ``k`` chunks whose sizes differ by at most one.

    The first ``n % k`` chunks get one element more; with ``n < k`` the last chunks are empty.

    >>> chunk_bounds(10, 3), chunk_bounds(2, 3)
    ([0, 4, 7, 10], [0, 1, 2, 2])
    """
    base, extra = divmod(n, k)
    bounds = [0]
    for i in range(k):
        bounds.append(bounds[-1] + base + (i < extra))
    return bounds


def _ring_chunks(arrays):
    """Each array's flat views cut into K chunks (``chunk_bounds``); ``None`` for an empty chunk."""
    bounds = chunk_bounds(arrays[0].size, len(arrays))
    return [[flat[a:b] if a < b else None for a, b in zip(bounds, bounds[1:])]
            for flat in [array.reshape(-1) for array in arrays]]


def ring_reduce_scatter(arrays):
    """The first half of the ring: afterwards context ``i`` holds the full sum of chunk ``i + 1`` (mod K).

    In round ``s = 0 .. K-2`` context ``i`` sends chunk ``i - s`` (mod K) to context ``i + 1``, which adds it
    into its own copy of that chunk. Each context sends and receives ``(K-1) / K`` of the array.
    """
    k, chunks = len(arrays), _ring_chunks(arrays)
    for s in range(k - 1):
        for i in range(k):
            c, dst = (i - s) % k, (i + 1) % k
            if chunks[i][c] is not None:
                add_into(chunks[dst][c], _receive(chunks[i][c], arrays[dst].context))   # on dst


def ring_all_gather(arrays):
    """The second half of the ring: from context ``i`` holding chunk ``i + 1`` (mod K), every context holds
    every chunk. In round ``s`` context ``i`` sends chunk ``i + 1 - s``, complete, and the receiver overwrites
    its copy: every context ends with the very same bits."""
    k, chunks = len(arrays), _ring_chunks(arrays)
    for s in range(k - 1):
        for i in range(k):
            c, dst = (i + 1 - s) % k, (i + 1) % k
            if chunks[i][c] is not None:
                copy_to(chunks[i][c], chunks[dst][c])


def _ring(arrays):
    """Ring allreduce: reduce-scatter, then all-gather, over the flat arrays cut into K chunks.

    Context ``i`` only ever sends to context ``i + 1`` (mod K). After the *reduce-scatter*
    (``ring_reduce_scatter``) context ``i`` holds the full sum of chunk ``i + 1``; the *all-gather*
    (``ring_all_gather``) passes the complete chunks on around the ring: every context ends with the very
    same bits, each chunk summed once, in one order.
    Each context sends (and receives) ``2 (K-1) / K`` of the array, whatever K: bandwidth-optimal.
    Every context receives into one buffer of a chunk (two when the chunks differ in size): ``1 / K`` of
    the array of extra memory per context.
    """
    ring_reduce_scatter(arrays)
    ring_all_gather(arrays)


def _direct_reduce_scatter(arrays):
    """Each chunk summed at once where it is owned (context ``i`` owns chunk ``i + 1``, as after the ring's
    reduce-scatter): the owner receives the chunk from every other context and adds the K copies with one
    ``add_n`` in context order, the fused allreduce's additions (its own copy in its place among them), so the
    sums are ``_fused``'s bits. An owner other than the first context adds into a scratch buffer and copies the
    sum into its chunk: ``add_n`` may write its output only over its first input."""
    k, chunks = len(arrays), _ring_chunks(arrays)
    for i in range(k):
        c = (i + 1) % k
        own = chunks[i][c]
        if own is None:
            continue
        ctx = arrays[i].context
        others = iter(range(k - 1))
        copies = [own if j == i else _receive_flat(chunks[j][c], ctx, next(others)) for j in range(k)]
        if i == 0:
            mx.nd.add_n(*copies, out=own)
        else:
            copy_to(mx.nd.add_n(*copies, out=BUFFERS.flat(ctx, own.size, own.dtype, k - 1)), own)


def _direct_all_gather(arrays):
    """Each owner (context ``i``, chunk ``i + 1``) copies its chunk straight to every other context."""
    k, chunks = len(arrays), _ring_chunks(arrays)
    for i in range(k):
        c = (i + 1) % k
        if chunks[i][c] is not None:
            for j in range(k):
                if j != i:
                    copy_to(chunks[i][c], chunks[j][c])


def _tree(arrays):
    """Tree allreduce: pairwise sums in ceil(log2 K) rounds, then a broadcast down the same tree.

    In reduction round ``r`` (stride ``2**r``), context ``i`` with ``i % 2**(r+1) == 0`` receives the
    partial sum of context ``i + 2**r`` (if it exists) and adds it to its own, so context 0 ends with the
    total. The broadcast replays the rounds backwards: context ``i`` copies the total to ``i + 2**r``.
    K need not be a power of two. Context 0 sends and receives ``ceil(log2 K)`` whole arrays.
    Every context that receives (``arrays[i]`` for even ``i < K - 1``) does so into one buffer: one
    array of extra memory there.
    """
    k = len(arrays)
    strides = []
    while 2 ** len(strides) < k:
        strides.append(2 ** len(strides))
    for stride in strides:                            # reduce: pairs at distance `stride`
        for i in range(0, k - stride, 2 * stride):
            add_into(arrays[i], _receive(arrays[i + stride], arrays[i].context))
    for stride in reversed(strides):                  # broadcast: the same pairs, backwards
        for i in range(0, k - stride, 2 * stride):
            copy_to(arrays[i], arrays[i + stride])


#: The algorithms by name (``parallel.comm.ALGORITHMS``, in that order).
ALLREDUCE_ALGORITHMS = dict(zip(ALGORITHMS, (_naive, _fused, _ring, _tree)))

#: The two halves of an allreduce, by the name of the allreduce they split (``SHARDED_ALGORITHMS``).
_HALVES = {"ring": (ring_reduce_scatter, ring_all_gather), "fused": (_direct_reduce_scatter, _direct_all_gather)}

BytesMoved = namedtuple("BytesMoved", ["total", "per_context_max"])
BytesMoved.__doc__ = """Bytes an allreduce copies between contexts.

total : int
    Sum of the sizes of all copies between contexts (each copy counted once).
per_context_max : int
    The busiest context's traffic: the maximum over contexts of max(bytes it sends, bytes it
    receives). With one full-duplex link per context (GPUs) this bounds the time; on one machine's
    shared memory ``total`` does.
"""


def bytes_moved(algorithm, nbytes, k, itemsize=4, compression=None, shapes=None):
    """Bytes that ``allreduce(arrays, algorithm)`` copies between contexts, for K arrays of ``nbytes``.

    With ``n = nbytes``: ``naive`` and ``fused`` move ``2 (K-1) n`` in total (K-1 arrays in, K-1 out
    of the first context, which is the busiest: ``(K-1) n`` each way); ``tree`` moves ``2 (K-1) n`` too,
    but its busiest context (the root) sends and receives ``ceil(log2 K) n``; ``ring`` moves
    ``2 (K-1) n`` as well, spread evenly: each context sends and receives ``2 (K-1) n / K``
    (exactly so when the element count is a multiple of K; otherwise chunks differ by one element).
    Sums are not counted, only copies. K = 1 moves nothing.

    Parameters
    ----------
    algorithm : str
        One of ``ALLREDUCE_ALGORITHMS``.
    nbytes : int
        Size of one array in bytes (``array.size * itemsize``).
    k : int
        Number of contexts, >= 1.
    itemsize : int
        Bytes per element (4 for float32): the ring cuts at element boundaries.
    compression : parallel.compress.Codec, optional
        The bytes of ``parallel.comm.reducer.compressed_allreduce`` with this codec instead, for float32 buffers
        laid out as ``shapes`` (default: one vector): K-1 payloads gathered to the first context and one broadcast
        back to K-1 contexts (``payload_nbytes``), or, for a codec that sums its own factors (PowerSGD's
        ``rounds``), each round all-reduced with ``algorithm`` as one flat buffer.

    Returns
    -------
    BytesMoved
        ``(total, per_context_max)`` in bytes.
    """
    check_choice(algorithm, "algorithm", ALGORITHMS)
    for name, value, low in (("nbytes", nbytes, 0), ("k", k, 1), ("itemsize", itemsize, 1)):
        check_int(value, name, low=low)
    if nbytes % itemsize:
        raise ValueError(f"nbytes={nbytes} is not a whole number of {itemsize}-byte elements; "
                         "give nbytes = array.size * itemsize")
    if compression is not None:
        return _compressed_bytes(compression, algorithm, nbytes // itemsize, k, shapes)
    n, total = nbytes, 2 * (k - 1) * nbytes
    if k == 1:
        return BytesMoved(0, 0)
    if algorithm == "ring":   # context i sends every chunk but i+1 (reduce-scatter) and i+2 (all-gather)
        bounds = chunk_bounds(n // itemsize, k)
        sizes = [(b - a) * itemsize for a, b in zip(bounds, bounds[1:])]
        return BytesMoved(total, 2 * n - min(sizes[(i + 1) % k] + sizes[(i + 2) % k] for i in range(k)))
    if algorithm == "tree":
        return BytesMoved(total, math.ceil(math.log2(k)) * n)
    return BytesMoved(total, (k - 1) * n)




def _compressed_bytes(codec, algorithm, size, k, shapes):
    """``bytes_moved`` of a codec's reduction of K float32 buffers of ``size`` elements (see ``bytes_moved``)."""
    shapes = [(size,)] if shapes is None else shapes
    rounds = codec.rounds(shapes)
    if rounds is not None:   # the codec's own sums, each an allreduce of one flat buffer
        moved = [bytes_moved(algorithm, 4 * floats, k) for floats in rounds if floats]
        return BytesMoved(sum(m.total for m in moved), sum(m.per_context_max for m in moved))
    payload = codec.payload_nbytes(size, shapes)
    return BytesMoved(2 * (k - 1) * payload, (k - 1) * payload)


def allreduce(arrays, algorithm="naive", check=True):
    """Sum ``arrays`` elementwise, in place: afterwards every array holds the sum of all of them.

    Parameters
    ----------
    arrays : list of NDArray
        One array per context, all of one shape and dtype. Modified in place.
    algorithm : str
        One of ``ALLREDUCE_ALGORITHMS``. ``"naive"`` (the textbook) adds each array into ``arrays[0]``
        one by one, then broadcasts back; ``"fused"`` sums all copies with one ``add_n``; ``"ring"``
        (reduce-scatter + all-gather in chunks) and ``"tree"`` (pairwise sums in log2 K rounds) spread
        the copies over all contexts. ``bytes_moved`` says how many bytes each copies.
    check : bool
        False skips checking ``arrays`` and ``algorithm`` (about 70 Python calls for two contexts): for callers
        that reduce arrays they made or checked once (a ``Reducer``'s own buckets, a tensor group's outputs).

    Returns
    -------
    list of NDArray
        ``arrays`` itself. The work is queued on MXNet's engine: the call does not block; reading an
        array (``asnumpy()``) waits for it.

    Notes
    -----
    What an algorithm receives from another context is copied into persistent buffers, reused by the
    next call with the same shape, dtype and contexts instead of allocated anew (a fresh buffer costs a
    page fault per 4 KB page on CPU contexts). Extra memory, per distinct shape and dtype reduced:
    ``fused`` keeps K-1 arrays on the context of ``arrays[0]``, ``naive`` one, ``tree`` one on that of
    every ``arrays[i]`` with ``i < K - 1`` even, ``ring`` a chunk (1/K of the array) on every context. The
    algorithms share buffers (same context, shape, dtype and slot: ``fused``'s first is ``naive``'s),
    and the cache holds at most ``set_buffer_limit`` bytes (1 GiB by default), least recently used
    dropped first; ``free_buffers`` empties it and ``buffer_info`` tells its state. Calls from several
    threads are serialized while they queue their work, so that two calls never interleave their use
    of one buffer.
    """
    if check:
        check_same_arrays(arrays)
        check_choice(algorithm, "algorithm", ALGORITHMS)
    if len(arrays) > 1:
        with BUFFERS.lock:   # queue one call's copies and adds together: they share the buffers
            ALLREDUCE_ALGORITHMS[algorithm](arrays)
    return arrays


def shard_range(size, k, i):
    """The elements ``[start, stop)`` of a flat array of ``size`` elements that context ``i`` of ``k`` owns after
    ``reduce_scatter``: chunk ``i + 1`` (mod k) of ``k`` chunks whose sizes differ by at most one (the first
    ``size % k`` chunks one element longer), where the ring's reduce-scatter leaves it. With ``size < k`` some
    contexts own nothing (``start == stop``).

    >>> [shard_range(10, 3, i) for i in range(3)]
    [(4, 7), (7, 10), (0, 4)]
    """
    check_int(size, "size", low=0)
    check_int(k, "k", low=1)
    check_int(i, "i", low=0, high=k - 1)
    bounds = chunk_bounds(size, k)
    c = (i + 1) % k
    return bounds[c], bounds[c + 1]


def reduce_scatter(arrays, algorithm="ring"):
    """Sum ``arrays`` elementwise, each context keeping one shard of the sum: the first half of an allreduce.

    Afterwards ``arrays[i]`` holds, in its elements ``shard_range(size, K, i)``, the sum of those elements over
    every array; its other elements hold partial sums (undefined). ``all_gather`` then completes the allreduce.
    This is what ZeRO's stage 2 runs instead of an allreduce: each context updates only the shard it owns.

    Parameters
    ----------
    arrays : list of NDArray
        One array per context, all of one shape and dtype. Modified in place.
    algorithm : str
        ``"ring"``: the ring's reduce-scatter, K-1 rounds in which each context sends one chunk to the next
        (``allreduce(arrays, "ring")`` is ``reduce_scatter`` then ``all_gather``, bit for bit). ``"fused"``:
        every owner receives its chunk from all the others at once and sums the K copies with one ``add_n`` in
        context order (``allreduce(arrays, "fused")``'s additions: its sums, bit for bit). Either way each context
        sends and receives ``(K-1) / K`` of the array.

    Returns
    -------
    list of NDArray
        ``arrays`` itself; the work is queued, nothing waits for the devices.

    >>> import mxnet as mx
    >>> arrays = [mx.nd.array([1, 2, 3, 4, 5]) * (i + 1) for i in range(2)]   # on two contexts in practice
    >>> arrays = [a.as_in_context(mx.cpu(i)) for i, a in enumerate(arrays)]
    >>> _ = reduce_scatter(arrays)
    >>> [arrays[i][slice(*shard_range(5, 2, i))].asnumpy().tolist() for i in range(2)]
    [[12.0, 15.0], [3.0, 6.0, 9.0]]
    """
    return _halve(arrays, algorithm, 0)


def all_gather(arrays, algorithm="ring"):
    """Give every context every shard, in place: the second half of an allreduce.

    Before, ``arrays[i]`` holds a valid value in its elements ``shard_range(size, K, i)``; afterwards every
    array holds all the shards, copies of the owners' bits. ZeRO runs it on the parameters after each context
    updated its shard. ``algorithm``: ``"ring"`` (passed on around the ring) or ``"fused"`` (each owner copies
    its shard to every other context); see ``reduce_scatter``.
    """
    return _halve(arrays, algorithm, 1)


def _halve(arrays, algorithm, half):
    check_same_arrays(arrays)
    check_choice(algorithm, "algorithm", SHARDED_ALGORITHMS)
    if len(arrays) > 1:
        with BUFFERS.lock:
            _HALVES[algorithm][half](arrays)
    return arrays
