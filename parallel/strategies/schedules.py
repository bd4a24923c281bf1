"""Pipeline schedules as the order the package issues a step's work in: GPipe, 1F1B, and interleaved 1F1B.

Each CPU context (each GPU) runs its operators in the order they are issued, so a pipeline's schedule is nothing
but that order. ``pipeline_schedule(name, stages, micro_batches, virtual)`` lays a step out on a clock of *slots*:
in each slot each device runs at most one *op*, the forward (``"F"``) or the backward (``"B"``) of one
micro-batch through one of its model chunks, and a device whose next op is not ready yet (its input still being
computed upstream) idles. Each device takes its ops in its schedule's order:

- ``gpipe`` (GPipe, Huang et al. 2019): every micro-batch's forward, then every backward. A device holds the
  activations of all M micro-batches at once.
- ``1f1b`` (PipeDream-Flush, Narayanan et al. 2021): device ``d`` of P runs ``P - d - 1`` forwards to fill the
  pipeline, then alternates one forward and one backward, then drains: each micro-batch's backward starts as
  soon as it can, so device ``d`` holds at most ``P - d`` micro-batches' activations, whatever M.
- interleaved 1F1B (Megatron-LM's, ``virtual`` V > 1): the model is cut into P x V chunks and device ``d`` holds
  chunks ``d, d + P, d + 2P, ...``; each device cycles through its chunks P micro-batches at a time. The bubble
  shrinks about V times, for V times the point-to-point traffic (M must be a multiple of P).

Both GPipe and 1F1B idle ``(P - 1) / (M + P - 1)`` of the slots (the *bubble*); they differ in the activations
held:

>>> gpipe, one_f_one_b = pipeline_schedule("gpipe", 4, 8), pipeline_schedule("1f1b", 4, 8)
>>> gpipe.bubble == one_f_one_b.bubble == 3 / 11, gpipe.stashed_peak, one_f_one_b.stashed_peak
(True, [8, 8, 8, 8], [4, 3, 2, 1])
>>> print(pipeline_schedule("1f1b", 2, 3).diagram())   # each device: one forward, one backward, in its slots
device 0: F0 F1 .. B0 F2 B1 .. B2
device 1: .. F0 B0 F1 B1 F2 B2 ..

No MXNet here: the strategies run a ``Schedule``'s ``order`` (``parallel.strategies.pipeline``).
"""
from typing import List, NamedTuple

from ..validate import BadValue, check_choice, check_int
from . import PIPELINE_SCHEDULES

__all__ = ["Op", "Schedule", "pipeline_schedule"]


class Op(NamedTuple):
    """One slot's work on one device: the forward ``"F"`` or backward ``"B"`` of micro-batch ``micro`` through model
    chunk ``chunk`` (chunk ``c`` lives on device ``c % devices``)."""
    kind: str
    chunk: int
    micro: int


class Schedule(NamedTuple):
    """A step laid out on slots (see the module's docstring)."""
    #: ``"gpipe"`` or ``"1f1b"``.
    name: str
    devices: int
    micro_batches: int
    virtual: int
    #: ``slots[t][d]``: device ``d``'s op in slot ``t``, or None where it idles.
    slots: List[list]

    @property
    def order(self):
        """Every op in the order the package issues them: slot by slot, device by device."""
        return [(d, op) for ops in self.slots for d, op in enumerate(ops) if op is not None]

    @property
    def bubble(self):
        """The fraction of device-slots idle between the step's first slot and its last."""
        return sum(op is None for ops in self.slots for op in ops) / (len(self.slots) * self.devices)

    @property
    def stashed_peak(self):
        """Per device, the most activations it holds at once (forward run, backward not yet), in micro-batches
        through all of the device's layers: an int without virtual stages; with V chunks a device, each chunk's
        stash is 1/V of a micro-batch's, so a float that may be fractional (2.5: five chunks' activations).

        >>> pipeline_schedule("1f1b", 2, 4, virtual=2).stashed_peak
        [2.5, 1.5]
        """
        held, peak = [0] * self.devices, [0] * self.devices
        for ops in self.slots:
            for d, op in enumerate(ops):
                if op is not None:
                    held[d] += 1 if op.kind == "F" else -1
                    peak[d] = max(peak[d], held[d])
        return [p / self.virtual if self.virtual > 1 else p for p in peak]

    def diagram(self):
        """The schedule as text, a line a device: ``F3`` the forward of micro-batch 3, ``..`` an idle slot (with
        virtual stages, ``F3.1`` through the device's chunk 1)."""
        def cell(op):
            if op is None:
                return ".." if self.virtual == 1 else "...."
            return f"{op.kind}{op.micro}" + (f".{op.chunk // self.devices}" if self.virtual > 1 else "")
        return "\n".join(f"device {d}: " + " ".join(cell(ops[d]) for ops in self.slots)
                         for d in range(self.devices))


def _device_ops(name, p, m, v, d):
    """Device ``d``'s ops in the order it runs them."""
    if v == 1:
        forwards = [Op("F", d, i) for i in range(m)]
        backwards = [Op("B", d, i) for i in range(m)]
        if name == "gpipe":
            return forwards + backwards
        warm = min(p - d - 1, m)
        ops = forwards[:warm]
        for i in range(m - warm):
            ops += [forwards[warm + i], backwards[i]]
        return ops + backwards[m - warm:]
    # interleaved (Megatron-LM): the k-th forward is micro-batch (k // (P V)) P + k % P through chunk (k // P) % V
    def forward(k):
        return Op("F", d + p * ((k // p) % v), (k // (p * v)) * p + k % p)

    def backward(k):
        return Op("B", d + p * (v - 1 - (k // p) % v), (k // (p * v)) * p + k % p)
    total = m * v
    warm = min((p - d - 1) * 2 + (v - 1) * p, total)
    ops = [forward(k) for k in range(warm)]
    for k in range(total - warm):
        ops += [forward(warm + k), backward(k)]
    return ops + [backward(k) for k in range(total - warm, total)]


def pipeline_schedule(name, stages, micro_batches, virtual=1):
    """The schedule ``name`` (``PIPELINE_SCHEDULES``) of one step on ``stages`` devices, ``micro_batches`` micro-batches and
    ``virtual`` chunks a device (1: none; more: interleaved 1F1B), simulated slot by slot: each device runs its
    next op once its input is ready (a forward's from the chunk before, in an earlier slot; a backward's from the
    chunk after and its own forward). Returns a ``Schedule``.

    Raises
    ------
    ValueError
        For an unknown name, virtual stages with GPipe, or micro-batches that are not a multiple of the stages
        when interleaving.
    """
    check_choice(name, "schedule", tuple(PIPELINE_SCHEDULES))
    p, m, v = (check_int(stages, "stages", low=1), check_int(micro_batches, "micro_batches", low=1),
               check_int(virtual, "virtual_stages", low=1))
    if v > 1 and name != "1f1b":
        raise BadValue("virtual_stages", f"{{virtual_stages={v}}} interleaves 1F1B; use {{schedule}} 1f1b")
    if v > 1 and m % p:
        raise BadValue("micro_batches", f"interleaving {{virtual_stages={v}}} takes the micro-batches {p} at a time: "
                                        f"{{micro_batches={m}}} must be a multiple of the {p} stages")
    queues = [_device_ops(name, p, m, v, d) for d in range(p)]
    last = p * v - 1
    done, slots = set(), []
    while any(queues):
        now = []
        for d in range(p):
            op = queues[d][0] if queues[d] else None
            if op is not None:
                if op.kind == "F":   # the chunk before has run this micro-batch's forward
                    needs = [("F", op.chunk - 1, op.micro)] if op.chunk else []
                else:                # its own forward, and the chunk after's backward
                    needs = [("F", op.chunk, op.micro)] + ([("B", op.chunk + 1, op.micro)] if op.chunk < last else [])
                if not all(need in done for need in needs):
                    op = None
            now.append(op)
        if not any(now):
            raise AssertionError(f"schedule {name} deadlocks at slot {len(slots)}")   # a bug here, not input
        for d, op in enumerate(now):
            if op is not None:
                queues[d].pop(0)
        done.update(tuple(op) for op in now if op is not None)
        slots.append(now)
    return Schedule(name, p, m, v, slots)
