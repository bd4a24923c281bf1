"""Pipeline parallelism: micro-batches flow through model-parallel stages, in the order of a schedule.

The batch splits into M micro-batches (sizes differ by at most one, as ``shard_sizes`` splits). The pipeline
issues each micro-batch's forward and backward through each stage in the order of its schedule
(``parallel.strategies.schedules``: ``"gpipe"``, every forward then every backward; ``"1f1b"``, each backward as
soon as it can, so a stage holds at most as many micro-batches as there are stages after it, itself included;
with ``virtual`` chunks a device, interleaved 1F1B). Each stage's forward of a micro-batch is recorded on its own
input (a copy of the stage before's output) and its backward runs from the gradient the stage after left there;
every stage adds its micro-batches' gradients in micro-batch order, whatever the schedule; then one update for
the batch. MXNet's engine runs each context's work in the order it is issued but different contexts
concurrently, so stage s can work on micro-batch m+1 while stage s+1 works on micro-batch m. With K stages,
each stage idles ``(K-1)/(M+K-1)`` of the step (GPipe and 1F1B alike): the *bubble fraction*:

>>> import mxnet as mx
>>> from parallel import init_lenet_params
>>> from parallel.strategies import Pipeline
>>> model = Pipeline(init_lenet_params(seed=0), [mx.cpu(0), mx.cpu(1)], stages=2, micro_batches=4)
>>> X, y = mx.nd.ones((8, 1, 28, 28)), mx.nd.array([0, 1, 2, 3, 4, 5, 6, 7])
>>> loss_sum, correct = model.train_step(X, y, lr=0.2)   # the same step as train_batch on one context
>>> model.bubble_fraction()                              # (2-1) / (4+2-1)
0.2

The overlap needs stages that compute at the same time on separate hardware; CPU contexts that share the
same cores cannot (see benchmarks/pipeline.py).

BatchNorm. A gluon ``HybridSequential`` with BatchNorm (``init_resnet18()``) is *not* trained as on one
context: each micro-batch is normalised by its own mean and variance, and the running statistics are
updated once per micro-batch, as GPipe does. Gradients are then those of M smaller batches, not of the
batch; ``ModelParallel`` (the whole batch through each stage) and ``Hybrid`` (statistics synchronized
across its replicas) train the one-context model. Without BatchNorm (LeNet, the ViT) the pipeline is exact.
"""
import mxnet as mx
import numpy as np
from mxnet import autograd

from ..comm import algorithms
from ..comm.replica import get_params
from ..models.lenet import softmax_cross_entropy
from ..optim.zero import as_optimizer, optimizer_step
from ..split import shard_sizes, split_and_load
from ..step import adding_gradients, check_accumulate, check_batch, check_labels, fence_statistics, loss_and_correct
from ..trace import mark_backward_each, mark_forward_each
from ..validate import BadValue, check_bool, check_choice, check_contexts, check_int
from . import DEFAULT_MICRO_BATCHES, PIPELINE_SCHEDULES
from .model import ModelParallel, _cut, _unsharded
from .schedules import pipeline_schedule

__all__ = ["Pipeline", "bubble_fraction"]


def _check_micro_batches(micro_batches):
    return check_int(micro_batches, "micro_batches", low=1)


def bubble_fraction(stages, micro_batches):
    """GPipe's idle fraction ``(K-1)/(M+K-1)`` for K ``stages`` and M ``micro_batches`` (1F1B's too).

    Returns
    -------
    float
        0 for one stage; tends to 0 as M grows.
    """
    _check_micro_batches(micro_batches)
    check_int(stages, "stages", low=1)
    return (stages - 1) / (micro_batches + stages - 1)


class Pipeline(ModelParallel):
    """``ModelParallel`` trained on micro-batches, issued in the order of a schedule (GPipe's, 1F1B's, or
    interleaved 1F1B's), one update per batch.

    The same step as ``train_batch`` on one context for LeNet and for blocks without BatchNorm, whatever the
    schedule; a block's BatchNorm normalises each micro-batch separately (see the module's docstring), so with
    BatchNorm it is another model.

    Parameters
    ----------
    model, ctx_list, stages, boundaries
        As for ``ModelParallel`` (LeNet's parameters or a gluon ``HybridSequential``): stage ``s`` on
        ``ctx_list[s]``. With ``virtual`` V > 1, ``stages`` counts the devices and the model is cut into ``stages
        x V`` chunks (``boundaries``: the chunks' starts, a multiple of V of them), chunk ``c`` on ``ctx_list[c %
        stages]``.
    micro_batches : int
        M >= 1, micro-batches per batch. ``train_step`` refuses a batch with fewer than M examples.
    short_batches : bool
        True: a batch with fewer than M examples (an epoch's short last batch) runs in one micro-batch per
        example instead of being refused (what the training loop asks for).
    schedule : str
        ``"gpipe"`` (every forward, then every backward) or ``"1f1b"`` (``parallel.strategies.schedules``).
    virtual : int
        V chunks a device: interleaved 1F1B (M a multiple of the stages).

    Attributes
    ----------
    micro_batches, schedule, virtual : int, str, int
    ranges, stage_params
        As for ``ModelParallel``, one per chunk (``stage_params[c]`` on chunk ``c``'s device).
    ctx_list : list of mxnet.Context
        The devices, one per stage.
    last_stash : list of int
        Per device, the most micro-batches' activations the last step held at once (measured on what it kept).
    """

    name = "pipeline"

    def __init__(self, model, ctx_list, stages=None, boundaries=None, micro_batches=DEFAULT_MICRO_BATCHES,
                 short_batches=False, schedule="gpipe", virtual=1):
        self.micro_batches = _check_micro_batches(micro_batches)
        self.short_batches = check_bool(short_batches, "short_batches")
        self.virtual = check_int(virtual, "virtual_stages", low=1)
        self.schedule = check_choice(schedule, "schedule", tuple(PIPELINE_SCHEDULES))
        if self.virtual == 1:
            super().__init__(model, ctx_list, stages, boundaries)
        else:
            chunks = None if stages is None else check_int(stages, "stages", low=1) * self.virtual
            cut = _cut(model, 2 * self.virtual if stages is None and boundaries is None else chunks, boundaries)
            if len(cut.ranges) % self.virtual:
                raise BadValue("boundaries", f"{{boundaries}} cut {len(cut.ranges)} chunks, which cannot be dealt "
                                             f"{self.virtual} a device ({{virtual_stages={self.virtual}}}); give a "
                                             f"multiple of {self.virtual} chunks")
            self._place_chunks(cut, ctx_list)
        self.last_stash = []
        if self.virtual > 1:   # checked up front: the micro-batches come in groups of the stages
            pipeline_schedule(self.schedule, len(self.ctx_list), self.micro_batches, self.virtual)

    def _place_chunks(self, cut, ctx_list):
        """Chunk ``c`` of ``cut`` on ``ctx_list[c % P]``, P = chunks / V devices."""
        p = len(cut.ranges) // self.virtual
        check_contexts(ctx_list, needed=p, what=f"{p} stages")
        self._cut, self.ranges, self.nets = cut, cut.ranges, cut.nets
        self.ctx_list = list(ctx_list[:p])
        self.stage_params = [get_params(source, self.ctx_list[c % p]) for c, source in enumerate(cut.sources)]

    def describe(self, accumulate=1):
        """One line: the stages (chunks) and where they run, the micro-batches and the schedule."""
        where = " | ".join(f"{label} @ {params[0].context}" for label, params in zip(self._cut.labels,
                                                                                     self.stage_params))
        schedule = self.schedule if self.virtual == 1 else f"interleaved 1f1b, {self.virtual} chunks a device"
        return f"{where}, {self.micro_batches} micro-batches, schedule {schedule}"

    def bubble_fraction(self):
        """The idle fraction of a full batch's schedule: ``(K-1)/(M+K-1)`` for K stages and M micro-batches
        (GPipe and 1F1B), about V times less interleaved."""
        return self.plan().bubble

    def plan(self, micro_batches=None):
        """The ``parallel.strategies.schedules.Schedule`` a batch of ``micro_batches`` (default this pipeline's)
        runs."""
        return pipeline_schedule(self.schedule, len(self.ctx_list), micro_batches or self.micro_batches,
                                 self.virtual)

    def pipeline_metrics(self):
        """What ``--metrics-json`` records of the pipeline (its ``"pipeline"``): the schedule, each stage's peak of
        micro-batches' activations held at once and the bubble, of the schedule a full batch runs."""
        plan = self.plan()
        name = self.schedule if self.virtual == 1 else "interleaved-1f1b"
        return {"schedule": name, "micro_batches": plan.micro_batches, "virtual_stages": self.virtual,
                "stashed_peak": plan.stashed_peak, "bubble": plan.bubble}

    def train_step(self, X, y, lr=None, loss=softmax_cross_entropy, micro_batches=None, optimizer=None, accumulate=1):
        """One optimizer step on the batch, computed in micro-batches issued in the schedule's order; the same
        step as ``train_batch`` (but for BatchNorm, which normalises each micro-batch).

        Parameters
        ----------
        X, y : NDArray
            A batch of images and labels with at least ``micro_batches`` examples.
        lr : float, optional
            Plain SGD at this rate; the gradient summed over every micro-batch is divided by ``len(X)``.
        loss : callable
            ``loss(outputs, y)`` returns per-example losses.
        micro_batches : int, optional
            Overrides ``self.micro_batches`` for this step (e.g. a short last batch of an epoch).
        optimizer : parallel.optim.Optimizer, optional
            Instead of ``lr`` (see ``ModelParallel.train_step``; ``zero`` must be 0).
        accumulate : int
            Parts of the batch run one after another, each pipelined in its micro-batches, before the update.

        Returns
        -------
        (NDArray, NDArray)
            Summed loss and count of correct predictions, each (1,) on ``ctx_list[0]``, not yet computed.
            ``stage_params`` are updated in place.

        Raises
        ------
        ValueError
            When the batch has fewer examples than micro-batches (unless ``short_batches``).
        """
        check_batch(X, y)
        optimizer = as_optimizer(lr, _unsharded(optimizer, self.name))
        accumulate = check_accumulate(accumulate, X.shape[0])
        m = _check_micro_batches(self.micro_batches if micro_batches is None else micro_batches)
        with adding_gradients(self.groups()):   # every micro-batch's gradient added in place
            bounds = np.cumsum([0] + shard_sizes(X.shape[0], accumulate))
            sums = [self._run(X[a:b], y[a:b], loss, m, check=a == 0) for a, b in zip(bounds, bounds[1:])]
        fence_statistics(self)   # BatchNorm's backward writes its statistics unannounced (parallel.engine)
        optimizer_step(optimizer, self.groups(), X.shape[0], None)
        if len(sums) == 1:
            return sums[0]
        return mx.nd.add_n(*[s[0] for s in sums]), mx.nd.add_n(*[s[1] for s in sums])

    def _run(self, X, y, loss, m, check):
        """One part of a batch: its micro-batches through the chunks in the schedule's order; (summed loss,
        correct count)."""
        if m > X.shape[0] >= 1:
            if not self.short_batches:
                raise ValueError(f"micro_batches={m} cannot split a batch of {X.shape[0]} examples; use at most "
                                 f"{X.shape[0]} micro-batches or a larger batch")
            m = X.shape[0]
        first, last_ctx = self.ctx_list[0], self.stage_params[-1][0].context
        X_parts, y_parts = split_and_load(X, [first] * m), split_and_load(y, [last_ctx] * m)
        outputs, losses = self.issue(self._plan_for(m), X_parts, y_parts, loss)
        if check:
            check_labels(y, outputs[0].shape[-1], loss)
        return loss_and_correct(outputs, y_parts, losses, first)

    def _plan_for(self, m):
        """The schedule of ``m`` micro-batches. Interleaving takes them a stage-count at a time, so a short batch
        whose micro-batches do not divide runs 1F1B over the chunks as if each had a device of its own: the same
        arithmetic, another order."""
        p = len(self.ctx_list)
        if self.virtual > 1 and m % p:
            return pipeline_schedule("1f1b", p * self.virtual, m)
        return self.plan(m)

    def issue(self, schedule, X_parts, y_parts, loss):
        """Issue a step's work in ``schedule.order``: each chunk's forward of a micro-batch recorded on its own (its
        input a copy of the chunk before's output, detached, gradient attached), each backward from the gradient
        the chunk after left on that input. A micro-batch's activations on a chunk are released by its backward.
        Returns the last chunk's outputs and losses, one per micro-batch; ``last_stash`` says how many
        micro-batches each device held at most. Nothing waits."""
        last, p = len(self.nets) - 1, len(self.ctx_list)
        inputs, outputs, losses, kept = {}, {}, {}, {}
        held, peak = [0] * p, [0] * p
        for _, op in schedule.order:
            c, i = op.chunk, op.micro
            params = self.stage_params[c]
            ctx, device = params[0].context, c % p
            if op.kind == "F":
                X = X_parts[i] if c == 0 else algorithms.copy_to(outputs[(c - 1, i)].detach(), ctx)
                if c:
                    X.attach_grad()
                mark_forward_each([X])   # where a trace's forward starts (parallel.trace)
                with autograd.record():
                    out = self.nets[c](X, params)
                    if c == last:
                        losses[i] = loss(out, y_parts[i])
                inputs[(c, i)], outputs[(c, i)] = X, out
                held[device] += 1
                peak[device] = max(peak[device], held[device])
                continue
            # retain_graph: MXNet clears what every array of a graph holds for autograd after its backward, the
            # running statistics' too, which a BatchNorm's other micro-batches still record (their backward would
            # fail); the graph goes when its arrays do, dropped here (the loss and outputs kept detached)
            if c == last:
                mark_backward_each([losses[i]])
                autograd.backward([losses[i]], retain_graph=True)
                kept[i], losses[i] = outputs.pop((c, i)).detach(), losses[i].detach()
            else:
                head = algorithms.copy_to(inputs.pop((c + 1, i)).grad, ctx)
                mark_backward_each([head])
                autograd.backward([outputs.pop((c, i))], [head], retain_graph=True)
            held[device] -= 1
        self.last_stash = [n / self.virtual if self.virtual > 1 else n for n in peak]
        return [kept[i] for i in range(len(X_parts))], [losses[i] for i in range(len(X_parts))]
