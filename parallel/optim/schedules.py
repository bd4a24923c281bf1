"""Learning-rate schedules: constant, step and cosine, each with an optional linear warm-up.

A schedule is a pure function of the optimizer step ``t`` (1 for the first update) and the base rate: the rate of
step ``t`` depends on nothing else, so a resumed run recomputes it from its position, and it is counted once per
optimizer step, whatever the number of contexts, workers or accumulated micro-batches. The formulas are
MXNet's (``mx.lr_scheduler``), step for step, so MXNet's own schedulers are the oracle in the tests:

- warm-up, for ``t < warmup_steps``: ``base_lr * t / warmup_steps`` (MXNet's linear mode from 0);
- ``Constant``: ``base_lr``;
- ``Step(milestones, factor)``: ``base_lr * factor ** m``, ``m`` the number of milestones below ``t``
  (``MultiFactorScheduler``);
- ``Cosine(total_steps, final_lr)``: from ``base_lr`` at the end of the warm-up down to ``final_lr`` at step
  ``total_steps`` along half a cosine, then ``final_lr`` (``CosineScheduler``).

>>> schedule = Cosine(total_steps=100, warmup_steps=10)
>>> [round(schedule(t, 0.1), 4) for t in (1, 5, 10, 55, 100, 120)]
[0.01, 0.05, 0.1, 0.05, 0.0, 0.0]
>>> Step([30, 60], factor=0.1)(45, 0.1)
0.010000000000000002
"""
import math

from ..validate import check_int, check_number

__all__ = ["Schedule", "Constant", "Step", "Cosine"]


class Schedule:
    """The learning rate of each optimizer step: ``schedule(t, base_lr)``, with a linear warm-up over the first
    ``warmup_steps`` steps.

    Parameters
    ----------
    warmup_steps : int
        Steps ``1 .. warmup_steps - 1`` ramp up linearly from ``base_lr / warmup_steps``; 0: no warm-up.
    """

    name = None

    def __init__(self, warmup_steps=0):
        self.warmup_steps = check_int(warmup_steps, "warmup_steps", low=0)

    def __call__(self, t, base_lr):
        check_int(t, "t", low=1)
        if t < self.warmup_steps:
            return base_lr * t / self.warmup_steps
        return self.after_warmup(t, base_lr)

    def after_warmup(self, t, base_lr):
        raise NotImplementedError

    def config(self):
        """The schedule as JSON: what a checkpoint compares on resume."""
        return {"name": self.name, "warmup_steps": self.warmup_steps}

    def describe(self):
        warmup = f", {self.warmup_steps} warm-up steps" if self.warmup_steps else ""
        return f"{self.name}{warmup}"

    def __repr__(self):
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.config().items() if k != 'name')})"


class Constant(Schedule):
    """``base_lr`` at every step after the warm-up."""

    name = "constant"

    def after_warmup(self, t, base_lr):
        return base_lr


class Step(Schedule):
    """``base_lr`` multiplied by ``factor`` after each milestone: at step ``t``, ``base_lr * factor ** m`` with
    ``m`` the number of milestones ``< t`` (the first step after a milestone takes the lower rate).

    Parameters
    ----------
    milestones : sequence of int
        Strictly increasing steps, each >= 1.
    factor : float
        In (0, 1].
    warmup_steps : int
    """

    name = "step"

    def __init__(self, milestones, factor=0.1, warmup_steps=0):
        super().__init__(warmup_steps)
        self.milestones = [check_int(m, f"milestones[{i}]", low=1) for i, m in enumerate(milestones)]
        if any(a >= b for a, b in zip(self.milestones, self.milestones[1:])):
            raise ValueError(f"milestones must be strictly increasing, got {self.milestones}")
        self.factor = check_number(factor, "factor", positive=True)
        if self.factor > 1:
            raise ValueError(f"factor must be in (0, 1], got {factor!r}")

    def after_warmup(self, t, base_lr):
        lr = base_lr
        for milestone in self.milestones:   # the same products, in the same order, as MultiFactorScheduler
            if t > milestone:
                lr *= self.factor
        return lr

    def config(self):
        return {**super().config(), "milestones": list(self.milestones), "factor": self.factor}

    def describe(self):
        return f"step (x{self.factor:g} after steps {','.join(map(str, self.milestones))}" + \
            (f", {self.warmup_steps} warm-up steps)" if self.warmup_steps else ")")


class Cosine(Schedule):
    """Half a cosine from ``base_lr`` (at the end of the warm-up) to ``final_lr`` (at step ``total_steps``).

    Parameters
    ----------
    total_steps : int
        The step at which the rate reaches ``final_lr``, > ``warmup_steps``; later steps keep ``final_lr``.
    final_lr : float
        >= 0.
    warmup_steps : int
    """

    name = "cosine"

    def __init__(self, total_steps, final_lr=0.0, warmup_steps=0):
        super().__init__(warmup_steps)
        self.total_steps = check_int(total_steps, "total_steps", low=1)
        if self.total_steps <= self.warmup_steps:
            raise ValueError(f"total_steps ({total_steps}) must exceed warmup_steps ({warmup_steps}): the cosine "
                             "needs steps after the warm-up")
        self.final_lr = check_number(final_lr, "final_lr")
        if self.final_lr < 0:
            raise ValueError(f"final_lr must be >= 0, got {final_lr!r}")

    def after_warmup(self, t, base_lr):
        if t > self.total_steps:
            return self.final_lr
        progress = (t - self.warmup_steps) / (self.total_steps - self.warmup_steps)
        return self.final_lr + (base_lr - self.final_lr) * (1 + math.cos(math.pi * progress)) / 2

    def config(self):
        return {**super().config(), "total_steps": self.total_steps, "final_lr": self.final_lr}

    def describe(self):
        warmup = f", {self.warmup_steps} warm-up steps" if self.warmup_steps else ""
        return f"cosine over {self.total_steps} steps{warmup}"
