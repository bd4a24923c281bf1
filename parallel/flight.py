"""The flight recorder: every collective a worker issues across processes, in a small ring buffer, and what the
launcher makes of the workers' records when they disagree (PyTorch's NCCL flight recorder, Horovod's stall check).

Every worker of a job must make the same collective calls in the same order (``parallel.job.Job.allsum``: each
waits for every worker's push). A worker that takes one step fewer (uneven inputs) or issues another key or size
than its peers waits forever, and ps-lite has no timeouts. So each worker numbers its collectives (``seq``) and
keeps the last ``size`` of them (kind, kvstore key, bytes, training step) in a ``FlightRecorder``; under
``python -m parallel.launch`` (which sets ``PARALLEL_FLIGHT=1``) a thread of the worker publishes it on stderr
whenever it changes, as one line the launcher takes out of the output, with the main thread's Python stack once
the worker has been still for a second. The launcher compares the workers' latest records (``diagnose``) and
ends the job as soon as they prove a divergence, which a healthy job, however slow, never shows:

- a worker finished (its script ended) after collective #n while another issued #m > n: #m waits forever;
- two workers issued collective #n with another kind, key or size: their programs diverged.

Nothing here imports MXNet: the launcher uses ``parse_line`` and ``diagnose``.

>>> a, b = FlightRecorder(rank=0), FlightRecorder(rank=1)
>>> for r in (a, b):
...     r.next_step(); _ = r.record("allreduce", 1000000, 4096)
>>> a.next_step(); _ = a.record("allreduce", 1000000, 4096)
>>> b.finish()
>>> diagnose([a.snapshot(), b.snapshot()])
'rank 0 waits in allreduce #2 (step 2, key 1000000, 4.0 KiB); rank 1 finished after #1 (step 1)'
"""
import collections
import json
import os
import sys
import threading
import time
import traceback

__all__ = ["FlightRecorder", "ENV", "MARKER", "parse_line", "diagnose", "positions", "describe_record",
           "format_records"]

#: The environment variable the launcher sets for its workers: publish the record on stderr.
ENV = "PARALLEL_FLIGHT"
#: What starts a published record's line on a worker's stderr (the launcher takes such lines out of the output).
MARKER = "##parallel-flight## "
#: How many of the last records each published line carries: enough for two workers' records to overlap.
PUBLISHED = 8
#: How often the publishing thread looks for a change, and how long a worker is still before its stack is sent.
INTERVAL = 0.2
STILL = 1.0
#: How many of the main thread's innermost frames a published stack holds.
STACK_FRAMES = 12


class FlightRecorder:
    """The last ``size`` collectives this worker issued, numbered from 1 (``seq``), with the training step.

    Parameters
    ----------
    rank : int
        This worker's rank in the job.
    size : int
        How many records the ring buffer keeps.
    """

    def __init__(self, rank, size=64):
        self.rank, self.records = rank, collections.deque(maxlen=size)
        self.seq = self.step = 0
        self.finished = False
        self._lock = threading.Lock()
        self._publisher = None

    def __repr__(self):
        return f"FlightRecorder(rank {self.rank}, {self.seq} collectives, step {self.step})"

    def next_step(self):
        """A training step begins: later records carry its number (from 1)."""
        self.step += 1

    def record(self, kind, key, nbytes):
        """Note a collective this worker issues (``kind`` such as ``"allreduce"``, its kvstore ``key``, its
        ``nbytes``); returns its sequence number."""
        with self._lock:
            self.seq += 1
            self.records.append({"seq": self.seq, "kind": kind, "key": key, "bytes": int(nbytes), "step": self.step})
            return self.seq

    def finish(self):
        """This worker issues no more collectives (its script ended); published at once when publishing."""
        self.finished = True
        if self._publisher is not None:
            self._publisher.publish(force=True)

    def snapshot(self, last=None, stack=None):
        """The record as a dict (JSON-ready): rank, step, seq, finished, the last ``last`` records (all by default)
        and the main thread's ``stack`` (a list of lines) when given."""
        with self._lock:
            records = list(self.records)[-last:] if last else list(self.records)
            state = {"rank": self.rank, "step": self.step, "seq": self.seq, "finished": self.finished,
                     "records": records}
        if stack is not None:
            state["stack"] = stack
        return state

    def publish_to(self, stream=None):
        """Publish the record on ``stream`` (stderr) from a daemon thread from now on; see the module's docstring."""
        if self._publisher is None:
            self._publisher = _Publisher(self, stream)
        return self

    def published(self):
        """Whether a thread publishes this record."""
        return self._publisher is not None


def publishing():
    """Whether this process was started by ``python -m parallel.launch`` (which sets ``PARALLEL_FLIGHT=1``)."""
    return os.environ.get(ENV) == "1"


class _Publisher:
    """The thread that writes a recorder's snapshot as one marked line whenever it changes, and once more with the
    main thread's stack when nothing changed for ``STILL`` seconds."""

    def __init__(self, recorder, stream):
        self.recorder, self.stream = recorder, stream
        self.main = threading.main_thread()
        self.lock = threading.Lock()
        self.last, self.since, self.stack_sent = None, time.monotonic(), False
        threading.Thread(target=self._run, name="flight recorder", daemon=True).start()

    def _state(self):
        r = self.recorder
        return r.seq, r.step, r.finished

    def _stack(self):
        frame = sys._current_frames().get(self.main.ident)
        if frame is None:
            return []
        frames = [entry for entry in traceback.extract_stack(frame) if entry.filename != __file__]
        entries = traceback.format_list(frames[-STACK_FRAMES:])
        return [line for entry in entries for line in entry.rstrip("\n").split("\n")]

    def publish(self, force=False):
        with self.lock:
            state, now = self._state(), time.monotonic()
            if state != self.last:
                self.last, self.since, self.stack_sent = state, now, False
            elif not force and (self.stack_sent or now - self.since < STILL):
                return
            with_stack = now - self.since >= STILL or self.recorder.finished
            snapshot = self.recorder.snapshot(PUBLISHED, self._stack() if with_stack else None)
            self.stack_sent = self.stack_sent or with_stack
            stream = self.stream if self.stream is not None else sys.stderr
            try:
                stream.write(MARKER + json.dumps(snapshot, separators=(",", ":")) + "\n")
                stream.flush()
            except (OSError, ValueError):   # stderr is gone: nothing to publish to
                pass

    def _run(self):
        while True:
            time.sleep(INTERVAL)
            self.publish()


def parse_line(line):
    """``(text, snapshot)``: the text of ``line`` before a published record (a progress bar without its line end,
    say) and the record it carries (a dict); ``(line, None)`` for a line that carries none.

    >>> parse_line("epoch 1")
    ('epoch 1', None)
    >>> parse_line("45%|####" + MARKER + '{"rank": 1, "records": []}')
    ('45%|####', {'rank': 1, 'records': []})
    """
    at = line.find(MARKER)
    if at < 0:
        return line, None
    try:
        snapshot = json.loads(line[at + len(MARKER):])
    except ValueError:
        return line, None
    if not (isinstance(snapshot, dict) and "rank" in snapshot and "records" in snapshot):
        return line, None
    return line[:at], snapshot


def _size(nbytes):
    for unit in ("B", "KiB", "MiB"):
        if nbytes < 1024 or unit == "MiB":
            return f"{nbytes:g} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024


def describe_record(record):
    """``allreduce #12 (step 6, key 1000000, 4.0 KiB)``."""
    return (f"{record['kind']} #{record['seq']} (step {record['step']}, key {record['key']}, "
            f"{_size(record['bytes'])})")


def format_records(snapshot):
    """A worker's published records, one line each, oldest first."""
    return [describe_record(record) for record in snapshot.get("records", [])]


def _last(snapshot):
    records = snapshot.get("records") or []
    return records[-1] if records else None


def _where(snapshot):
    """What a worker is doing, as the diagnosis says it."""
    last = _last(snapshot)
    if snapshot.get("finished"):
        after = f" after #{last['seq']} (step {last['step']})" if last else " before any collective"
        return f"rank {snapshot['rank']} finished{after}"
    if last is None:
        return f"rank {snapshot['rank']} issued no collective yet"
    return f"rank {snapshot['rank']} waits in {describe_record(last)}"


def positions(snapshots):
    """Where every worker is by its latest record, one clause each: what a stall timeout reports.

    >>> r = FlightRecorder(1); r.next_step(); _ = r.record("allreduce", 1000000, 64)
    >>> positions([r.snapshot()])
    'rank 1 waits in allreduce #1 (step 1, key 1000000, 64 B)'
    """
    return "; ".join(_where(s) for s in sorted(snapshots, key=lambda s: s["rank"]))


def diagnose(snapshots):
    """The line that says how the workers' records (their latest snapshots) prove a divergence, or None.

    Proof is either a worker that finished after collective #n while another issued a later one, or two
    workers' collective #n differing in kind, key or size (compared where their published records overlap).
    Records that only lag (a worker still on its way to a collective its peers issued) prove nothing.
    """
    snapshots = sorted(snapshots, key=lambda s: s["rank"])
    finished = [s for s in snapshots if s.get("finished")]
    for done in finished:
        for other in snapshots:
            if other["seq"] > done["seq"]:
                return f"{_where(other)}; {_where(done)}"
    for i, a in enumerate(snapshots):
        mine = {r["seq"]: r for r in a.get("records", [])}
        for b in snapshots[i + 1:]:
            for r in b.get("records", []):
                m = mine.get(r["seq"])
                if m is not None and (m["kind"], m["key"], m["bytes"]) != (r["kind"], r["key"], r["bytes"]):
                    return (f"rank {a['rank']} issued {describe_record(m)} where rank {b['rank']} issued "
                            f"{describe_record(r)}: the workers' collectives differ")
    return None
