"""Optimizers on flat buffers: SGD (with momentum, Nesterov, weight decay), Adam and AdamW.

An optimizer here is the *rule* of an update and the *state* it keeps, written for the package's flat replicas:
``update(weight, grad, states, lr, rescale, t)`` updates one buffer (a replica's whole flat buffer, or the shard
of it one context owns under ZeRO) with one of MXNet's fused update operators, in place, and its state lives in
flat buffers beside the parameters (``create_state``). Which operator each uses:

==========================  =====================================================================================
``SGD(lr)``                 ``sgd_update``: ``w -= lr * (rescale * g + wd * w)``; no state. The textbook's step.
``SGD(lr, momentum)``       ``sgd_mom_update``: ``m = momentum * m - lr * (rescale * g + wd * w); w += m``.
``SGD(..., nesterov=True)`` ``nag_mom_update`` (MXNet's ``NAG``): ``m = momentum * m + rescale * g + wd * w;
                            w -= lr * (rescale * g + wd * w + momentum * m)``.
``Adam(lr)``                ``adam_update`` with the bias correction folded into the rate, as MXNet's ``Adam``:
                            ``lr_t = lr * sqrt(1 - beta2**t) / (1 - beta1**t)``; ``wd`` is L2 (added to ``g``).
``AdamW(lr)``               ``contrib.adamw_update``: decoupled weight decay (Loshchilov & Hutter),
                            ``w -= lr * (sqrt(1 - beta2**t) / (1 - beta1**t) * m / (sqrt(v) + eps) + wd * w)``.
==========================  =====================================================================================

The ``multi_*`` variants of these operators update a list of tensors in one call; the package never needs them,
since a replica is one flat buffer: one call per replica (per shard under ZeRO) updates the whole model.

The gradient an update is given is the gradient *summed* over the global batch (the allreduce sums);
``rescale = 1 / batch_size`` turns it into the mean, as ``gluon.Trainer.step(batch_size)`` does.

An optimizer also carries the learning-rate ``schedule``, ``clip_norm`` (gradient clipping by global norm) and
``zero`` (how its state is laid out over the contexts: ``parallel.optim.zero``), and counts its steps
(``num_update``): the step ``t`` of Adam's bias correction and of the schedule, once per optimizer step whatever
the number of contexts or workers.

>>> import mxnet as mx
>>> sgd = SGD(lr=0.1, momentum=0.9)
>>> weight, grad = mx.nd.ones(4), mx.nd.full(4, 2.0)
>>> states = sgd.create_state(weight)
>>> sgd.update(weight, grad, states, lr=0.1, rescale=0.5, t=1)    # grad summed over a batch of 2
>>> weight.asnumpy().tolist(), states[0].asnumpy().tolist()
([0.8999999761581421, 0.8999999761581421, 0.8999999761581421, 0.8999999761581421], [-0.10000000149011612, -0.10000000149011612, -0.10000000149011612, -0.10000000149011612])
"""
import inspect
import math

import mxnet as mx

from ..validate import BadType, BadValue, check_choice, check_float32, check_int, check_lr
from . import OPTIMIZERS, ZERO_LEVELS, check_hyper
from .schedules import Constant, Schedule

__all__ = ["Optimizer", "SGD", "Adam", "AdamW", "make_optimizer"]


def _check_fraction(value, name):
    value = check_float32(value, name)
    if not 0 <= value < 1:
        raise BadValue(name, f"{{{name}}} must be in [0, 1), got {value!r}")
    return value


class Optimizer:
    """The base of the optimizers: the hyper-parameters every one has, the step count, the state.

    Parameters
    ----------
    lr : float
        The base learning rate (what ``schedule`` scales), finite, > 0, in float32's normal range.
    wd : float
        Weight decay, >= 0 (L2 for SGD and Adam, decoupled for AdamW).
    schedule : parallel.optim.Schedule, optional
        The rate of each step (``schedule(t, lr)``); default: ``lr`` at every step.
    clip_norm : float, optional
        Clip the gradient by its global norm: when the norm of the mean gradient (the summed gradient divided
        by the global batch size, all parameters together) exceeds ``clip_norm``, scale it down to
        ``clip_norm``. The norm is that of the *summed* gradient, the same on every context and worker.
    zero : int
        0: every context keeps the whole optimizer state (replicated); 1: each context keeps the state of its
        shard of the flat buffer and updates that shard after the allreduce, then the parameters are
        all-gathered; 2: the gradient is reduce-scattered instead of all-reduced, each context updates its
        shard, the parameters are all-gathered (``parallel.optim.zero``).

    Attributes
    ----------
    num_update : int
        Optimizer steps taken so far; the next step is ``num_update + 1``.
    states : dict
        The state of each buffer (or shard of one) this optimizer updated: ``(owner, [state arrays])`` by
        ``(id(owner), region)`` (see ``state_for``; ``parallel.optim.zero`` lays it out).
    record_norm : bool
        Set it to have each step leave ``grad_norm``; False by default (``fit`` sets it for ``logdir``).
    grad_norm : NDArray or None
        With ``record_norm``, the last step's global L2 norm of the mean gradient (the summed gradient divided by
        the global batch size, all parameters together, before clipping: what ``clip_norm`` is compared with), a
        (1,) array on the first gradient's context, queued and not waited for. Clipping computes it anyway;
        without clipping it costs one ``norm`` a gradient array and one ``add_n`` a step (and with ``zero=3`` in
        a job, one gather of a float a shard over the workers).
    """

    #: The optimizer's name in ``OPTIMIZERS``.
    name = None
    #: Whether each step leaves its gradient's norm in ``grad_norm`` (an attribute a run sets: ``fit``).
    record_norm = False
    #: The last step's gradient norm when ``record_norm`` is set (an NDArray), else None.
    grad_norm = None
    #: Default base learning rate (``make_optimizer`` and the CLI use it when none is given).
    default_lr = None

    def __init__(self, lr, wd=0.0, schedule=None, clip_norm=None, zero=0, momentum=0.0, nesterov=False):
        check_lr(lr)
        self.lr = float(lr)
        self.momentum, self.nesterov, self.wd, self.clip_norm = check_hyper(self.name, momentum, nesterov, wd,
                                                                            clip_norm)
        if schedule is not None and not isinstance(schedule, Schedule):
            raise BadType("schedule", f"{{schedule}} must be a parallel.optim.Schedule (Constant, Step, Cosine), got "
                                      f"{schedule!r}")
        self.schedule = schedule
        (schedule or Constant()).check_rates(self.lr, self.rate_scales())   # each step's rate MXNet must take
        self.zero = check_int(zero, "zero")
        if self.zero not in ZERO_LEVELS:
            raise ValueError(f"zero must be one of {', '.join(map(str, ZERO_LEVELS))}, got {zero}")
        self.num_update = 0
        self.states = {}

    def rate_scales(self):
        """``(scale, words)`` pairs bounding what ``update`` multiplies a step's rate by before MXNet's operator
        takes it: 1 here; Adam's bias correction at its lowest and highest."""
        return ((1.0, ""),)

    def state_names(self):
        """The names of the flat state buffers each parameter needs (``()``: stateless)."""
        return ()

    def create_state(self, weight):
        """Fresh state for ``weight`` (a flat buffer or a shard of one): zeros of its shape, dtype and context."""
        return [mx.nd.zeros(weight.shape, ctx=weight.context, dtype=weight.dtype) for _ in self.state_names()]

    def state_for(self, owner, key, like):
        """The state buffers kept under ``key``, created (``create_state(like)``) at the first update: ``owner`` is
        the array whose identity ``key`` holds (a replica's flat buffer, or one array), kept with the state so
        that the identity stays unique while the state lives."""
        entry = self.states.get(key)
        if entry is None:
            entry = self.states[key] = (owner, self.create_state(like))
        return entry[1]

    def region_state(self, data, region):
        """The state buffers of elements ``region`` (``(start, stop)``) of the flat buffer ``data`` (a replica's or a
        shard's), or None before their first update."""
        entry = self.states.get((id(data), region))
        return None if entry is None or entry[0] is not data else entry[1]

    def set_region_state(self, data, region, arrays):
        """Give elements ``region`` of the flat buffer ``data`` the state ``arrays`` (one a state name, each of
        the region's size, on ``data``'s context); replaces what they held."""
        self.states[(id(data), region)] = (data, list(arrays))

    def lr_at(self, t):
        """The learning rate of step ``t`` (1 for the first): ``schedule(t, lr)``, or ``lr``."""
        return self.lr if self.schedule is None else self.schedule(t, self.lr)

    def update(self, weight, grad, states, lr, rescale, t):
        """One update of ``weight`` in place, from the summed gradient ``grad`` (times ``rescale``), with
        ``states`` (``state_for``) at rate ``lr``, as step ``t``. Queued on ``weight``'s context; no wait."""
        raise NotImplementedError

    def hyper(self):
        """The hyper-parameters that define the update (``config`` adds the schedule and clipping)."""
        return {"lr": self.lr, "wd": self.wd}

    def changed(self):
        """The numeric hyper-parameters (``hyper``) set away from their defaults, by name (``{"wd": 1e30}``): what
        to suspect first when training diverges."""
        defaults = inspect.signature(type(self)).parameters
        return {name: value for name, value in self.hyper().items() if not isinstance(value, bool)
                and name in defaults and value != defaults[name].default}

    def config(self):
        """The optimizer as JSON, without ``zero``: what decides the computation, and what a checkpoint compares
        on resume (the layout, ``zero``, may change)."""
        return {"name": self.name, **self.hyper(),
                "schedule": None if self.schedule is None else self.schedule.config(), "clip_norm": self.clip_norm}

    def describe(self, shards=None):
        """One line for a run's header: the rule, the schedule, clipping and sharding (``shards``: over how many
        replicas ``zero`` shards, when known; with 1 the line says nothing is sharded)."""
        parts = [self._describe_rule()]
        if self.schedule is not None:
            parts.append(f"lr schedule {self.schedule.describe()}")
        if self.clip_norm is not None:
            parts.append(f"gradients clipped to norm {self.clip_norm:g}")
        if self.zero and shards == 1:
            parts.append(f"ZeRO-{self.zero} with one replica: nothing to shard, "
                         + ("the parameters, gradients and state stay whole" if self.zero == 3 else
                            "the state stays whole"))
        elif self.state_names() or self.zero:
            parts.append({0: "state replicated", 1: "ZeRO-1: state and update sharded over the contexts",
                          2: "ZeRO-2: gradients, state and update sharded over the contexts",
                          3: "ZeRO-3: parameters, gradients, state and update sharded over the contexts"}[self.zero])
        return ", ".join(parts)

    def _describe_rule(self):
        return f"{self.name} (lr {self.lr:g}{f', wd {self.wd:g}' if self.wd else ''})"

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self.hyper().items())
        extra = "".join(f", {k}={getattr(self, k)!r}" for k in ("schedule", "clip_norm", "zero")
                        if getattr(self, k) not in (None, 0))
        return f"{type(self).__name__}({args}{extra})"


class SGD(Optimizer):
    """Minibatch SGD, with momentum (heavy ball, or Nesterov's) and weight decay, as MXNet's ``SGD`` and ``NAG``.

    Parameters
    ----------
    lr : float
    momentum : float
        In [0, 1); 0: plain SGD, no state (``SGD(lr)`` is the textbook's step, bit for bit ``train_batch(lr=)``).
    nesterov : bool
        Nesterov's momentum (``nag_mom_update``); needs ``momentum > 0``.
    wd, schedule, clip_norm, zero
        See ``Optimizer``.
    """

    name = "sgd"
    default_lr = 0.2

    def __init__(self, lr=default_lr, momentum=0.0, nesterov=False, wd=0.0, schedule=None, clip_norm=None, zero=0):
        super().__init__(lr, wd, schedule, clip_norm, zero, momentum, nesterov)

    def state_names(self):
        return ("momentum",) if self.momentum else ()

    def update(self, weight, grad, states, lr, rescale, t):
        if not self.momentum:
            mx.nd.sgd_update(weight, grad, lr=lr, wd=self.wd, rescale_grad=rescale, out=weight)
        elif self.nesterov:
            mx.nd.nag_mom_update(weight, grad, states[0], lr=lr, momentum=self.momentum, wd=self.wd,
                                 rescale_grad=rescale, out=weight)
        else:
            mx.nd.sgd_mom_update(weight, grad, states[0], lr=lr, momentum=self.momentum, wd=self.wd,
                                 rescale_grad=rescale, out=weight)

    def hyper(self):
        return {**super().hyper(), "momentum": self.momentum, "nesterov": self.nesterov}

    def _describe_rule(self):
        rule = "sgd"
        if self.momentum:
            rule += f" with {'Nesterov ' if self.nesterov else ''}momentum {self.momentum:g}"
        return f"{rule} (lr {self.lr:g}{f', wd {self.wd:g}' if self.wd else ''})"


class Adam(Optimizer):
    """Adam (Kingma & Ba), as MXNet's ``Adam``: bias correction in the rate, ``wd`` as L2 added to the gradient.

    Parameters
    ----------
    lr : float
    beta1, beta2 : float
        In [0, 1): decay of the first and second moment estimates.
    epsilon : float
        > 0.
    wd, schedule, clip_norm, zero
        See ``Optimizer``.
    """

    name = "adam"
    default_lr = 0.001

    def __init__(self, lr=default_lr, beta1=0.9, beta2=0.999, epsilon=1e-8, wd=0.0, schedule=None, clip_norm=None,
                 zero=0):
        self.beta1 = _check_fraction(beta1, "beta1")
        self.beta2 = _check_fraction(beta2, "beta2")
        self.epsilon = check_float32(epsilon, "epsilon", positive=True)
        super().__init__(lr, wd, schedule, clip_norm, zero)   # checks the rates: needs the betas

    def state_names(self):
        return ("mean", "var")

    def bias_correction(self, t):
        """``sqrt(1 - beta2**t) / (1 - beta1**t)``: what step ``t``'s rate is multiplied by."""
        return math.sqrt(1.0 - self.beta2 ** t) / (1.0 - self.beta1 ** t)

    def bias_correction_range(self, steps=1000):
        """The lowest and highest ``bias_correction(t)`` over every step: those of the first ``steps`` steps, and
        bounds of the later ones (``sqrt(1 - beta2**(steps+1))`` and ``1 / (1 - beta1**(steps+1))``). Not monotone:
        with the default betas it falls from 0.32 at step 1 to 0.15 at step 12, then rises to 1."""
        values = [self.bias_correction(t) for t in range(1, steps + 1)]
        later = steps + 1
        return (min(min(values), math.sqrt(1.0 - self.beta2 ** later)),
                max(max(values), 1.0 / (1.0 - self.beta1 ** later)))

    def rate_scales(self):
        low, high = self.bias_correction_range()
        return ((low, f" * {low:.3g} (Adam's bias correction at its lowest)"),
                (high, f" * {high:.3g} (Adam's bias correction at its highest)"))

    def update(self, weight, grad, states, lr, rescale, t):
        mx.nd.adam_update(weight, grad, states[0], states[1], lr=lr * self.bias_correction(t), beta1=self.beta1,
                          beta2=self.beta2, epsilon=self.epsilon, wd=self.wd, rescale_grad=rescale, out=weight)

    def hyper(self):
        return {**super().hyper(), "beta1": self.beta1, "beta2": self.beta2, "epsilon": self.epsilon}


class AdamW(Adam):
    """AdamW: Adam with weight decay decoupled from the gradient (Loshchilov & Hutter), ``w -= lr * wd * w`` at
    every step besides Adam's own, through ``mx.nd.contrib.adamw_update``. MXNet 1.9.1 has the operator but no
    ``AdamW`` optimizer class.

    Parameters
    ----------
    lr, beta1, beta2, epsilon, schedule, clip_norm, zero
        See ``Adam``.
    wd : float
        Decoupled weight decay, >= 0 (default 0.01, PyTorch's).
    """

    name = "adamw"

    def __init__(self, lr=Adam.default_lr, beta1=0.9, beta2=0.999, epsilon=1e-8, wd=0.01, schedule=None,
                 clip_norm=None, zero=0):
        super().__init__(lr, beta1, beta2, epsilon, wd, schedule, clip_norm, zero)
        self._rescales = {}   # (context, rescale) -> the (1,) array adamw_update takes as its rescale_grad

    def rate_scales(self):
        return ((1.0, ""),)   # the rate is adamw_update's eta as it is; the bias correction goes in as its lr

    def update(self, weight, grad, states, lr, rescale, t):
        key = (weight.context, rescale)
        scale = self._rescales.get(key)
        if scale is None:
            if len(self._rescales) > 64:   # batch sizes come and go (an epoch's short last batch): stay bounded
                self._rescales.clear()
            # float32 whatever the weight's dtype: MXNet's adamw_update infers its rescale_grad as float32 and
            # refuses a float64 one ("Type inconsistent") for float64 weights
            scale = self._rescales[key] = mx.nd.full((1,), rescale, ctx=weight.context, dtype="float32")
        mx.nd.contrib.adamw_update(weight, grad, states[0], states[1], scale, lr=self.bias_correction(t), eta=lr,
                                   beta1=self.beta1, beta2=self.beta2, epsilon=self.epsilon, wd=self.wd, out=weight)


def make_optimizer(name, lr=None, **options):
    """The optimizer ``name`` of ``OPTIMIZERS`` (``"sgd"``, ``"adam"``, ``"adamw"``), its ``lr`` defaulting to the
    optimizer's own (0.2 for SGD, 0.001 for Adam and AdamW); ``options`` are its constructor's.

    >>> make_optimizer("sgd", momentum=0.9).describe()
    'sgd with momentum 0.9 (lr 0.2), state replicated'
    """
    check_choice(name, "optimizer", tuple(OPTIMIZERS))
    cls = {"sgd": SGD, "adam": Adam, "adamw": AdamW}[name]
    return cls(lr=cls.default_lr if lr is None else lr, **options)
