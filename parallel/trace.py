"""A timeline of training steps: what each context (and worker) ran, when, named as the package names it.

``with trace("step.json"):`` records what MXNet's engine runs inside the block with MXNet's profiler and writes a
Chrome trace (open it in ``chrome://tracing`` or https://ui.perfetto.dev): one lane (a "process") per context,
prefixed with the worker in a job, each operator an event named by its phase:

- ``load``: copies onto the context before its forward (its shard of the batch);
- ``forward``: the operators of the forward pass and the loss;
- ``backward``: MXNet's ``_backward_*`` operators, and the anonymous bulks (``ImperativeBulk``) in which it runs an
  imperative backward pass (the model and pipeline strategies' LeNet stages): those after the step's mark
  (``mark_backward``, which ``parallel.step`` queues on every context before ``backward()``);
- ``allreduce``: copies between contexts and the sums after the backward (``add_n``, and a compressor's work);
- ``update``: the optimizer's operators (``sgd_update``, ``sgd_mom_update``, ``adam_update``, ...);
- ZeRO-3's steps (``parallel.strategies.sharded``) add ``gather`` (the copies of an all-gather of a block's
  parameters), ``reduce-scatter`` (the copies and sums of a block's gradient into the owners' chunks) and
  ``recompute`` (a block's forward run again in backward). The strategy brackets each collective on every context
  with marks (``collective``): empty operations that write the arrays its collectives read or write there, so
  a collective's operations on that context run between its two marks, and the context's collectives one after
  another (while a trace records, a prefetched gather in backward therefore waits for the backward of the block
  before it); and it marks each recomputation (``mark_recompute``).

The operator itself is in each event's ``args.op``. ``plot_timeline(trace)`` draws the same as a Gantt chart.

MXNet's profiler is one per process: ``trace`` configures it once, to a file of its own in the system's temporary
directory, to which each ``trace`` appends its events; one ``trace`` runs at a time. The profiler files each event
under a numbered slot: ``cpu(i)`` under slot i, one slot for each processor it counts (``omp_get_num_procs``),
then ``gpu(i)`` (32 slots in a CUDA build, none otherwise), then pinned and shared CPU memory. So it can record
only CPU contexts numbered below the processor count: ``cpu(N)`` and ``cpu(N+1)`` on N processors land in the
memory slots, and ``cpu(N+2)`` aborts the process (MXNet checks the slot in its engine). ``trace(contexts=...)``
and ``--trace`` refuse those contexts up front (``check_traceable``). The slots' labels are written only by the
first dump of a process, into whatever file the profiler was configured with then, so lanes are named from the
slot numbers, not from the labels.
"""
import contextlib
import json
import os
import re
import tempfile
import threading
from collections import namedtuple

from .files import atomic_write

__all__ = ["trace", "Trace", "PHASES", "BACKWARD_MARK", "mark_backward", "mark_backward_each", "mark_forward_each",
           "collective",
           "mark_recompute",
           "check_traceable", "plot_timeline", "read_trace", "worker_path"]

#: The phases of a step, the first five in the order they happen on every context; ZeRO-3's steps add the last three.
PHASES = ("load", "forward", "backward", "allreduce", "update", "gather", "recompute", "reduce-scatter")

_UPDATES = ("sgd_update", "sgd_mom_update", "nag_mom_update", "adam_update", "_contrib_adamw_update", "adamw_update",
            "multi_", "mp_sgd", "lamb_update", "_mul_scalar_update")
#: Operators of a codec or of clipping that a backward pass of LeNet or ResNet-18 does not run itself.
_REDUCTION_OPS = ("Cast", "topk", "take", "scatter_nd", "elemwise_sub", "broadcast_div", "norm", "clip", "broadcast_mul",
                  "slice_axis", "_slice_assign", "concat", "floor", "FullyConnected", "_equal_scalar")
_BOOKKEEPING = ("DeleteVariable", "SetValueOp", "WaitForVar")
#: What MXNet's profiler calls a bulk of imperative operators (of the backward pass, or other small ones).
_BULK = "ImperativeBulk"
#: The empty operation ``mark_backward`` queues on a context: its backward pass comes after it.
BACKWARD_MARK = "parallel:backward"
#: The marks of ZeRO-3's collectives (``collective``): a gather's or a reduce-scatter's operations on a context run
#: between its mark and the next ``END_MARK`` there.
GATHER_MARK, REDUCE_SCATTER_MARK, END_MARK = "parallel:gather", "parallel:reduce-scatter", "parallel:end"
#: Before a recomputed forward (``mark_recompute``): a lane's operators from it to the next ``BACKWARD_MARK``.
RECOMPUTE_MARK = "parallel:recompute"
#: Before a forward that may follow a backward on its lane (a pipeline's 1F1B: ``mark_forward_each``).
FORWARD_MARK = "parallel:forward"
#: What a collective runs: copies between contexts, sums, zero fills, the kvstore's transfers.
_TRANSFERS = ("Copy", "add_n", "_copyto", "elemwise_add", "_slice_assign", "_set_value", "KVStore")
#: The head and the tail MXNet writes around a dump's events (a later dump may lack the head: see the module's notes).
_FRAME = re.compile(r"\{\s*\"traceEvents\"\s*:\s*\[|\]\s*,\s*\"displayTimeUnit\"\s*:\s*\"ms\"\s*\}")

Trace = namedtuple("Trace", ["events", "lanes", "path"])
Trace.__doc__ = """A recorded timeline.

events : list of dict
    Chrome trace events (``ph`` "X": ``name`` the phase, ``ts`` and ``dur`` in microseconds from the first event,
    ``pid`` the lane, ``args.op`` MXNet's operator).
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
        handle, path = tempfile.mkstemp(prefix="parallel-profile-", suffix=".json")
        os.close(handle)
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


def mark_backward(losses, groups):
    """While a trace records: queue ``BACKWARD_MARK`` on every context of ``groups`` (``optimizer_step``'s groups
    of replicas) once ``losses`` are computed, so that the trace names the bulks of an imperative backward pass
    (``ImperativeBulk``) that follow it as backward. Nothing otherwise."""
    if _state["recording"]:
        from .engine import mark
        for ctx in {param.context for group in groups for replica in group for param in replica}:
            mark(BACKWARD_MARK, ctx, losses)


@contextlib.contextmanager
def collective(kind, arrays):
    """While a trace records: bracket the operations queued inside the ``with`` block on each context with a
    ``kind`` mark (``"gather"`` or ``"reduce-scatter"``) before and ``END_MARK`` after, on the context of each list
    of ``arrays`` (a list per context: the arrays the collective reads or writes there). Each mark writes that
    list, so the collective's operations on those arrays run between the two marks, and whatever was queued on them
    before runs first. Nothing otherwise: no mark, no order beyond MXNet's own."""
    if not _state["recording"]:
        yield
        return
    from .engine import mark
    name = {"gather": GATHER_MARK, "reduce-scatter": REDUCE_SCATTER_MARK}[kind]
    arrays = [list(group) for group in arrays if group]
    for group in arrays:
        mark(name, group[0].context, writes=group)
    yield
    for group in arrays:
        mark(END_MARK, group[0].context, writes=group)


def mark_forward_each(arrays):
    """While a trace records: ``FORWARD_MARK`` on the context of each of ``arrays`` (a forward's inputs) once it is
    written: that context's work from it to its next mark is a forward (a pipeline's schedule interleaves forwards
    and backwards on a lane). Nothing otherwise."""
    if _state["recording"]:
        from .engine import mark
        for array in arrays:
            mark(FORWARD_MARK, array.context, reads=[array])


def mark_backward_each(arrays):
    """While a trace records: ``BACKWARD_MARK`` on the context of each of ``arrays`` (the losses, or a recomputed
    block's outputs) once that array is computed: each context's backward pass follows its own mark (a context may
    start its backward before another has computed its loss). Nothing otherwise."""
    if _state["recording"]:
        from .engine import mark
        for array in arrays:
            mark(BACKWARD_MARK, array.context, reads=[array])


def mark_recompute(buffers):
    """While a trace records: ``RECOMPUTE_MARK`` on the context of each of ``buffers`` (the gathered parameters of a
    block about to be recomputed) once they are written: the recomputed forward, which reads them, follows it, up to
    the ``mark_backward`` of its outputs. Nothing otherwise."""
    if _state["recording"]:
        from .engine import mark
        for buffer in buffers:
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
    return {pid: name if worker is None else f"worker {worker} {name}" for pid, name in names.items()}


def _phase(op, seen, backward_ahead):
    """The phase of ``op`` on a lane, from what that lane ran since its last update (``seen``: forward, backward,
    allreduce) and whether a backward operator follows before its next update (``backward_ahead``: buckets are
    summed while the backward pass still runs, so backward and allreduce events interleave)."""
    seen_forward, seen_backward, seen_allreduce = seen
    if "_backward" in op:   # a bulk of operators is named by all of them: "transpose,_backward_FullyConnected"
        return "backward"
    if any(op.startswith(u) for u in _UPDATES):
        return "update"
    if op.startswith("Copy") or op.startswith("add_n") or op in ("_copyto", "elemwise_add", "broadcast_add"):
        return "allreduce" if seen_backward else ("load" if not seen_forward else "forward")
    if not seen_backward:
        return "forward"
    if not seen_allreduce or (backward_ahead and op.split(",")[0] not in _REDUCTION_OPS):
        return "backward"   # the backward pass's own helpers (transpose, sum) between its _backward operators
    return "allreduce"      # a codec's or clipping's operators, between the sum and the update


def _backward_ahead(spans):
    """For each span (sorted by start), whether a backward operator follows on its lane before the next update."""
    ahead, pending = [False] * len(spans), {}
    for i in reversed(range(len(spans))):
        pid, op = spans[i][2], spans[i][3]
        ahead[i] = pending.get(pid, False)
        if "_backward" in op:
            pending[pid] = True
        elif any(op.startswith(u) for u in _UPDATES):
            pending[pid] = False
    return ahead


def _named_bulks(spans):
    """``spans`` (sorted by start) with each lane's ``ImperativeBulk`` named by the last mark before it on that lane
    since its last update: after ``BACKWARD_MARK`` as backward (``ImperativeBulk:_backward``), after one of ZeRO-3's
    marks kept as it is (the timeline names it by the lane's phase), and without a mark left out, like the other
    bulks; the marks kept."""
    last, kept = {}, []
    for begin, end, pid, op in spans:
        if op.startswith("parallel:"):
            last[pid] = op
            kept.append((begin, end, pid, op))   # the marks stay for the timeline's ZeRO-3 phases
        elif op == _BULK:
            if last.get(pid) == BACKWARD_MARK:
                kept.append((begin, end, pid, f"{_BULK}:_backward"))
            elif last.get(pid) is not None:
                kept.append((begin, end, pid, op))
        else:
            if any(op.startswith(u) for u in _UPDATES):
                last.pop(pid, None)
            kept.append((begin, end, pid, op))
    return kept


def _follow_mark(op, lane):
    """A lane's state under ZeRO-3's and a pipeline's marks (``[collective or None, region or None]``: the region
    forward, recompute or backward, None on a lane without such marks) after the mark ``op``."""
    if op in (GATHER_MARK, REDUCE_SCATTER_MARK):
        lane[0], lane[1] = op.split(":", 1)[1], lane[1] or "forward"
    elif op == END_MARK:
        lane[0] = None
    elif op == RECOMPUTE_MARK:
        lane[1] = "recompute"
    elif op == FORWARD_MARK:
        lane[1] = "forward"
    elif op == BACKWARD_MARK and lane[1] is not None:
        lane[1] = "backward"


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
    events, state = [], {pid: [False, False, False] for pid in pids}
    sharded = {pid: [None, None] for pid in pids}   # ZeRO-3's marks: the collective under way, the region
    for (begin, end, pid, op), ahead in zip(spans, _backward_ahead(spans)):
        if op.startswith("parallel:"):   # a mark: what follows on its lane, not an event
            _follow_mark(op, sharded[pid])
            continue
        collective, region = sharded[pid]
        phase = _phase(op, state[pid], ahead)
        if collective is not None and op.startswith(_TRANSFERS):
            phase = collective
        elif op == _BULK:   # kept on a lane with ZeRO-3's marks only
            phase = region
        elif region == "recompute" and phase in ("forward", "backward", "allreduce") and "_backward" not in op:
            phase = "recompute"
        elif region is not None and phase == "allreduce":   # ZeRO-3 sums nothing outside its collectives
            phase = region
        if phase in ("forward", "backward", "allreduce"):
            state[pid][("forward", "backward", "allreduce").index(phase)] = True
        elif phase == "update":
            state[pid] = [False, False, False]   # the next step starts
            sharded[pid] = [None, None]
        events.append({"name": phase, "cat": phase, "ph": "X", "ts": begin - start, "dur": max(end - begin, 0),
                       "pid": pids.index(pid), "tid": 0, "args": {"op": op}})
    metadata = [{"name": "process_name", "ph": "M", "pid": i, "args": {"name": names[pid]}}
                for i, pid in enumerate(pids)]
    return Trace(metadata + events, [names[pid] for pid in pids], path)


def worker_path(path, job, rank=None):
    """Where worker ``rank`` (default ``job.rank``) of a job of several workers writes the trace ``path``:
    ``.workerR`` inserted before the extension (``step.json`` -> ``step.worker1.json``); ``path`` itself with no
    job or one worker."""
    path = os.fspath(path)
    if job is None or job.num_workers == 1:
        return path
    stem, ext = os.path.splitext(path)
    return f"{stem}.worker{job.rank if rank is None else rank}{ext}"


def read_trace(path):
    """A ``Trace`` from a file ``trace`` wrote."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    lanes = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M"}
    return Trace(events, [lanes[i] for i in sorted(lanes)], os.fspath(path))


_COLORS = {"load": "#9e9e9e", "forward": "#1f77b4", "backward": "#ff7f0e", "allreduce": "#2ca02c",
           "update": "#d62728", "gather": "#9467bd", "recompute": "#17becf", "reduce-scatter": "#8c564b"}


def plot_timeline(timeline, path=None, title=None):
    """Draw a ``Trace`` (or the path of one) as a Gantt chart: a row per lane, a bar per event colored by its
    phase; write it to ``path`` (atomically, the format from its extension) if given. Returns the figure, a
    ``matplotlib.figure.Figure`` built without pyplot, so it never changes the plotting backend (a notebook shows
    it as a cell's value)."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch
    if not isinstance(timeline, Trace):
        timeline = read_trace(timeline)
    spans = [e for e in timeline.events if e.get("ph") == "X"]
    fig = Figure(figsize=(10, 1.6 + 0.6 * max(1, len(timeline.lanes))))
    ax = fig.add_subplot()
    for phase in PHASES:
        for lane in range(len(timeline.lanes)):
            bars = [(e["ts"] / 1000, max(e["dur"], 1) / 1000) for e in spans if e["name"] == phase and e["pid"] == lane]
            if bars:
                ax.broken_barh(bars, (lane - 0.35, 0.7), color=_COLORS[phase])
    ax.set_yticks(range(len(timeline.lanes)))
    ax.set_yticklabels(timeline.lanes)
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_title(title or "what each context ran")
    shown = [p for p in PHASES if p in {e["name"] for e in spans}] or list(PHASES[:5])
    fig.legend(handles=[Patch(color=_COLORS[p], label=p) for p in shown], loc="lower center", ncol=len(shown),
               fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    if path is not None:
        fmt = os.path.splitext(os.fspath(path))[1].lstrip(".") or "png"
        with atomic_write(path, "wb") as f:
            fig.savefig(f, format=fmt, dpi=100)
    return fig
