"""Expert parallelism: data-parallel replicas of a model with mixture-of-experts layers, whose experts are spread
over groups of ``expert_parallel`` replicas (GShard; DeepSpeed-MoE; Megatron-Core's expert parallelism).

``ExpertParallel(block, ctx_list, layout)`` puts one replica on each context. With D replicas and P =
``layout.expert_parallel``, replicas ``g P .. g P + P - 1`` form expert-parallel group ``g``, and its member ``p``
holds experts ``p E / P .. (p + 1) E / P - 1`` of every MoE layer (``MoEFeedForward.expert_specs``); every other
array (the router included) is whole on every replica. One step (``parallel.step.step_replicas``, the step of every
strategy):

- the batch is split over the replicas; they run the model in lockstep (``parallel.models.layers.run_replicas``),
  so that each MoE layer sees every replica's tokens: it routes them over the whole batch, sends each token to the
  member holding its expert and back (the all-to-all, ``parallel.models.moe``), while every other layer computes
  each replica's own shard;
- one backward pass of every replica's loss and its part of the auxiliary losses (the load-balancing loss and
  the z-loss), which sends the gradients back through the all-to-all's copies;
- the Reducer sums two kinds of group (``groups()``): the dense arrays over all D replicas, and each member's
  experts over the D / P replicas that hold the same experts (member ``p`` of every group); then every replica
  takes the same optimizer step (ZeRO 1 and 2 shard each group's state over its replicas).

With P = 1 every replica holds every expert (data parallelism of an MoE model); with P = D one replica holds each
expert group. The same model as one context (``tests/test_experts.py``): the routing is decided over the whole
batch on the host, so K replicas route, queue and drop exactly the tokens one context does. An expert-parallel group
lives in one process: in a job, every worker routes its slice of the batch over its own contexts, and the experts'
gradients are summed over the workers as the rest are.

>>> import mxnet as mx
>>> from parallel.layout import Layout
>>> from parallel.models.vit import init_vit
>>> model = ExpertParallel(init_vit(seed=0, experts=4), [mx.cpu(0), mx.cpu(1)], Layout(expert_parallel=2))
>>> model.describe()
'2 replicas, each holding 2 of the 4 experts of 2 MoE layers (expert-parallel groups of 2): tokens sent to their experts by an all-to-all; gradients summed with the fused allreduce in buckets of 25 MiB'
"""
import mxnet as mx
from mxnet import autograd

from ..comm.reducer import as_reducer
from ..comm.replica import FlatReplica, block_state, get_params
from ..evaluate import accuracy
from ..job import KEYS, broadcast_arrays
from ..layout import Layout
from ..models.layers import run_replicas
from ..models.lenet import softmax_cross_entropy
from ..models.recompute import Part
from ..models.lockstep import fan_out
from ..models.moe import RoutingMeter, aux_losses, check_shared, moe_layers
from ..optim.zero import ReplicatedStore, as_optimizer
from ..shard import Replicated
from ..step import Replicas, worker_step
from ..validate import BadType, BadValue, check_contexts
from .base import ArrayPlace, Strategy

__all__ = ["ExpertParallel", "expert_specs"]


def expert_specs(block):
    """``{param.name: spec}`` of the arrays of ``block`` that expert parallelism splits (its MoE layers'
    experts); every other array is whole on every replica."""
    specs = {}
    for layer in moe_layers(block):
        for attr, spec in layer.expert_specs().items():
            specs[getattr(layer, attr).name] = spec
    return specs


def _named(replica, names):
    """A ``FlatReplica`` of ``get_params`` with its arrays' names."""
    return FlatReplica(replica, replica.data, replica.grads, replica.buckets, names)


class ExpertParallel(Strategy, Replicas):
    """A gluon model with MoE layers, one replica a context, its experts spread over expert-parallel groups (see
    the module's docstring).

    Parameters
    ----------
    block : mxnet.gluon.HybridBlock
        The initialized model (``init_vit(experts=E)``): copied, not modified; it runs the replicas' forward
        (imperatively, in lockstep), so it must not be run elsewhere meanwhile.
    ctx_list : list of mxnet.Context
        One replica on each; a multiple of ``layout.expert_parallel``.
    layout : parallel.Layout
        The data strategy with ``expert_parallel`` (ZeRO 0 to 2, ``accumulate``, ``compression``).
    reducer : parallel.Reducer or str, optional
        How every group's gradients are summed (and over the workers of its job).
    """

    name = "data"
    #: A member that no token reaches in a step leaves its experts' gradients unwritten: the step zeroes them first.
    skips_parameters = True
    #: Every context computes with the others (a batch that leaves one idle is refused): the sums count them all.
    computes_together = True
    #: Whether the model must have MoE layers (a subclass that spreads another axis may not).
    needs_experts = True

    def __init__(self, block, ctx_list, layout=None, reducer=None):
        self.layout = Layout() if layout is None else layout
        if not isinstance(self.layout, Layout):
            raise BadType("layout", f"{{layout}} must be a parallel.Layout, got {type(layout).__name__}")
        self.ctx_list = check_contexts(ctx_list)
        self.reducer = as_reducer(reducer)
        layers = moe_layers(block)
        self._check_layers(layers)
        D, P, E = len(self.ctx_list), self.layout.expert_parallel, layers[0].experts if layers else 0
        if D % P:
            raise BadValue("expert_parallel", f"{{expert_parallel={P}}} cannot group {D} contexts; use a divisor of "
                                              "the contexts")
        check_shared(layers, P)
        self.mesh = self.layout.place(self.ctx_list)   # one replica a context: data x expert x context
        names, arrays, aux_names, aux = block_state(block)
        if aux:
            raise BadValue("block", "expert parallelism trains models whose every array is trained (no BatchNorm)")
        self.block, self.experts, self.moe_layers = block, E, len(layers)
        self.context = self.layout.context
        specs = expert_specs(block)
        self._names = names
        self._dense_index = [i for i, name in enumerate(names) if name not in specs]
        self._expert_index = [i for i, name in enumerate(names) if name in specs]
        self._specs = [specs.get(name, Replicated()) for name in names]
        self._shapes = [a.shape for a in arrays]
        if self.job is not None:   # every worker starts from rank 0's model
            arrays = broadcast_arrays(self.job, KEYS["params"], [a.copy() for a in arrays])
        bucket_mb = self.reducer.bucket_mb
        dense_names = [names[i] for i in self._dense_index]
        expert_names = [names[i] for i in self._expert_index]
        self.dense, self.expert_arrays = [], []
        for r, ctx in enumerate(self.ctx_list):
            self.dense.append(_named(get_params([arrays[i] for i in self._dense_index], ctx, bucket_mb), dense_names))
            member = self.mesh.replica_coords(r).expert
            local = [self._specs[i].local(arrays[i], member, P) for i in self._expert_index]
            self.expert_arrays.append(_named(get_params(local, ctx, bucket_mb), expert_names) if local else [])
        self.parts = [Part(list(d) + list(e), dense_names + expert_names, [])
                      for d, e in zip(self.dense, self.expert_arrays)]
        self._groups = self.mesh.replica_groups("context")   # each example's tokens split over a group's members
        self.in_ctx_list = self.out_ctx_list = [self.ctx_list[g[0]] for g in self._groups]   # where each shard goes
        self._places = self._lay_out()
        self._aux, self._examples = [], 0
        self._meter = RoutingMeter(layers)   # what the training forwards' routing did since epoch_metrics read it

    def __repr__(self):
        return f"{type(self).__name__}({self.describe()})"

    def _check_layers(self, layers):
        """Refuse a model without MoE layers, and the layouts a mixture of experts does not run in."""
        if not layers and self.needs_experts:
            raise BadValue("expert_parallel", "{expert_parallel} spreads the experts of a mixture-of-experts model; "
                                              "the model has none: give it experts (vit(experts=E), --experts)")
        if self.layout.stages_given > 1 or self.layout.tensor > 1 or self.layout.zero == 3:
            raise BadValue("layout", "ExpertParallel runs the data strategy with ZeRO 0 to 2; pipeline stages, "
                                     "tensor ranks and ZeRO-3 are Hybrid's: use make_strategy")

    def _lay_out(self):
        P = self.layout.expert_parallel
        dense = ReplicatedStore(self.dense)
        members = [ReplicatedStore([self.expert_arrays[r] for r in self.mesh.holders(expert=m)]) for m in range(P)]
        places = [None] * len(self._names)
        for k, i in enumerate(self._dense_index):
            places[i] = ArrayPlace([dense], k, Replicated(), self._shapes[i])
        for k, i in enumerate(self._expert_index):
            places[i] = ArrayPlace(members, k, self._specs[i], self._shapes[i])
        return places

    # ---- the step ----------------------------------------------------------------------------------------------

    def _check_shards(self, X_shards):
        n = len(self.in_ctx_list)
        if 0 < len(X_shards) < n:
            raise BadValue("batch_size", f"a batch of {len(X_shards)} example(s) cannot feed the {n} replicas, which "
                                         f"compute together; use batches of at least {n} examples")

    def _run(self, X_shards):
        """The model on every context in lockstep: each shard on its replica (on each member of its
        context-parallel group); the outputs, one a shard (a group's first member's)."""
        self._check_shards(X_shards)
        inputs = fan_out(X_shards, self.ctx_list, self._groups)
        out = run_replicas(self.block, inputs, self.parts, self.layout.expert_parallel, self.context)
        return [out.arrays[g[0]] for g in self._groups]

    def forward_all(self, X_shards):
        """Every replica's output, in lockstep; keeps the MoE layers' auxiliary losses for ``backward``."""
        out = self._run(X_shards)
        self._aux = aux_losses(self.block) if autograd.is_recording() else []
        self._examples = sum(x.shape[0] for x in X_shards)
        if autograd.is_recording():
            self._meter.add(self._meter.layers)
        return out

    def epoch_metrics(self):
        """``{"experts": {"tokens": [per MoE layer, per expert: the choices routed to it], "dropped": the fraction
        of choices dropped past capacity, "aux_loss": the auxiliary losses (all layers') of a forward, the mean
        over the forwards}}`` of the training steps since the last call (this process's, in a job); ``{}``
        before any (``RoutingMeter.read``: waits for the summed auxiliary loss)."""
        return self._meter.read()

    def backward(self, losses):
        """The backward pass of the replicas' losses and of their parts of the auxiliary losses, the latter with
        the gradient ``n`` (the examples of the forward): the step divides every gradient by the batch, so the
        model learns the mean loss plus the auxiliary losses."""
        heads = list(losses) + self._aux
        grads = [None] * len(losses) + [mx.nd.full((1,), self._examples, ctx=a.context, dtype=a.dtype)
                                        for a in self._aux]
        autograd.backward(heads, grads)
        self._aux = []

    def groups(self):
        """The dense arrays over every replica, then member ``p``'s experts over the replicas holding them."""
        P = self.layout.expert_parallel
        return [self.dense] + ([self.expert_arrays[p::P] for p in range(P)] if self.moe_layers else [])

    def train_step(self, X, y, lr=None, loss=softmax_cross_entropy, optimizer=None, accumulate=1):
        """One optimizer step on the batch (``parallel.step.step_replicas``); returns (summed loss, correct
        count), each (1,) on ``ctx_list[0]``, not waited for."""
        optimizer = as_optimizer(lr, optimizer)
        if optimizer.zero == 3:
            raise BadValue("zero", "ExpertParallel runs ZeRO 0 to 2; {zero=3} is Hybrid's: use make_strategy with "
                                   "Layout(zero=3)")
        return worker_step(self, X, y, loss, optimizer, accumulate, self.job)

    def evaluate(self, data_iter):
        """Accuracy over ``data_iter``, each batch split over the replicas and routed as in training."""
        return accuracy(data_iter, self._predict, self.in_ctx_list, self.job)

    def _predict(self, X_shards):
        # in training mode: in inference MXNet's oneDNN operators reorder a weight in place into a blocked layout,
        # which a view into a replica's flat buffer cannot take (it corrupts the buffer). The model has no layer
        # that the mode changes (no dropout, no BatchNorm: refused above).
        with autograd.train_mode():
            return self._run(X_shards)

    # ---- what it is ---------------------------------------------------------------------------------------------

    def places(self):
        return self._places

    def names(self):
        return list(self._names)

    def routing(self):
        """The MoE layers' last forward (``RoutingStats``), in order."""
        return [layer.last for layer in moe_layers(self.block)]

    def describe(self, accumulate=1):
        D, P = len(self.ctx_list), self.layout.expert_parallel
        layers = f"{self.moe_layers} MoE layer{'s' if self.moe_layers > 1 else ''}"
        if P == 1:
            line = (f"{D} replica{'s' if D > 1 else ''}, each holding all {self.experts} experts of {layers}")
        else:
            line = (f"{D} replicas, each holding {self.experts // P} of the {self.experts} experts of {layers} "
                    f"(expert-parallel groups of {P}): tokens sent to their experts by an all-to-all")
        return self._summed(line)

    def _summed(self, line):
        """``line`` and how the gradients are summed: over every context, and over the workers of a job."""
        summed = self.reducer.describe(len(self.ctx_list))
        if summed:
            line += f"; {summed}"
        if self.job is not None:
            line += f"; over {self.job.num_workers} worker(s) through the {self.job.kv.type} kvstore"
        return line
