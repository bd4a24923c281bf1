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
from ..comm.replica import block_state
from ..comm.tensor import TensorTape
from ..evaluate import accuracy
from ..models.lenet import softmax_cross_entropy
from ..optim.zero import gather_state, load_state
from ..models.vit_tensor import TensorViT
from ..split import shard_sizes
from ..step import step_replicas
from ..validate import BadValue, check_contexts, check_int

__all__ = ["TensorParallel"]


class TensorParallel:
    """Data parallelism over groups of ``tensor`` contexts, each group running the model split over its contexts
    (see the module's docstring).

    Parameters
    ----------
    params : mxnet.gluon.nn.HybridSequential
        The ViT (``init_model("vit")``, ``init_vit``), initialized; copied, not modified.
    ctx_list : list of mxnet.Context
        Distinct contexts, a multiple of ``tensor``: group ``d`` is ``ctx_list[d*T:(d+1)*T]``.
    tensor : int
        T, the contexts a group splits each layer over: 1 to the ViT's number of heads.
    reducer : parallel.Reducer or str, optional
        How each rank's gradients are summed over the groups (an allreduce's name, buckets); its algorithm is
        f's and g's too. One process, uncompressed.

    Attributes
    ----------
    plan : parallel.models.vit_tensor.TensorViT
        Which part of each array each rank holds, and the group's forward pass.
    ranks : list of list of FlatReplica
        ``ranks[d][t]``: group ``d``'s rank ``t``, its arrays on ``ctx_list[d*T + t]`` (gradients attached).
    """

    name = "data"
    job = None

    def __init__(self, params, ctx_list, tensor=1, reducer=None):
        self.reducer = as_reducer(reducer)
        if self.reducer.job is not None or self.reducer.codec is not None:
            raise BadValue("tensor", "{tensor} splits the model within one process, uncompressed; give a Reducer "
                                     "without a job or compression")
        check_int(tensor, "tensor", low=1)
        check_contexts(ctx_list)
        self.ctx_list, self.tensor = list(ctx_list), int(tensor)
        if len(self.ctx_list) % self.tensor:
            lower = len(self.ctx_list) // self.tensor * self.tensor
            raise BadValue("tensor", f"{len(self.ctx_list)} contexts cannot form groups of {{tensor={tensor}}}; use a "
                                     f"multiple of {tensor} contexts (e.g. {lower or tensor})")
        self.plan = TensorViT(params, tensor, self.reducer.algorithm)
        groups = [self.ctx_list[d:d + self.tensor] for d in range(0, len(self.ctx_list), self.tensor)]
        _, arrays, _, _ = block_state(params)
        host = [a.as_in_context(mx.cpu()) for a in arrays]
        shards = [self.plan.shard(host, t) for t in range(self.tensor)]
        self.ranks = [[self.reducer.replicate(shards[t], [ctx])[0] for t, ctx in enumerate(group)]
                      for group in groups]
        self._tapes = []

    def __repr__(self):
        return f"TensorParallel({self.describe()})"

    @property
    def model(self):
        """What the training loop returns: the strategy itself."""
        return self

    def describe(self, accumulate=1):
        """One line: the groups, what each rank holds, and the contexts of each group."""
        plan, groups = self.plan, len(self.ranks)
        share = (f"each rank {plan.heads[1]} of {plan.num_heads} heads, {plan.units[1]} of {plan.mlp_dim} MLP "
                 f"units, {plan.classes[1]} of {plan.num_classes} classes")
        if any(b - a != plan.heads[1] for a, b in zip(plan.heads, plan.heads[1:])):
            share = share.replace("each rank", "each rank about")
        where = " | ".join(",".join(str(r[0].context) for r in group) for group in self.ranks)
        return (f"{groups} data-parallel group{'s' if groups > 1 else ''} x {self.tensor} tensor rank"
                f"{'s' if self.tensor > 1 else ''}: {share}; ranks {where}")

    # ``parallel.step.step_replicas`` takes the strategy as its replicas: one tensor-parallel group each.
    @property
    def in_ctx_list(self):
        """Where each group takes its shard of the batch and gives its logits: its first rank's context."""
        return [group[0][0].context for group in self.ranks]

    out_ctx_list = in_ctx_list

    def forward_all(self, X_shards):
        """Each group's logits of its shard (on its first rank's context), the ranks of a group in lockstep; the
        tapes kept for ``backward``."""
        self._tapes = [TensorTape(self.plan.algorithm) for _ in X_shards]
        return [self.plan.forward(X, group, tape) for X, group, tape in zip(X_shards, self.ranks, self._tapes)]

    def backward(self, losses):
        """The backward pass of the last ``forward_all``: through the losses, then each group's tape (f's
        allreduces and g's identities between its segments)."""
        mx.autograd.backward(losses)
        for tape in self._tapes:
            tape.backward()
        self._tapes = []

    def aux(self, r=0):
        """No array that is not trained (the ViT has no BatchNorm)."""
        return []

    def groups(self):
        """The trained arrays as ``parallel.optim.optimizer_step`` takes them: rank ``t`` of every group forms group
        ``t``, summed over the groups (and sharded over them with ``zero``)."""
        return [[group[t] for group in self.ranks] for t in range(self.tensor)]

    def train_step(self, X, y, lr=None, loss=softmax_cross_entropy, optimizer=None, accumulate=1):
        """One optimizer step (``parallel.step.step_replicas``): the batch split over the groups, each group's
        forward and backward through its ranks, each rank's gradients summed over the groups, every rank updated.
        Returns (summed loss, correct count), each (1,) on ``ctx_list[0]``, not waited for."""
        return step_replicas(self, X, y, lr, loss, optimizer=optimizer, accumulate=accumulate)

    def _predictor(self, group):
        return lambda X: self.plan.forward(X, group, TensorTape(self.plan.algorithm))

    def evaluate(self, data_iter):
        """Accuracy over ``data_iter``, each batch split over the groups (``parallel.evaluate.accuracy``)."""
        return accuracy(data_iter, [self._predictor(group) for group in self.ranks], self.in_ctx_list)

    def params(self):
        """The model's trainable arrays, whole, on the CPU, in its order (group 0's ranks put together): what a
        checkpoint stores."""
        return [mx.nd.array(a, ctx=mx.cpu(), dtype=a.dtype) for a in self.plan.unshard(self.ranks[0])]

    def gather_state(self, optimizer):
        """The optimizer's state as a checkpoint stores it (``parallel.optim.gather_state``'s form: ``{state name:
        [array per parameter of the model]}``, whole, on the CPU): each rank's state put together as ``params()``
        puts the arrays."""
        per_rank = [gather_state(optimizer, [group], list(group[0])) for group in self.groups()]
        return {name: [mx.nd.array(a, ctx=mx.cpu(), dtype=a.dtype)
                       for a in self.plan.unshard([state[name] for state in per_rank])]
                for name in optimizer.state_names()}

    def load_state(self, optimizer, state):
        """Give ``optimizer`` the state ``state`` (``gather_state``'s form, from any layout): each rank its part."""
        names = optimizer.state_names()
        if sorted(state) != sorted(names):
            raise ValueError(f"state holds {sorted(state)} but {optimizer.name} keeps {list(names)}")
        for t, group in enumerate(self.groups()):
            load_state(optimizer, [group], list(group[0]), {name: self.plan.shard(state[name], t) for name in names})

    def names(self):
        """The model's trainable arrays' structural names, in ``params()`` order."""
        return list(self.plan.names)

    def aux_names(self):
        return []

    def bytes_moved(self, batch):
        """Bytes one training step of ``batch`` examples copies between contexts within the groups, over all of
        them: each group's f and g allreduces (Megatron's count, ``TensorViT.allreduces``) times the allreduce's
        own bytes (``parallel.comm.bytes_moved``), its images copied to its other ranks, and its logits gathered
        on its first rank and their gradient sent back. (Data parallelism's sum of the gradients over the groups
        is not counted.) 0 for ``tensor=1``."""
        plan, t, itemsize = self.plan, self.tensor, 4
        if t == 1:
            return 0
        total = 0
        for n in shard_sizes(batch, len(self.ranks)):
            total += sum(count * allreduce_bytes(plan.algorithm, elements * itemsize, t).total
                         for elements, count in plan.allreduces(n))
            gathered = n * (plan.num_classes - plan.classes[1])   # every rank's classes but the first's
            total += (t - 1) * n * plan.image ** 2 * itemsize + 2 * gathered * itemsize
        return total
