"""A timeline of training steps: what each context (and worker) ran, when, named as the package names it.

``with trace("step.json"):`` records what MXNet's engine runs inside the block with MXNet's profiler and writes a
Chrome trace (open it in ``chrome://tracing`` or https://ui.perfetto.dev): one lane (a "process") per context,
prefixed with the worker in a job, with two tracks (threads): ``operators``, each operator MXNet ran there, and
``issued``, a bar for each piece of work the package issued there, from when it started to when it was done.

Names come from what issued the work, not from an operator's name. Each issuer brackets its work with ``issued``:
on every context it touches, an empty engine operation before it that writes the arrays it reads and writes there,
and another after it. MXNet runs an operation on an array only after the operations queued before it on that array,
so every operation of the work that touches one of those arrays runs between the two marks, and the first mark
runs once the work's inputs are ready (a bucket's gradients written, say): the ``issued`` bar of a bucket's
reduction starts when its reduction did. The issuers are:

- ``load``: ``split_and_load``'s copies of each shard of the batch (on the context the batch is on);
- ``forward``: a step's forward pass and loss (each pipeline chunk's of each micro-batch);
- ``allreduce`` / ``reduce-scatter``: the Reducer's reduction of each bucket (``args``: the bucket, its bytes, its
  priority across workers, the first layers' bucket the highest, 0, and ``dense``: summed uncompressed by a
  compression's warm-up);
- ``gather``: ZeRO's all-gathers (ZeRO-1 and 2 after the update, ZeRO-3 before each block runs);
- ``send``: a pipeline's stage-to-stage copies, forward and backward;
- ``tensor``: tensor parallelism's f and g allreduces, forward and backward;
- ``update``: the optimizer's step (clipping and the update);
- ``metrics``: a step's sums of the loss and of the correct predictions.

An operator is named after the bracket it ran in on its lane when its name is one that issuer runs (``ISSUED_OPS``:
an allreduce runs copies, sums and a codec's operators, never a convolution); MXNet's ``_backward_*`` operators
(and the anonymous bulks, ``ImperativeBulk``, of an imperative backward after the step's ``BACKWARD_MARK``) are
``backward``; a recomputed forward (``mark_recompute``) is ``recompute``. An operator that two unrelated brackets
could have run (the metrics' copy while a bucket is reduced), or that autograd itself may run while the lane's
backward pass goes on (a gradient's ``add_n``, ``transpose``, ``zeros_like``), or that ran where nothing marked, is
named by itself (its phase ``other``). MXNet runs an operation once its inputs are ready, so an operator queued
outside every bracket may still run while one is open and take its name: a step queues its sums inside brackets
(its sum over micro-batches is ``metrics``). So with one bucket no operator is ``allreduce`` before the last
backward operator: the bucket's first mark waits for every gradient. The operator is in each event's ``args.op``,
the bracket's number in ``args.issue``. ``plot_timeline(trace)`` draws the operators as a Gantt chart.

The marks change nothing while no trace records. While one does, they order an issuer's later operations after
its first mark, and its first mark after what was queued before on its arrays: ZeRO-3's prefetched gather in
backward then waits for the backward of the block before it, and the update of one group of parameters waits for
the reductions of all of them.

MXNet's profiler is one per process: ``trace`` configures it once, to a file of its own in the system's temporary
directory, into which each ``trace`` dumps its events, read and removed when the trace ends; one ``trace`` runs at a
time. The profiler files each event under a numbered slot: ``cpu(i)`` under slot i, one slot for each processor it
counts (``omp_get_num_procs``), then ``gpu(i)`` (32 slots in a CUDA build, none otherwise), then pinned and shared
CPU memory. So it can record only CPU contexts numbered below the processor count: ``cpu(N)`` and ``cpu(N+1)`` on N
processors land in the memory slots, and ``cpu(N+2)`` aborts the process (MXNet checks the slot in its engine).
``trace(contexts=...)`` and ``--trace`` refuse those contexts up front (``check_traceable``). The slots' labels are
written only by the first dump of a process, into whatever file the profiler was configured with then, so lanes are
named from the slot numbers, not from the labels.
"""
import contextlib
import json
import os
import re
import threading
from collections import namedtuple

from .files import atomic_write, scratch_file

__all__ = ["trace", "Trace", "PHASES", "ISSUED_OPS", "BACKWARD_MARK", "issued", "mark_backward_each", "backward_heads",
           "mark_forward_each", "collective",
           "mark_recompute",
           "check_traceable", "plot_timeline", "read_trace", "reduction_order", "traced_sums", "worker_path"]

#: The phases a trace names its operators by: what issued them. The first five happen in this order on every
#: context; ZeRO-3 adds gather, recompute and reduce-scatter, a pipeline its sends, tensor parallelism its
#: collectives; ``metrics`` are a step's loss and accuracy sums; ``other`` is an operator nothing marked, named by
#: itself.
PHASES = ("load", "forward", "backward", "allreduce", "update", "gather", "recompute", "reduce-scatter", "send",
          "tensor", "metrics", "other")

_UPDATES = ("sgd_update", "sgd_mom_update", "nag_mom_update", "adam_update", "_contrib_adamw_update", "adamw_update",
            "multi_", "mp_sgd", "lamb_update", "_mul_scalar_update")
_BOOKKEEPING = ("DeleteVariable", "SetValueOp", "WaitForVar")
#: What MXNet's profiler calls a bulk of imperative operators (of the backward pass, or other small ones).
_BULK = "ImperativeBulk"
#: The empty operation ``backward_heads`` and ``mark_backward_each`` queue on a context: its backward pass comes after
#: it.
BACKWARD_MARK = "parallel:backward"
#: Before a recomputed forward (``mark_recompute``): a lane's operators from it to the next ``BACKWARD_MARK``.
RECOMPUTE_MARK = "parallel:recompute"
#: Before a forward that may follow a backward on its lane (a pipeline's 1F1B: ``mark_forward_each``).
FORWARD_MARK = "parallel:forward"
#: The marks ``issued`` brackets an issuer's work with on each context: ``parallel:begin:N`` and
#: ``parallel:end:N``, N the issue's number in this process (its kind and details kept until the trace is written).
BEGIN_MARK, END_MARK = "parallel:begin:", "parallel:end:"
#: The operators a collective runs: copies between contexts, sums, zero fills, the kvstore's transfers.
TRANSFER_OPS = ("Copy", "_copyto", "_copy", "add_n", "ElementWiseSum", "elemwise_add", "_grad_add", "_slice_assign",
                "_set_value", "_zeros", "_full", "zeros_like", "KVStore", "slice", "_crop_assign")
#: What a codec's hook runs besides (``parallel.compress``: casts, top-k selection, 2-bit quantization, PowerSGD).
CODEC_OPS = ("Cast", "amp_cast", "topk", "take", "scatter_nd", "gather_nd", "elemwise_sub", "elemwise_mul",
             "elemwise_div", "broadcast_", "norm", "clip", "abs", "sign", "slice_axis", "concat", "Concat",
             "floor", "round", "FullyConnected", "dot", "batch_dot", "_linalg", "_equal", "_greater", "_lesser",
             "_not_equal", "_mul_scalar", "_div_scalar", "_plus_scalar", "_minus_scalar", "_rminus_scalar",
             "where", "reshape", "Reshape", "sum", "sqrt", "square", "_power_scalar", "one_hot", "_contrib_")
#: What each kind of issue runs: an operator in one issue's bracket on its lane takes the issue's kind only if its
#: name starts with one of these (an operator of the backward pass that runs meanwhile is not the issue's).
ISSUED_OPS = {
    "load": TRANSFER_OPS,
    "allreduce": TRANSFER_OPS + CODEC_OPS,
    "reduce-scatter": TRANSFER_OPS + CODEC_OPS,
    "gather": TRANSFER_OPS,
    "send": TRANSFER_OPS,
    "tensor": TRANSFER_OPS,
    "update": _UPDATES + TRANSFER_OPS + ("norm", "_power_scalar", "square", "sqrt", "clip", "broadcast_",
                                        "_plus_scalar", "_rdiv_scalar", "_div_scalar", "elemwise_div", "reshape",
                                        "Reshape", "_mul_scalar", "sum"),
    "metrics": TRANSFER_OPS + ("sum", "argmax", "_equal", "broadcast_equal", "Cast", "amp_cast"),
    "forward": ("",),   # every operator: a forward runs the model's own
}
#: The head and the tail MXNet writes around a dump's events (a later dump may lack the head: see the module's notes).
_FRAME = re.compile(r"\{\s*\"traceEvents\"\s*:\s*\[|\]\s*,\s*\"displayTimeUnit\"\s*:\s*\"ms\"\s*\}")

Trace = namedtuple("Trace", ["events", "lanes", "path"])
Trace.__doc__ = """A recorded timeline.

events : list of dict
    Chrome trace events (``ph`` "X": ``ts`` and ``dur`` in microseconds from the first event, ``pid`` the lane;
    ``tid`` 0 an operator, ``cat`` its phase, ``name`` the phase or, for ``other``, the operator, ``args.op``
    MXNet's operator; ``tid`` 1 an issuer's bracket, ``cat`` its kind, ``name`` its label, ``args`` its details).
lanes : list of str
    The lanes' names, by ``pid``: ``"cpu(0)"``, or ``"worker 1 cpu(0)"`` in a job.
path : str or None
    Where the trace was written.
"""

_lock = threading.Lock()
_state = {"file": None, "seen": 0, "slots": {}, "recording": False}


def _profiler_file():
    import mxnet as mx
    if _state["file"] is None:
        # each trace reads and removes it when it ends; a process that ends mid-trace removes it too
        path = scratch_file("parallel-profile-", ".json")
        mx.profiler.set_config(profile_all=True, filename=path, aggregate_stats=False)
        _state["file"] = path
    return _state["file"]


def _processors():
    """The processors MXNet's profiler counts (``omp_get_num_procs``: those this process may run on)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 64)


def _gpu_slots():
    """The GPU slots of MXNet's profiler: 32 in a CUDA build, none otherwise."""
    import mxnet as mx
    return 32 if mx.runtime.Features().is_enabled("CUDA") else 0


def check_traceable(contexts):
    """Raise ``ValueError`` unless MXNet's profiler can record every context of ``contexts`` in a lane of its own:
    CPU contexts must be numbered below the processor count (see the module's notes)."""
    cpus = _processors()
    beyond = [str(c) for c in contexts if c.device_type == "cpu" and c.device_id >= cpus]
    if beyond:
        raise ValueError(f"MXNet's profiler records CPU contexts cpu(0)..cpu({cpus - 1}) on this machine's {cpus} "
                         f"processors, not {', '.join(beyond)}; trace with at most {cpus} CPU contexts")


class trace:
    """Record the steps run inside the ``with`` block; write a Chrome trace to ``path`` (atomically) on exit.

    Parameters
    ----------
    path : str or os.PathLike, optional
        Where to write the trace (JSON); None: keep it in memory only (``.result``).
    worker : int, optional
        In a distributed job, this worker's rank: its lanes are named ``"worker R cpu(0)"``.
    contexts : list of mxnet.Context, optional
        The contexts the block computes on: a lane for each, in this order, checked by ``check_traceable`` on
        entry (``ValueError``). None: a lane for every context that ran operators, in slot order (GPUs after
        CPUs).

    The block's work is waited for on entry and on exit (``mx.nd.waitall``), so the trace holds exactly it.
    ``.result`` is the ``Trace`` after the block.
    """

    def __init__(self, path=None, worker=None, contexts=None):
        self.path = None if path is None else os.fspath(path)
        self.worker, self.result = worker, None
        self.contexts = None if contexts is None else list(contexts)

    def __enter__(self):
        import mxnet as mx
        if self.contexts is not None:
            check_traceable(self.contexts)
        if not _lock.acquire(blocking=False):
            raise RuntimeError("a trace is already recording in this process; MXNet has one profiler")
        try:
            _profiler_file()
            _state["issued"] = {}   # the issues of earlier traces: their marks are in no later trace
            mx.nd.waitall()
            mx.profiler.set_state("run")
            _state["recording"] = True
        except BaseException:
            _lock.release()
            raise
        return self

    def __exit__(self, *exc):
        import mxnet as mx
        try:
            mx.nd.waitall()
            mx.profiler.set_state("stop")
            _state["recording"] = False
            mx.profiler.dump()
            with open(_state["file"]) as f:
                text = f.read()
            with contextlib.suppress(OSError):   # read: the next dump writes it again (a process ended by
                os.remove(_state["file"])        # os._exit, as pytest-xdist's workers are, leaves nothing)
        finally:
            _lock.release()
        raw = _events(text)
        fresh = [e for e in raw if e.get("ts", 0) > _state["seen"]]
        _state["seen"] = max([_state["seen"]] + [e.get("ts", 0) for e in raw])
        self.result = _timeline(raw, fresh, self.worker, self.path, self.contexts)
        if self.path is not None:
            with atomic_write(self.path, "w") as f:
                json.dump({"traceEvents": self.result.events, "displayTimeUnit": "ms"}, f)
        return False


@contextlib.contextmanager
def issued(kind, arrays, label=None, closes_on_made=False, **details):
    """While a trace records: bracket the operations queued inside the ``with`` block with marks on each context of
    ``arrays()`` (a function returning NDArrays, any contexts: those the issued work reads or writes; views count as
    their arrays; called only while a trace records, as ``label`` and ``details``' values are when they are
    functions: a step that nothing records builds none of them), so that
    the trace names them by what issued them, ``kind`` (one of ``ISSUED_OPS``). On each context a mark that writes
    that context's arrays is queued before the block and another after it: every operation of the block that
    touches one of them runs between the two (MXNet orders operations by the arrays they read and write), and
    whatever was queued on them before runs first. The trace draws each bracket as an event of its own (``label``,
    or ``kind``; ``details`` such as the bucket and its bytes in its ``args``) and names an operator inside it
    ``kind`` when its name is one ``kind`` runs. The ``with`` block gets a list: arrays it adds (ones it made) are
    written by the closing marks too, so that the operations that read them run inside the bracket;
    ``closes_on_made``: by the closing marks alone (they then hold back nothing queued later on ``arrays``: the
    block's operations must each write one of them or read one of them before a write of one of them). Nothing
    otherwise: no mark, no order beyond MXNet's own."""
    _check_lazy(arrays, "arrays")
    made = []
    if not _state["recording"]:
        yield made
        return
    from .engine import mark
    label = label() if callable(label) else label
    details = {key: value() if callable(value) else value for key, value in details.items()}
    by_context = {}
    for array in arrays():
        by_context.setdefault(array.context, []).append(array)
    number = _state["issues"] = _state.get("issues", 0) + 1
    stack = _state.setdefault("stack", [])
    _state.setdefault("issued", {})[number] = (kind, label or kind, details, stack[-1] if stack else None)
    for ctx, group in by_context.items():
        mark(f"{BEGIN_MARK}{number}", ctx, writes=_distinct(group))
    stack.append(number)
    try:
        yield made
    finally:
        stack.pop()
    closing = {} if closes_on_made else by_context
    for array in made:
        closing.setdefault(array.context, []).append(array)
    for ctx, group in by_context.items():   # a context the block made nothing on closes on its arrays
        closing.setdefault(ctx, group)
    for ctx, group in closing.items():
        mark(f"{END_MARK}{number}", ctx, writes=_distinct(group))


def _check_lazy(arrays, name):
    """``TypeError`` naming ``name`` unless ``arrays`` is a function (of the arrays a trace would mark): a list
    would be built every step, recorded or not."""
    if not callable(arrays):
        raise TypeError(f"{name} must be a function returning the arrays (built only while a trace records), got "
                        f"{type(arrays).__name__}")


def _distinct(arrays):
    """``arrays`` without repeats: MXNet's engine waits forever on an operation that names an array twice."""
    seen, kept = set(), []
    for array in arrays:
        if array.handle.value not in seen:
            seen.add(array.handle.value)
            kept.append(array)
    return kept


def collective(kind, arrays):
    """ZeRO-3's collectives (``"gather"`` or ``"reduce-scatter"``): ``issued(kind, ...)`` over ``arrays()``, a list
    of arrays per context (a function, as ``issued`` takes)."""
    _check_lazy(arrays, "arrays")
    return issued(kind, lambda: [array for group in arrays() for array in group])


def mark_forward_each(arrays):
    """While a trace records: ``FORWARD_MARK`` on the context of each of ``arrays()`` (a function returning a
    forward's inputs, called only then) once it is written: that context's work from it to its next mark is a
    forward (a pipeline's schedule interleaves forwards and backwards on a lane). Nothing otherwise."""
    _check_lazy(arrays, "arrays")
    if _state["recording"]:
        from .engine import mark
        for array in arrays():
            mark(FORWARD_MARK, array.context, reads=[array])


def mark_backward_each(arrays, writes=False):
    """While a trace records: ``BACKWARD_MARK`` on the context of each of ``arrays`` (the losses, or a recomputed
    block's outputs) once that array is computed: each context's backward pass follows its own mark (a context may
    start its backward before another has computed its loss). ``writes``: the mark writes each array (the gradients
    a chunk's backward starts from), so that no operator reading it runs before the mark. Nothing otherwise."""
    if _state["recording"]:
        from .engine import mark
        for array in arrays:
            mark(BACKWARD_MARK, array.context, **({"writes": [array]} if writes else {"reads": [array]}))


def backward_heads(heads):
    """While a trace records: the gradients to start the backward pass of ``heads`` (losses) from, ones (autograd's
    own), each written by a ``BACKWARD_MARK`` on its context once its head is computed. Every operator of the backward
    pass descends from them, so each runs after its context's mark; a mark that only waited for the loss could run
    after the backward's first operators (they read the forward's values, not the loss: MXNet releases both when the
    forward ends, in an order of its own), and the trace would name those forward. None otherwise: autograd makes
    the ones."""
    if not _state["recording"]:
        return None
    import mxnet as mx
    from .engine import mark
    grads = [mx.nd.ones(head.shape, ctx=head.context, dtype=head.dtype) for head in heads]
    for head, grad in zip(heads, grads):
        mark(BACKWARD_MARK, head.context, reads=[head], writes=[grad])
    return grads


def mark_recompute(buffers):
    """While a trace records: ``RECOMPUTE_MARK`` on the context of each of ``buffers()`` (a function returning the
    gathered parameters of a block about to be recomputed, called only then) once they are written: the recomputed
    forward, which reads them, follows it, up to the ``mark_backward_each`` of its outputs. Nothing otherwise."""
    _check_lazy(buffers, "buffers")
    if _state["recording"]:
        from .engine import mark
        for buffer in buffers():
            mark(RECOMPUTE_MARK, buffer.context, reads=[buffer])


def _events(text):
    """The events of MXNet's profiler file: the dumps appended to it, each framed by a head and a tail or not."""
    pieces = (piece.strip().strip(",").strip() for piece in _FRAME.split(text))
    return json.loads("[" + ",".join(piece for piece in pieces if piece) + "]")


def _lane_names(raw, fresh, worker, contexts):
    """``{slot: lane name}``: the slot (``pid``) of each of ``contexts``, or of each context that ran operators in
    ``fresh``, named ``cpu(0)``, ``gpu(1)`` (``worker R cpu(0)`` in a job)."""
    slots = _state["slots"]
    for event in raw:   # MXNet's labels, in the first dump of the process only
        if event.get("ph") == "M" and event.get("name") == "process_name" and event.get("pid", 1 << 32) < 1 << 16:
            slots[event["pid"]] = event["args"]["name"]
    labels = list(slots.values())
    cpus = sum(label.startswith("cpu/") for label in labels) if labels else _processors()
    gpus = sum(label.startswith("gpu/") for label in labels) if labels else _gpu_slots()
    if contexts is not None:
        pids = [c.device_id if c.device_type == "cpu" else cpus + c.device_id for c in contexts]
    else:
        pids = sorted(pid for pid in {e.get("pid") for e in fresh if e.get("ph") in ("B", "E")}
                      if isinstance(pid, int) and pid < cpus + gpus)   # not pinned or shared memory
    names = {pid: f"cpu({pid})" if pid < cpus else f"gpu({pid - cpus})" for pid in pids}
    return {pid: name if worker is None else f"rank {worker} {name}" for pid, name in names.items()}


#: Operators autograd may issue itself without a ``_backward`` name (gradient sums of an array used twice, zero
#: gradients, the gradients of transpose and copy): inside an issue's bracket while the lane's backward pass still
#: runs, such an operator may be either's, so the trace names it by itself.
_AUTOGRAD_OPS = ("add_n", "ElementWiseSum", "_grad_add", "elemwise_add", "zeros_like", "_zeros", "transpose",
                 "SwapAxis", "_copy")


def _starts(op, names):
    return op.split(",")[0].startswith(names)


def _backward_ahead(spans):
    """For each span (sorted by start), whether a backward operator follows on its lane before the next update."""
    ahead, pending = [False] * len(spans), {}
    for i in reversed(range(len(spans))):
        pid, op = spans[i][2], spans[i][3]
        ahead[i] = pending.get(pid, False)
        if "_backward" in op:
            pending[pid] = True
        elif _starts(op, _UPDATES):
            pending[pid] = False
    return ahead


def _issue(op):
    """``(number, kind, label, details)`` of an ``issued`` mark's name, or None for another name."""
    prefix = BEGIN_MARK if op.startswith(BEGIN_MARK) else END_MARK if op.startswith(END_MARK) else None
    if prefix is None:
        return None
    number = int(op[len(prefix):])
    return (number, *_state.get("issued", {}).get(number, ("other", "other", {}, None))[:3])


def _innermost(numbers):
    """Of issues ``numbers`` (open together on a lane), those no other of them was issued inside of: an operator
    two nested issues may both have run is the inner one's (ZeRO-3's gather inside a forward)."""
    issued, outer = _state.get("issued", {}), set()
    for number in numbers:
        parent = issued.get(number, (None,) * 4)[3]
        while parent is not None:
            outer.add(parent)
            parent = issued.get(parent, (None,) * 4)[3]
    return [number for number in numbers if number not in outer]


def _named_bulks(spans):
    """``spans`` (sorted by start) with each lane's ``ImperativeBulk`` named by the last region mark before it on
    that lane since its last update: after ``BACKWARD_MARK`` as backward (``ImperativeBulk:_backward``), after a
    forward or recompute mark or ZeRO-3's first collective kept as it is (the timeline names it by the lane's
    region), and without one left out, like the other bulks; the marks kept."""
    last, kept = {}, []
    for begin, end, pid, op in spans:
        if op.startswith("parallel:"):
            issue = _issue(op)
            if issue is None:
                last[pid] = op
            elif issue[1] in ("gather", "reduce-scatter") and last.get(pid) is None:
                last[pid] = FORWARD_MARK
            kept.append((begin, end, pid, op))
        elif op == _BULK:
            if last.get(pid) == BACKWARD_MARK:
                kept.append((begin, end, pid, f"{_BULK}:_backward"))
            elif last.get(pid) is not None:
                kept.append((begin, end, pid, op))
        else:
            if _starts(op, _UPDATES):
                last.pop(pid, None)
            kept.append((begin, end, pid, op))
    return kept


class _Lane:
    """What a lane has run since its last update: its region (None before the step's marks; forward, recompute or
    backward after them) and the issues whose brackets are open on it."""

    def __init__(self):
        self.region, self.open = None, {}

    def follow(self, op, at):
        """Follow the mark ``op`` that ended at ``at``; returns the bracket it closes, if any."""
        issue = _issue(op)
        if issue is None:
            self.region = {BACKWARD_MARK: "backward", RECOMPUTE_MARK: "recompute",
                           FORWARD_MARK: "forward"}.get(op, self.region)
            return None
        number, kind = issue[0], issue[1]
        if op.startswith(BEGIN_MARK):
            if kind in ("gather", "reduce-scatter") and self.region is None:
                self.region = "forward"   # ZeRO-3's step starts with a gather
            self.open[number] = (*issue[1:], at)
            return None
        return self.open.pop(number, None)

    def phase(self, op, backward_ahead):
        """The phase of ``op`` on this lane (None: nothing marked it) and the issue it belongs to, if one."""
        if "_backward" in op:   # a bulk of operators is named by all of them: "transpose,_backward_FullyConnected"
            return "backward", None
        claims = {number: entry for number, entry in self.open.items() if _starts(op, ISSUED_OPS.get(entry[0], ()))}
        claims = {number: claims[number] for number in _innermost(list(claims))}
        kinds = {entry[0] for entry in claims.values()}
        if len(kinds) == 1 and not (backward_ahead and _starts(op, _AUTOGRAD_OPS)):
            return kinds.pop(), (sorted(claims) if len(claims) > 1 else next(iter(claims)))
        if _starts(op, _UPDATES):
            return "update", None
        if kinds:
            return None, None   # two issues' brackets, or maybe autograd's own: either may have issued it
        if op == _BULK or self.region in ("forward", "recompute"):
            return self.region, None
        if self.region is None and not _starts(op, TRANSFER_OPS):   # the step's forward, before its backward mark
            return "forward", None
        return None, None


def _timeline(raw, fresh, worker, path, contexts):
    names = _lane_names(raw, fresh, worker, contexts)
    pids = list(names)
    opened, spans = {}, []
    for event in sorted(fresh, key=lambda e: e.get("ts", 0)):
        if event.get("pid") not in names or event.get("ph") not in ("B", "E"):
            continue
        key = (event["pid"], event.get("tid"), event["name"])
        if event["ph"] == "B":
            opened[key] = event["ts"]
        elif key in opened:
            spans.append((opened.pop(key), event["ts"], event["pid"], event["name"]))
    spans = _named_bulks(sorted(s for s in spans if s[3] not in _BOOKKEEPING))
    start = min((s[0] for s in spans if not s[3].startswith("parallel:")), default=0)
    events, issues, lanes = [], [], {pid: _Lane() for pid in pids}
    for (begin, end, pid, op), ahead in zip(spans, _backward_ahead(spans)):
        lane = lanes[pid]
        if op.startswith("parallel:"):   # a mark: what follows on its lane, not an operator
            closed = lane.follow(op, end)
            if closed is not None:
                kind, label, details, opened_at = closed
                issues.append({"name": label, "cat": kind, "ph": "X", "ts": max(opened_at - start, 0),
                               "dur": max(begin - opened_at, 0), "pid": pids.index(pid), "tid": 1,
                               "args": {**details, "context": names[pid].rsplit(" ", 1)[-1],
                                        "issue": int(op[len(END_MARK):])}})
            continue
        phase, issue = lane.phase(op, ahead)
        if phase == "update":   # the next step starts; brackets still open stay open
            lanes[pid], lanes[pid].open = _Lane(), lane.open
        args = {"op": op} if issue is None else {"op": op, "issue": issue}
        events.append({"name": phase or op.split(",")[0], "cat": phase or "other", "ph": "X", "ts": begin - start,
                       "dur": max(end - begin, 0), "pid": pids.index(pid), "tid": 0, "args": args})
    metadata = [{"name": "process_name", "ph": "M", "pid": i, "args": {"name": names[pid]}}
                for i, pid in enumerate(pids)]
    metadata += [{"name": "thread_name", "ph": "M", "pid": i, "tid": tid, "args": {"name": name}}
                 for i in range(len(pids)) for tid, name in ((0, "operators"), (1, "issued"))]
    return Trace(metadata + events + issues, [names[pid] for pid in pids], path)


def worker_path(path, job, rank=None):
    """Where the worker of ``rank`` (default ``job.rank``) of a job of several workers writes the trace ``path``:
    ``.rankR`` inserted before the extension (``step.json`` -> ``step.rank1.json``), as the launcher labels its
    lines ``[rank R]``; ``path`` itself with no job or one worker."""
    path = os.fspath(path)
    if job is None or job.num_workers == 1:
        return path
    stem, ext = os.path.splitext(path)
    return f"{stem}.rank{job.rank if rank is None else rank}{ext}"


def read_trace(path):
    """A ``Trace`` from a file ``trace`` wrote."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    lanes = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    return Trace(events, [lanes[i] for i in sorted(lanes)], os.fspath(path))


def reduction_order(timeline, lane=0):
    """The order in which each traced step's gradient sums landed on ``lane`` (its number in ``timeline.lanes``):
    a list a step of its buckets' numbers, sorted by when each bucket's ``allreduce`` (or ``reduce-scatter``)
    bracket ended. The Reducer queues a step's buckets last layers' first (bucket 0, then 1, ...), so a list in
    increasing order is the sums landing in the order they were sent (first in, first out: ps-lite's zmq
    transport); under MXNet's P3 (``python -m parallel.launch --van p3``, or ``auto`` on a slow link) the first
    layers' bucket, the highest number, was sent with the highest priority, and on a link that queues it lands
    before buckets queued ahead of it: the next forward's first layers need their sums first.

    >>> t = Trace([{"ph": "X", "pid": 0, "tid": 1, "cat": "allreduce", "ts": ts, "dur": dur,
    ...             "args": {"bucket": b, "issue": i}} for i, (b, ts, dur) in enumerate(
    ...           [(0, 0, 5), (1, 1, 9), (2, 2, 2), (0, 20, 5), (1, 21, 6), (2, 22, 7)])], ["cpu(0)"], None)
    >>> reduction_order(t)
    [[2, 0, 1], [0, 1, 2]]
    """
    return [[b["args"]["bucket"] for b in sorted(step, key=lambda b: (b["ts"] + b["dur"], b["args"]["issue"]))]
            for step in traced_sums(timeline, lane)]


def traced_sums(timeline, lane=0):
    """Each traced step's gradient sums on ``lane`` of a ``Trace``: a list a step of its buckets' ``allreduce`` (or
    ``reduce-scatter``) bracket events, in the order they were issued; a bucket's number that comes again starts the
    next step (``reduction_order`` sorts each by when it ended)."""
    brackets = sorted((e for e in timeline.events if e.get("ph") == "X" and e.get("pid") == lane
                       and e.get("tid") == 1 and e.get("cat") in ("allreduce", "reduce-scatter")),
                      key=lambda e: e["args"]["issue"])
    steps = []
    for bracket in brackets:   # a bucket's number comes again: the next step
        if not steps or any(b["args"]["bucket"] == bracket["args"]["bucket"] for b in steps[-1]):
            steps.append([])
        steps[-1].append(bracket)
    return steps


_COLORS = {"load": "#9e9e9e", "forward": "#1f77b4", "backward": "#ff7f0e", "allreduce": "#2ca02c",
           "update": "#d62728", "gather": "#9467bd", "recompute": "#17becf", "reduce-scatter": "#8c564b",
           "send": "#e377c2", "tensor": "#bcbd22", "metrics": "#7f7f7f", "other": "#dddddd"}


def plot_timeline(timeline, path=None, title=None):
    """Draw a ``Trace`` (or the path of one) as a Gantt chart: a row per lane, a bar per event colored by its
    phase; write it to ``path`` (atomically, the format from its extension) if given. Returns the figure, a
    ``matplotlib.figure.Figure`` built without pyplot, so it never changes the plotting backend (a notebook shows
    it as a cell's value)."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch
    if not isinstance(timeline, Trace):
        timeline = read_trace(timeline)
    spans = [e for e in timeline.events if e.get("ph") == "X" and e.get("tid", 0) == 0]   # the operators
    fig = Figure(figsize=(10, 1.6 + 0.6 * max(1, len(timeline.lanes))))
    ax = fig.add_subplot()
    for phase in PHASES:
        for lane in range(len(timeline.lanes)):
            bars = [(e["ts"] / 1000, max(e["dur"], 1) / 1000) for e in spans
                    if e.get("cat", e["name"]) == phase and e["pid"] == lane]
            if bars:
                ax.broken_barh(bars, (lane - 0.35, 0.7), color=_COLORS[phase])
    ax.set_yticks(range(len(timeline.lanes)))
    ax.set_yticklabels(timeline.lanes)
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_title(title or "what each context ran")
    shown = [p for p in PHASES if p in {e.get("cat", e["name"]) for e in spans}] or list(PHASES[:5])
    fig.legend(handles=[Patch(color=_COLORS[p], label=p) for p in shown], loc="lower center", ncol=min(len(shown), 7),
               fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    if path is not None:
        fmt = os.path.splitext(os.fspath(path))[1].lstrip(".") or "png"
        with atomic_write(path, "wb") as f:
            fig.savefig(f, format=fmt, dpi=100)
    return fig
