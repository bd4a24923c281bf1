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

from ..validate import BadValue, check_float32, check_int

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

    def bounds(self, base_lr):
        """The rates that bound every rate this schedule gives from ``base_lr``: the largest and the smallest
        but 0, each as ``(rate, argument, what)``, ``what`` saying which rate it is as a template of argument
        names (``parallel.validate``) and ``argument`` the one to blame when it is out of range."""
        rates = [(base_lr, "lr", "{lr}")]
        if self.warmup_steps > 1:
            rates.append((base_lr * 1 / self.warmup_steps, "lr",
                          f"{{lr}} / {self.warmup_steps} (the first warm-up step's rate)"))
        return rates

    def check_rates(self, base_lr, scales=((1.0, ""),)):
        """Raise ``BadValue`` unless every rate of every step, times each ``(scale, words)`` of ``scales`` (what
        an optimizer multiplies it by, such as Adam's bias correction at its lowest and highest), is a float that
        MXNet's update operators take (``check_float32``): no decay, warm-up or cosine may take it out of
        float32's normal range, where the update would fail at that step."""
        for rate, name, what in self.bounds(base_lr):
            for scale, words in scales:
                check_float32(rate * scale, name, positive=True, what=what + words)

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
            raise BadValue("milestones", f"{{milestones}} must be strictly increasing, got {self.milestones}")
        self.factor = check_float32(factor, "factor", positive=True)
        if self.factor > 1:
            raise BadValue("factor", f"{{factor}} must be in (0, 1], got {factor!r}")

    def after_warmup(self, t, base_lr):
        lr = base_lr
        for milestone in self.milestones:   # the same products, in the same order, as MultiFactorScheduler
            if t > milestone:
                lr *= self.factor
        return lr

    def bounds(self, base_lr):
        decays = len(self.milestones)
        if not decays:
            return super().bounds(base_lr)
        return super().bounds(base_lr) + [(self.after_warmup(self.milestones[-1] + 1, base_lr), "factor",
                                           f"{{lr}} * {{factor}}**{decays} (the rate after the last decay)")]

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
        self.final_lr = check_float32(final_lr, "final_lr")
        if self.final_lr < 0:
            raise BadValue("final_lr", f"{{final_lr}} must be >= 0, got {final_lr!r}")

    def after_warmup(self, t, base_lr):
        if t > self.total_steps:
            return self.final_lr
        # (1 + cos(pi p)) / 2 as sin(pi (1 - p) / 2)^2, 1 - p from the steps left (an exact integer): the same
        # rate, without the cancellation that rounds a long cosine's last steps to final_lr exactly
        left = (self.total_steps - t) / (self.total_steps - self.warmup_steps)
        return self.final_lr + (base_lr - self.final_lr) * math.sin(math.pi / 2 * left) ** 2

    def bounds(self, base_lr):
        rates = super().bounds(base_lr)
        if self.total_steps - 1 >= max(1, self.warmup_steps):   # the cosine's smallest rate above final_lr
            rates.append((self.after_warmup(self.total_steps - 1, base_lr), "lr",
                          f"the cosine's rate at step {self.total_steps - 1}"))
        if self.final_lr:
            rates.append((self.final_lr, "final_lr", "{final_lr}"))
        return rates

    def config(self):
        return {**super().config(), "total_steps": self.total_steps, "final_lr": self.final_lr}

    def describe(self):
        warmup = f", {self.warmup_steps} warm-up steps" if self.warmup_steps else ""
        return f"cosine over {self.total_steps} steps{warmup}"
