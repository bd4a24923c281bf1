"""Joining a distributed job, and the cross-process level of the allreduce (MXNet's kvstore, ps-lite).

Run under ``python -m parallel.launch``, each worker process joins the job, takes rank 0's parameters, and
trains on its slice of every global batch: its own contexts first sum their gradients with the package's
allreduce, then one ``pushpull`` of each flat gradient bucket sums the workers' through the kvstore's
servers, and the sum is copied back to the worker's contexts (a hierarchical allreduce, as Horovod and
NCCL do it). W workers of K contexts then train the same model as one context.

>>> from parallel.job import worker_slice
>>> [worker_slice(13, 2, rank, 3) for rank in range(3)]   # 13 examples over 3 workers x 2 contexts
[(0, 5), (5, 9), (9, 13)]
"""
import contextlib
import json
import math
import threading

from .engine import fence
from .flight import FlightRecorder, publishing
from .split import shard_sizes

__all__ = ["Job", "FlatParams", "join", "abandon", "worker_slice", "broadcast_params", "broadcast_aux",
           "broadcast_arrays", "allreduce_across", "broadcast_object", "sum_values", "gather_arrays", "bucket_key",
           "KEYS", "BUCKET_KEYS"]

#: Every kvstore key the package uses, by what it carries. A ``gluon.Trainer`` numbers its keys from 0 as well:
#: give it a kvstore of its own, not the job's.
KEYS = {
    "params": 0,      # the flat parameter buffer: rank 0's, broadcast
    "grads": 1,       # a gradient buffer summed outside a Reducer (allreduce_across's default)
    "length": 2,      # the length of a broadcast object (broadcast_object)
    "aux": 3,         # the arrays that are not trained (BatchNorm's running statistics): rank 0's, broadcast
    "state": 4,       # the optimizer's state buffers (4, 5: momentum, or Adam's mean and variance): rank 0's
    "sums": 100,      # small sums of n numbers use key 100 + n (n < 900)
    "chunks": 1000,   # the pieces of a broadcast object use keys 1000 .. 9999 (objects up to 36 MB)
    "statistics": 10000,  # BatchNorm's statistics gathered over the workers: 10000 + n for the n-th key, two each gather
                          # of a step (the forward's and the backward's; Job.key_for, n < 20000)
    "feedback": 30000,    # every worker's error-feedback state, gathered for a checkpoint (30000), or rank 0's
                          # checkpoint of it, broadcast on resume (30001)
    "sharded": 40000,     # zero=3: block s's piece j of k gathered over the workers, key 40000 + the group's
                          # first (Keys.gathers) + s k + j (below 499999)
    "norms": 499999,     # zero=3's squared norms of every worker's shards, gathered for clipping
    "sharded_arrays": 500000,   # zero=3: one array gathered whole for a checkpoint: 500000 + n_arrays * (state + 1)
                                # + array (state -1: the parameters)
    "buckets": 1000000,   # a Reducer's buckets: bucket b's part p (its sum, a hook's rounds, zero=2's shards) uses
                          # key 1000000 + BUCKET_KEYS * b + p (bucket_key)
}
#: Keys each bucket of a ``Reducer`` may use (``bucket_key``): part 0 its sum, parts 1-3 a communication hook's
#: rounds, part 4 + i context i's shard (``zero=2``).
BUCKET_KEYS = 1024
#: ``broadcast_object`` sends its JSON text in pieces of this many bytes (one float64 per byte), each under its own
#: key from ``KEYS["chunks"]``, at most ``CHUNK_KEYS`` of them.
CHUNK = 4096
CHUNK_KEYS = 9000


_JOINED = []   # every job this process joined: see join


class FlatParams:
    """What a job's broadcasts read of a replica, declared: ``data``, the one flat buffer its trained arrays are views
    of, and ``aux``, its arrays that are not trained (a list, maybe empty). ``parallel.comm.FlatReplica`` is the
    replica that declares it (``get_params``'s); a plain list of arrays does not. Declared here, below ``comm`` in the
    import graph, because this is where it is read."""
    data = None
    aux = ()


class Job:
    """This worker's place in a distributed job: the kvstore, its rank and the number of workers.

    Parameters
    ----------
    kv : mxnet.kvstore.KVStore
        A distributed kvstore (``mx.kv.create('dist_sync')``), or any object with ``rank``,
        ``num_workers``, ``type``, ``init`` and ``pushpull`` (``push`` and ``pull`` without ``pushpull``).

    Attributes
    ----------
    flight : parallel.flight.FlightRecorder
        Every collective this worker issued (kind, key, bytes, step): what the launcher compares across the
        workers when they disagree (published on stderr under ``python -m parallel.launch``).
    pushed : int
        The bytes this worker has pushed to the servers so far (every collective's push; it pulls as many back):
        read before and after a step for the step's.
    p3 : bool
        Whether the kvstore is MXNet's P3 store (``DMLC_PS_VAN_TYPE=p3``, read when not given): it cuts every
        key into slices sent with the push's priority, and numbers a slice's server key ``key + n / servers``
        with ``n`` one counter of every slice the process has made, so two keys of the package (``KEYS``: 0,
        100 + n, 1000000 + ...) would share server keys, their sums added together ("operands shape mismatch",
        or silently when the lengths agree). Under P3 the package's keys are numbered 0, 1, 2, ... in the order
        of their first use, the same on every worker: each key's server keys then start beyond the last one
        of the key before it, so no two keys ever meet.
    pushpull : bool
        Whether a sum is one ``kv.pushpull`` (the default) or a ``push`` and then a ``pull`` (``pushpull=False``, or
        ``PARALLEL_PUSHPULL=0`` in the environment when not given: the way before, kept to compare with). One
        request a key, answered with the sum, where the push and the pull were two; and MXNet 1.9.1's P3 store
        crashes on the two: its push operation reads the key's slice lengths from a copy it owns after sending
        the last slice, and when the servers' answer comes back first, the engine has already destroyed that
        copy with the finished operation ("Segmentation fault", or "Check failed: num_pending_reads_ > 0").
        Its pushpull reads them from the store's own table, which lives on. Measured: one key of 4,200 floats
        summed 3,000 times by 2 workers over P3 crashed each of 5 runs with a push and a pull, none of 6 as one
        pushpull (``tests/test_job.py``). A key's first sum is still a push and a pull: should the workers' keys
        disagree, a key only one worker initialised is initialised on the servers by that push, where a pushpull
        would get an empty answer and abort the worker (ps-lite's "Check failed: msg.data.size() >= 2") before
        the flight records could name the disagreement.
    """

    def __init__(self, kv, p3=None, pushpull=None):
        import os
        self.kv, self.rank, self.num_workers = kv, kv.rank, kv.num_workers
        self.pushpull = os.environ.get("PARALLEL_PUSHPULL", "1") != "0" if pushpull is None else bool(pushpull)
        self._keys = {}   # key -> (shape, dtype) of the keys initialised on the servers
        self.flight = FlightRecorder(self.rank)
        self.pushed = 0
        self.p3 = os.environ.get("DMLC_PS_VAN_TYPE") == "p3" if p3 is None else bool(p3)
        self._p3_keys = {}   # under P3: the package's key -> the kvstore's, 0, 1, 2, ... in the order of first use
        self._named = {}     # key_for's: kind -> name -> its key
        #: BatchNorm's statistics: ``"job"``, over every worker's slice of the batch (the default: the job trains
        #: one device's model), or ``"worker"``, over this worker's alone (``parallel.comm.statistics``)
        self.statistics = "job"
        # allsum's calls come from the thread issuing the step and from MXNet's custom-operator thread (BatchNorm's
        # backward, parallel.comm.statistics): the job's records one at a time, and the calls into MXNet's
        # distributed kvstore too (its front end fills maps of its buffers without a lock; every call returns at
        # once but a key's first, a barrier of the workers); a kvstore of another type says itself what it allows
        self._lock = threading.Lock()
        self._front = threading.Lock() if str(kv.type).startswith("dist") else contextlib.nullcontext()
        self._last = {}   # key -> the array of this worker's latest round of it (``after_last_round``)

    def __repr__(self):
        return f"Job(rank {self.rank} of {self.num_workers}, {self.kv.type})"

    def describe(self):
        """How the workers' sums travel, in words: ``"the dist_sync kvstore"``, and under P3 how it orders them."""
        line = f"the {self.kv.type} kvstore"
        if self.p3:
            line += " over MXNet's P3 (each key in slices sent by priority, the first layers' first)"
        return line

    def key_for(self, name, kind="statistics", limit=20000):
        """The key of ``name`` (anything hashable) among ``KEYS[kind] .. KEYS[kind] + limit - 1``: numbered in the
        order of first use, which is the same on every worker when every worker runs the same model."""
        named = self._named.setdefault(kind, {})
        if name not in named:
            if len(named) >= limit:
                raise ValueError(f"more than {limit} keys of kind {kind!r}; the job cannot number another")
            named[name] = KEYS[kind] + len(named)
        return named[name]

    def declare(self, key, array):
        """Initialise ``key`` on the servers for arrays of ``array``'s shape and dtype, now, unless it is already: a
        collective call (a barrier of the workers). For a key whose first sum comes from another thread (BatchNorm's
        backward, from MXNet's custom-operator thread), whose order no worker fixes: declared from the thread that
        issues the step, every worker numbers and initialises it in the same place."""
        with self._lock:
            known, store = self._book(key, array)
        if known is None:
            with self._front:
                self.kv.init(store, _zeros(array))

    def _book(self, key, array):
        """``(the layout known of key, or None, its kvstore key)``; a first use's layout kept and its initialisation
        recorded. Called with the job's records held (``_lock``)."""
        layout = (tuple(array.shape), array.dtype)
        known = self._keys.get(key)
        store = key if not self.p3 else self._p3_keys.setdefault(key, len(self._p3_keys))
        if known is None:
            self.flight.record("init", key, array.size * array.dtype(0).itemsize)
            self._keys[key] = layout
        elif known != layout:
            raise ValueError(f"kvstore key {key} holds arrays of shape {known[0]} and dtype {known[1].__name__}, "
                             f"not {layout[0]} {layout[1].__name__}; use another key")
        return known, store

    def allsum(self, key, array, priority=0, kind="allreduce", recorded=True):
        """Sum ``array`` over the workers, in place, and return it (one ``pushpull``; see ``Job.pushpull``).

        Every worker must make the same calls, with the same keys, shapes and dtypes, in the same order: each
        call waits for every worker's push. The first call with a key initialises it on the servers (a barrier
        of every worker); later calls with the key must keep its shape and dtype. Nothing else here waits for
        the device: the push starts once ``array`` is computed, and reading the result (``asnumpy``) waits for
        the sum. ``priority``: MXNet's engine runs higher priorities first among sums ready at once, and P3 sends
        higher priorities' slices first.
        ``kind``: what the flight recorder calls this collective (``allreduce``, ``broadcast``, ``allgather``);
        ``recorded=False`` leaves it out of the flight records, which number one ordered stream of collectives: a
        sum issued from another thread in an order no worker fixes (BatchNorm's backward rounds, from MXNet's
        custom-operator thread as the engine reaches them) would make the workers' records disagree.

        Calls under one key with *different* arrays must wait for the earlier result (``wait_to_read``) unless a
        data dependency orders them: MXNet's kvstore pushes a CPU array without copying it, so nothing in its
        engine orders a push of another array after this sum, and a worker's next round can reach the servers
        first, where it is summed with the other workers' earlier round (measured: wrong sums under the launcher,
        not in threads; a job that hung). The same array again is ordered; ``after_last_round`` orders a new one.
        """
        nbytes = array.size * array.dtype(0).itemsize
        with self._lock:   # the job's records
            known, store = self._book(key, array)
            if recorded:
                self.flight.record(kind, key, nbytes)
            self.pushed += nbytes
            self._last[key] = array
        with self._front:
            if known is None:
                # zeros of their own: ``zeros_like`` would read ``array``, and wait, holding the front end, for
                # what computes it (a backward pass whose BatchNorm sums need the front end: a deadlock)
                self.kv.init(store, _zeros(array))
            if self.pushpull and known is not None:   # one request, answered with the sum (no optimizer on servers)
                self.kv.pushpull(store, array, out=array, priority=priority)
            else:
                self.kv.push(store, array, priority=priority)
                self.kv.pull(store, out=array, priority=priority)
        return array

    def after_last_round(self, key, array):
        """Make the next round of ``key`` on ``array`` (an array of its own, not a view of another round's) leave
        after this worker's last round of the key: in MXNet's engine, ``array`` is written only once that round's
        sum is (``parallel.engine.fence``; nothing waits here). For an array that is ready at once, such as the
        zeros of a worker without an example, whose earlier round may still wait for its own array. A round another
        thread has not made yet is not ordered."""
        with self._lock:
            before = self._last.get(key)
        if before is not None and before is not array:
            fence([before], [array])

    def allgather(self, key, array, priority=0):
        """Every worker's ``array`` (1-D, one shape on every worker), as a list in rank order: one sum of a buffer
        of ``num_workers`` slots, each worker filling its own and leaving the others zero (adding zeros changes no
        float). A collective call, like ``allsum``; nothing waits for the device."""
        import mxnet as mx
        n = array.size
        slots = mx.nd.zeros((self.num_workers * n,), ctx=array.context, dtype=array.dtype)
        slots[self.rank * n:(self.rank + 1) * n] = array
        self.allsum(key, slots, priority, "allgather")
        return [slots[r * n:(r + 1) * n] for r in range(self.num_workers)]

    def broadcast(self, key, array):
        """Give every worker rank 0's ``array``, in place, and return it: the others push zeros (exact: adding
        zeros changes no float)."""
        if self.rank != 0:
            array[:] = 0
        return self.allsum(key, array, kind="broadcast")


def _zeros(array):
    """Zeros of ``array``'s shape, dtype and context, depending on nothing."""
    import mxnet as mx
    return mx.nd.zeros(array.shape, ctx=array.context, dtype=array.dtype)


def join(kvstore="dist_sync"):
    """Join the job this process was launched into (``python -m parallel.launch``); blocks until every
    worker and server has registered (the launcher's ``--start-timeout`` bounds that wait).

    Parameters
    ----------
    kvstore : str
        ``"dist_sync"`` (CPU contexts), or ``"dist_device_sync"`` (GPUs: the workers' sums are reduced on
        the device before they travel).

    A worker that fails must not wait for the others: at exit, ps-lite's shutdown waits for every worker to
    reach it, so a worker ending on an error while the others wait for its push would hang the job. So
    ``join`` makes an uncaught exception end the process at once (its traceback printed, status 1, see
    ``abandon``); a worker that stops with an error of its own should call ``abandon(status)``.
    """
    import os
    import sys
    import mxnet as mx
    if kvstore not in ("dist_sync", "dist_device_sync"):
        raise ValueError(f"kvstore {kvstore!r} is not a synchronous distributed kvstore; use 'dist_sync' or "
                         "'dist_device_sync'")
    if os.environ.get("DMLC_ROLE") != "worker":
        raise ValueError("this process was not started as a worker by a launcher (DMLC_ROLE is not 'worker'); "
                         "run it as: python -m parallel.launch -n 2 python ...")
    job = Job(mx.kv.create(kvstore))
    if publishing():   # under the launcher: it compares the workers' records when they disagree
        job.flight.publish_to()
    # Freeing the kvstore runs ps-lite's shutdown barrier; if that happened when a failing run() lets go of
    # its job, the worker would wait there instead of exiting with its error. Keep it until the process ends.
    if not _JOINED:
        import atexit
        atexit.register(_leave_jobs)
    _JOINED.append(job)
    hook = sys.excepthook

    def excepthook(*exc_info):
        hook(*exc_info)
        abandon(1)

    sys.excepthook = excepthook
    return job


def _leave_jobs():
    """At a normal exit, free the kvstores while MXNet's engine still runs (freed during the interpreter's
    teardown instead, a worker can abort with "terminate called without an active exception")."""
    import gc
    for job in _JOINED:   # this worker issues no more collectives: say so before ps-lite's shutdown barrier
        job.flight.finish()
    for job in _JOINED:
        job.kv = None
    _JOINED.clear()
    gc.collect()


def abandon(status):
    """End this worker now with exit ``status``, skipping ps-lite's shutdown (a barrier of every worker that
    would wait forever for a worker still blocked on this one's push). The launcher then sees the status and
    stops the job. Standard output and error are flushed first, and the process's temporary files removed
    (``os._exit`` runs no exit handlers)."""
    import os
    import sys
    from .files import remove_temporaries
    remove_temporaries()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)


def worker_slice(n, k, rank, num_workers):
    """The examples ``[start, stop)`` of a global batch of ``n`` that worker ``rank`` trains on.

    The batch is split over all ``num_workers * k`` contexts as ``split_and_load`` splits it (sizes differ by
    at most one, larger first); a worker takes the run of its ``k`` contexts, so its slice, split again over
    its own contexts, gives every context the shard it has in the global split. A worker whose contexts all
    fall beyond ``n`` gets an empty slice (``start == stop``) and must still take part in the step.
    """
    sizes = shard_sizes(n, num_workers * k) if n else []
    sizes += [0] * (num_workers * k - len(sizes))
    start = sum(sizes[:rank * k])
    return start, start + sum(sizes[rank * k:(rank + 1) * k])


def _flat(device_params):
    """``device_params`` if every replica is flat (a ``FlatReplica``: its arrays views of one ``data`` buffer)."""
    if not all(isinstance(params, FlatParams) for params in device_params):
        raise TypeError("a distributed step needs flat replicas: build device_params with get_params, whose "
                        "parameters share one dtype")
    return device_params


def broadcast_params(job, device_params):
    """Give every worker rank 0's parameters, in place; then every replica of this worker holds them. Call it
    on every worker, before training (again after loading parameters on rank 0 alone)."""
    replicas = _flat(device_params)
    job.broadcast(KEYS["params"], replicas[0].data)
    for params in replicas[1:]:
        replicas[0].data.copyto(params.data)


def broadcast_arrays(job, key, arrays):
    """Give every worker rank 0's ``arrays``, in place: one broadcast of their concatenation under ``key``. A
    collective call: every worker passes arrays of the same shapes and dtype."""
    import mxnet as mx
    flat = job.broadcast(key, mx.nd.concat(*[a.reshape(-1).as_in_context(arrays[0].context) for a in arrays],
                                           dim=0))
    offset = 0
    for array in arrays:
        flat[offset:offset + array.size].reshape(array.shape).copyto(array)
        offset += array.size
    return arrays


def gather_arrays(job, key, arrays):
    """Every worker's ``arrays`` on rank 0: ``[rank 0's list, rank 1's, ...]`` there (numpy), None on the others.
    A collective call: every worker passes arrays of the same shapes and dtype. One sum of a buffer of
    ``num_workers`` slots, each worker filling its own with its arrays and leaving the others zero."""
    import mxnet as mx
    size = sum(a.size for a in arrays)
    if not size:
        return [[] for _ in range(job.num_workers)] if job.rank == 0 else None
    slots = mx.nd.zeros((job.num_workers * size,), dtype=arrays[0].dtype)
    slots[job.rank * size:(job.rank + 1) * size] = mx.nd.concat(*[a.reshape(-1).as_in_context(mx.cpu())
                                                                  for a in arrays], dim=0)
    gathered = job.allsum(key, slots).asnumpy()
    if job.rank != 0:
        return None
    out = []
    for r in range(job.num_workers):
        offset, mine = r * size, []
        for a in arrays:
            mine.append(gathered[offset:offset + a.size].reshape(a.shape))
            offset += a.size
        out.append(mine)
    return out


def broadcast_aux(job, device_params):
    """Give every replica of every worker rank 0's arrays that are not trained (BatchNorm's running
    statistics), in place: one broadcast of their concatenation. A collective call, like ``broadcast_params``;
    nothing to do for replicas without such arrays."""
    aux = list(device_params[0].aux) if isinstance(device_params[0], FlatParams) else []
    if not aux:
        return
    broadcast_arrays(job, KEYS["aux"], aux)
    for params in device_params[1:]:
        for first, array in zip(aux, params.aux if isinstance(params, FlatParams) else ()):
            first.copyto(array)


def bucket_key(bucket, part=0):
    """The kvstore key of part ``part`` (0 .. ``BUCKET_KEYS - 1``) of a ``Reducer``'s bucket ``bucket``."""
    if not 0 <= part < BUCKET_KEYS:
        raise ValueError(f"part must be in 0..{BUCKET_KEYS - 1}, got {part}")
    return KEYS["buckets"] + BUCKET_KEYS * bucket + part


def allreduce_across(job, arrays, key=KEYS["grads"], priority=0):
    """Sum ``arrays[0]`` over the workers, in place, and copy the sum to the other arrays (this worker's other
    contexts, whose arrays already hold the same sum of this worker's contexts): the cross-process level of a
    hierarchical allreduce. One push and one pull (the servers split big arrays between them,
    ``MXNET_KVSTORE_BIGARRAY_BOUND``); a collective call under ``key``, like ``Job.allsum``."""
    job.allsum(key, arrays[0], priority)
    for array in arrays[1:]:
        arrays[0].copyto(array)
    return arrays


def broadcast_object(job, obj):
    """Rank 0's ``obj`` (anything ``json`` writes), on every worker: what rank 0 read from a checkpoint, say,
    with no shared file system. The other workers' ``obj`` is ignored. Blocks until it arrives."""
    import mxnet as mx
    import numpy as np
    data = json.dumps(obj).encode() if job.rank == 0 else b""
    length = int(job.broadcast(KEYS["length"], mx.nd.array([len(data)], dtype="float64")).asscalar())
    if math.ceil(length / CHUNK) > CHUNK_KEYS:   # every worker knows the length: all raise
        raise ValueError(f"obj is {length} bytes of JSON, more than the {CHUNK_KEYS * CHUNK} broadcast_object's "
                         "keys can carry")
    buffer = np.zeros(math.ceil(length / CHUNK) * CHUNK)
    buffer[:len(data)] = np.frombuffer(data, dtype=np.uint8)
    for i in range(len(buffer) // CHUNK):
        piece = mx.nd.array(buffer[i * CHUNK:(i + 1) * CHUNK], dtype="float64")
        buffer[i * CHUNK:(i + 1) * CHUNK] = job.broadcast(KEYS["chunks"] + i, piece).asnumpy()
    return json.loads(buffer[:length].astype(np.uint8).tobytes().decode())


def sum_values(job, values):
    """The sums over the workers of a few numbers (losses, counts), as floats; every worker gets the same.
    Blocks until they arrive. Summed in float64: counts up to 2**53 are exact."""
    import mxnet as mx
    values = [float(v) for v in values]
    return job.allsum(KEYS["sums"] + len(values), mx.nd.array(values, dtype="float64")).asnumpy().tolist()
