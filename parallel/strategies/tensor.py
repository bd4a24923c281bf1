"""Tensor parallelism (Megatron-LM): each layer's weights split over the T contexts of a group, and data
parallelism over the groups.

With T = ``tensor`` and K contexts, the contexts form K / T groups of T consecutive contexts (``cpu:4`` with
``tensor=2``: groups (cpu(0), cpu(1)) and (cpu(2), cpu(3))), as Megatron puts a tensor-parallel group on the GPUs
of one machine. Within a group, rank ``t`` holds its part of every layer (``parallel.models.vit_tensor``: the
ViT's heads and MLP units split, Megatron's column- then row-parallel layers with f and g between, the patch
projection split over its pixels, the classifier over its classes, the rest replicated) and the group runs each
example together, f and g summing the ranks' partial results (``parallel.comm.TensorTape``). Across the groups it
is data parallelism: the batch is split over the groups as ``split_and_load`` splits it, and each rank's
gradients are summed over the groups' same ranks (the reducer's allreduce: cpu(0) with cpu(2), cpu(1) with
cpu(3)), then every rank takes the same optimizer step.

With ``stages`` (the hybrid strategy: ``make_strategy("hybrid", ..., tensor=T)``), each data-parallel replica is
a chain of stages of the ViT's children and each stage a group of T ranks: data x pipeline stages x tensor, the
stages run one after the other on a replica's shard. With a reducer's ``job``, every worker's replicas are
data-parallel replicas of the job's (each gradient group summed over the workers under keys of its own).

>>> import mxnet as mx
>>> from parallel.models import init_model
>>> from parallel.strategies import TensorParallel
>>> model = TensorParallel(init_model("vit", seed=0), [mx.cpu(i) for i in range(4)], tensor=2)
>>> model.describe()
'2 data-parallel groups x 2 tensor ranks: each rank 2 of 4 heads, 64 of 128 MLP units, 5 of 10 classes; ranks cpu(0),cpu(1) | cpu(2),cpu(3)'

The same model as one context up to float32 rounding (``tests/test_tensor.py``: within 1e-5 of each array's
scale after several steps with momentum SGD): a row-parallel layer adds its ranks' partial sums in another order,
and the patch projection is a dense layer of the unfolded patches, not a convolution.
"""
import mxnet as mx

from ..comm.algorithms import bytes_moved as allreduce_bytes
from ..comm.reducer import as_reducer
from ..comm.replica import block_state, get_params
from ..comm.tensor import TensorTape
from ..evaluate import accuracy
from ..models.lenet import softmax_cross_entropy
from ..optim.zero import gather_state, load_state
from ..models.registry import behaviour_of
from ..models.vit_tensor import TensorViT
from ..split import shard_sizes
from ..job import KEYS
from ..optim.zero import as_optimizer
from ..step import worker_step
from ..validate import BadValue, check_contexts, check_int
from . import Stages
from .model import stage_ranges

__all__ = ["TensorParallel"]


class TensorParallel:
    """Data parallelism over replicas of ``stages`` stages, each stage split over ``tensor`` contexts (see the
    module's docstring).

    Parameters
    ----------
    params : mxnet.gluon.nn.HybridSequential
        The ViT (``init_model("vit")``, ``init_vit``), initialized; copied, not modified.
    ctx_list : list of mxnet.Context
        Distinct contexts, a multiple of ``tensor`` x the stages: replica ``r``'s stage ``s``'s rank ``t`` on
        ``ctx_list[(r S + s) T + t]``.
    tensor : int
        T, the contexts a stage splits each layer over: 1 to the ViT's number of heads.
    reducer : parallel.Reducer or str, optional
        How each rank's gradients are summed over the replicas (an allreduce's name, buckets; uncompressed); its
        algorithm is f's and g's too. With a ``job``, the replicas of every worker are data-parallel replicas of
        the job (a collective constructor: every worker makes it, rank 0's initial model wins), each worker
        training its slice of each global batch; the stages and ranks of a replica stay in one process.
    stages : int or parallel.strategies.Stages, optional
        Where to cut the ViT's children into stages (``stage_ranges``; default: one stage, the whole model): the
        hybrid strategy's pipeline axis, its stages run one after the other for each replica's shard.

    Attributes
    ----------
    plan : parallel.models.vit_tensor.TensorViT
        Which part of each array each rank holds, and a stage's forward pass.
    ranges : list of (int, int)
        The children of each stage.
    ranks : list of list of list of FlatReplica
        ``ranks[r][s][t]``: replica ``r``'s stage ``s``'s rank ``t``, its part of the stage's arrays (gradients
        attached).
    """

    def __init__(self, params, ctx_list, tensor=1, reducer=None, stages=None):
        self.reducer = as_reducer(reducer)
        if self.reducer.codec is not None:
            raise BadValue("tensor", "{tensor} sums its gradients uncompressed; give a Reducer without compression")
        check_int(tensor, "tensor", low=1)
        check_contexts(ctx_list)
        self.plan = TensorViT(params, tensor, self.reducer.algorithm)
        self.ctx_list, self.tensor = list(ctx_list), int(tensor)
        layout = Stages(count=stages) if isinstance(stages, int) else stages or Stages(count=1)
        self.ranges = stage_ranges(layout.count, layout.boundaries, *behaviour_of(params).layers(params))
        self.name = "data" if len(self.ranges) == 1 else "hybrid"
        width = self.tensor * len(self.ranges)
        if len(self.ctx_list) % width:
            lower = len(self.ctx_list) // width * width
            what = f"{{tensor={tensor}}}" if len(self.ranges) == 1 else \
                f"{len(self.ranges)} stages of {{tensor={tensor}}}"
            raise BadValue("tensor", f"{len(self.ctx_list)} contexts cannot form groups of {what}; use a multiple of "
                                     f"{width} contexts (e.g. {lower or width})")
        _, arrays, _, _ = block_state(params)
        host = get_params(list(arrays), mx.cpu())   # the model's arrays as one flat buffer, on the host
        if self.job is not None:   # every worker starts from rank 0's model
            self.job.broadcast(KEYS["params"], host.data)
        shards = [self.plan.shard(list(host), t) for t in range(self.tensor)]
        self.ranks = []
        for r in range(len(self.ctx_list) // width):
            replica = []
            for s, (start, stop) in enumerate(self.ranges):
                picked = self.plan.indices_of(start, stop)
                contexts = self.ctx_list[(r * len(self.ranges) + s) * self.tensor:][:self.tensor]
                ranks = [self.reducer.replicate([shards[t][i] for i in picked], [ctx])[0]
                         for t, ctx in enumerate(contexts)]
                for rank in ranks[1:]:   # a global norm (clipping) counts the replicated arrays once
                    rank.copies = {j for j, i in enumerate(picked) if self.plan.replicated(self.plan.names[i])}
                replica.append(ranks)
            self.ranks.append(replica)
        self._tapes = []

    def __repr__(self):
        return f"TensorParallel({self.describe()})"

    @property
    def job(self):
        """The distributed job whose workers' replicas are data-parallel replicas of each other (the reducer's),
        or None."""
        return self.reducer.job

    @property
    def model(self):
        """What the training loop returns: the strategy itself."""
        return self

    def describe(self, accumulate=1):
        """One line: the replicas (and stages), what each rank holds, and the contexts of each stage."""
        plan, replicas, stages = self.plan, len(self.ranks), len(self.ranges)
        share = (f"each rank {plan.heads[1]} of {plan.num_heads} heads, {plan.units[1]} of {plan.mlp_dim} MLP "
                 f"units, {plan.classes[1]} of {plan.num_classes} classes")
        if any(b - a != plan.heads[1] for a, b in zip(plan.heads, plan.heads[1:])):
            share = share.replace("each rank", "each rank about")
        where = " | ".join(",".join(str(rank[0].context) for rank in stage) for replica in self.ranks
                           for stage in replica)
        axes = f"{replicas} data-parallel {'group' if stages == 1 else 'replica'}{'s' if replicas > 1 else ''}"
        if stages > 1:
            labels = ", ".join(f"{a}-{b - 1}" if b - a > 1 else f"{a}" for a, b in self.ranges)
            axes += f" x {stages} stages (children {labels})"
        line = f"{axes} x {self.tensor} tensor rank{'s' if self.tensor > 1 else ''}: {share}; ranks {where}"
        if self.job is not None:
            line += f"; gradients summed over {self.job.num_workers} workers through the {self.job.kv.type} kvstore"
        return line

    # ``parallel.step.step_replicas`` takes the strategy as its replicas: one replica of stages of ranks each.
    @property
    def in_ctx_list(self):
        """Where each replica takes its shard of the batch: its first stage's first rank's context."""
        return [replica[0][0][0].context for replica in self.ranks]

    @property
    def out_ctx_list(self):
        """Where each replica gives its logits: its last stage's first rank's context."""
        return [replica[-1][0][0].context for replica in self.ranks]

    def _forward(self, X, replica, tape):
        """The logits of ``X`` through ``replica``'s stages, one after the other."""
        for (start, stop), stage in zip(self.ranges, replica):
            X = self.plan.forward(X, stage, tape, start, stop)
        return X

    def forward_all(self, X_shards):
        """Each replica's logits of its shard (on its last stage's first rank's context), the ranks of a stage in
        lockstep; the tapes kept for ``backward``."""
        self._tapes = [TensorTape(self.plan.algorithm) for _ in X_shards]
        return [self._forward(X, replica, tape) for X, replica, tape in zip(X_shards, self.ranks, self._tapes)]

    def backward(self, losses):
        """The backward pass of the last ``forward_all``: through the losses, then each replica's tape (f's
        allreduces and g's identities between its segments, the stages' copies)."""
        mx.autograd.backward(losses)
        for tape in self._tapes:
            tape.backward()
        self._tapes = []

    def aux(self, r=0):
        """No array that is not trained (the ViT has no BatchNorm)."""
        return []

    def groups(self):
        """The trained arrays as ``parallel.optim.optimizer_step`` takes them: stage ``s``'s rank ``t`` of every
        replica forms a group, summed over the replicas."""
        return [[replica[s][t] for replica in self.ranks] for s in range(len(self.ranges))
                for t in range(self.tensor)]

    def train_step(self, X, y, lr=None, loss=softmax_cross_entropy, optimizer=None, accumulate=1):
        """One optimizer step (``parallel.step.step_replicas``): the batch split over the replicas, each replica's
        forward and backward through its stages and ranks, each rank's gradients summed over the replicas, every
        rank updated. Returns (summed loss, correct count), each (1,) on ``ctx_list[0]``, not waited for. In a job,
        ``X`` and ``y`` are the global batch and this worker trains its slice (``parallel.job.worker_slice``); every
        worker must call it for every batch (one without an example adds zeros to the sums)."""
        return worker_step(self, X, y, loss, as_optimizer(lr, optimizer), accumulate, self.job)

    def _ranks_of(self, replica):
        """``replica``'s arrays as each rank would hold the whole model's (its stages' arrays one after the
        other, in the model's order): what ``TensorViT.unshard`` takes."""
        return [[array for stage in replica for array in stage[t]] for t in range(self.tensor)]

    def _predictor(self, replica):
        return lambda X: self._forward(X, replica, TensorTape(self.plan.algorithm))

    def evaluate(self, data_iter):
        """Accuracy over ``data_iter``, each batch split over the replicas (``parallel.evaluate.accuracy``)."""
        return accuracy(data_iter, [self._predictor(replica) for replica in self.ranks], self.in_ctx_list, self.job)

    def params(self):
        """The model's trainable arrays, whole, on the CPU, in its order (group 0's ranks put together): what a
        checkpoint stores."""
        return [mx.nd.array(a, ctx=mx.cpu(), dtype=a.dtype) for a in self.plan.unshard(self._ranks_of(self.ranks[0]))]

    def gather_state(self, optimizer):
        """The optimizer's state as a checkpoint stores it (``parallel.optim.gather_state``'s form: ``{state name:
        [array per parameter of the model]}``, whole, on the CPU): each rank's state put together as ``params()``
        puts the arrays."""
        groups, stages = self.groups(), len(self.ranges)
        per_group = [gather_state(optimizer, [group], list(group[0])) for group in groups]
        per_rank = [{name: [a for s in range(stages) for a in per_group[s * self.tensor + t][name]]
                     for name in optimizer.state_names()} for t in range(self.tensor)]
        return {name: [mx.nd.array(a, ctx=mx.cpu(), dtype=a.dtype)
                       for a in self.plan.unshard([state[name] for state in per_rank])]
                for name in optimizer.state_names()}

    def load_state(self, optimizer, state):
        """Give ``optimizer`` the state ``state`` (``gather_state``'s form, from any layout): each rank its part."""
        names = optimizer.state_names()
        if sorted(state) != sorted(names):
            raise ValueError(f"state holds {sorted(state)} but {optimizer.name} keeps {list(names)}")
        shards = [{name: self.plan.shard(state[name], t) for name in names} for t in range(self.tensor)]
        for (s, t), group in zip([(s, t) for s in range(len(self.ranges)) for t in range(self.tensor)],
                                 self.groups()):
            picked = self.plan.indices_of(*self.ranges[s])
            load_state(optimizer, [group], list(group[0]), {name: [shards[t][name][i] for i in picked]
                                                            for name in names})

    def names(self):
        """The model's trainable arrays' structural names, in ``params()`` order."""
        return list(self.plan.names)

    def aux_names(self):
        return []

    def bytes_moved(self, batch):
        """Bytes one training step of ``batch`` examples copies between contexts within the replicas, over all of
        them: each stage's f and g allreduces (Megatron's count, ``TensorViT.allreduces``) times the allreduce's
        own bytes (``parallel.comm.bytes_moved``), the images copied to the first stage's other ranks, the logits
        gathered on the last stage's first rank and their gradient sent back, and between stages each rank's
        hidden states forward and their gradient back. (Data parallelism's sum of the gradients over the replicas
        is not counted.)"""
        plan, t, itemsize = self.plan, self.tensor, 4
        total = 0
        for n in shard_sizes(batch, len(self.ranks)) if batch else []:
            total += 2 * (len(self.ranges) - 1) * t * n * plan.tokens * plan.dim * itemsize
            if t == 1:
                continue
            total += sum(count * allreduce_bytes(plan.algorithm, elements * itemsize, t).total
                         for elements, count in plan.allreduces(n))
            gathered = n * (plan.num_classes - plan.classes[1])   # every rank's classes but the first's
            total += (t - 1) * n * plan.image ** 2 * itemsize + 2 * gathered * itemsize
        return total
