"""Hybrid parallelism: data parallelism over groups of model-parallel stages.

With S stages and R = len(ctx_list) / S replicas, replica ``r`` holds stage ``s`` on ``ctx_list[r*S + s]``:
four contexts and two stages give replica 0 = (cpu(0), cpu(1)) and replica 1 = (cpu(2), cpu(3)). The
batch is split across the replicas as ``split_and_load`` splits it; each replica runs its shard through
its stages; then the gradients of stage ``s`` are summed with ``parallel.allreduce`` across the R contexts
that hold stage ``s`` only (cpu(0) with cpu(2), cpu(1) with cpu(3)); then every replica takes the same step:

>>> import mxnet as mx
>>> from parallel import init_lenet_params
>>> from parallel.strategies import Hybrid
>>> model = Hybrid(init_lenet_params(seed=0), [mx.cpu(i) for i in range(4)], stages=2)
>>> model.describe()
'2 replicas x 2 stages: conv1,conv2 @ cpu(0),cpu(2) | dense1,dense2 @ cpu(1),cpu(3)'
>>> X, y = mx.nd.ones((8, 1, 28, 28)), mx.nd.array([0, 1, 2, 3, 4, 5, 6, 7])
>>> loss_sum, correct = model.train_step(X, y, lr=0.2)   # the same step as train_batch on one context

A gluon ``HybridSequential`` is cut at its children, as ``ModelParallel`` cuts it. The replicas run stage by
stage in lockstep (stage ``s`` on every replica, then stage ``s+1``), so a stage with BatchNorm normalises
over the whole batch, not over one replica's shard (``GluonNet.forward_all`` sums the statistics across the
contexts holding the stage): the same model as one context, and the same running statistics on every replica.
"""
from ..comm.reducer import as_reducer
from ..evaluate import accuracy
from ..models.lenet import softmax_cross_entropy
from ..step import step_replicas
from ..validate import BadValue, check_contexts
from .model import ModelParallel, _cut, _forward_all

__all__ = ["Hybrid", "hybrid_groups"]


def hybrid_groups(ctx_list, num_stages):
    """Group ``ctx_list`` into replicas of ``num_stages`` consecutive contexts.

    Returns
    -------
    list of list of mxnet.Context
        ``groups[r][s] == ctx_list[r * num_stages + s]``: replica ``r``'s stage ``s``.

    Raises
    ------
    ValueError
        Unless ``len(ctx_list)`` is a positive multiple of ``num_stages``.
    """
    check_contexts(ctx_list, needed=num_stages, what=f"{num_stages} stages")
    if len(ctx_list) % num_stages:
        lower = len(ctx_list) // num_stages * num_stages
        raise BadValue("ctx_list", f"{len(ctx_list)} contexts in {{ctx_list}} cannot form equal groups of "
                                   f"{num_stages} {{stages}}; use a multiple of {num_stages} contexts (e.g. {lower} or "
                                   f"{lower + num_stages})")
    return [list(ctx_list[r:r + num_stages]) for r in range(0, len(ctx_list), num_stages)]


class Hybrid:
    """R model-parallel replicas of S stages; stage gradients allreduced among the contexts holding that stage.

    Parameters
    ----------
    model : list of NDArray, or mxnet.gluon.nn.HybridSequential
        LeNet's eight parameters, or an initialized gluon ``HybridSequential`` with known shapes, cut at its
        children (see ``ModelParallel``); copied to every replica, not modified.
    ctx_list : list of mxnet.Context
        Distinct contexts, a multiple of the number of stages: replica ``r`` holds stage ``s`` on
        ``ctx_list[r*S + s]``.
    stages, boundaries
        Where to cut, see ``stage_ranges`` (default: two stages).
    reducer : parallel.Reducer or str, optional
        How each stage's gradients are summed over the R contexts holding it (``parallel.comm.Reducer``, or an
        algorithm's name); its buckets lay out each stage's replicas. One process, uncompressed.

    Attributes
    ----------
    replicas : list of ModelParallel
        ``replicas[r]`` runs on ``ctx_list[r*S:(r+1)*S]``; all hold the same values (and running statistics)
        after every step.
    nets : list of callable
        ``nets[s](X, params)`` runs stage ``s``, shared by the replicas.
    ranges, ctx_list, reducer
    """

    name = "hybrid"
    job = None

    def __init__(self, model, ctx_list, stages=None, boundaries=None, reducer=None):
        self.reducer = as_reducer(reducer)
        if self.reducer.job is not None or self.reducer.codec is not None:
            raise ValueError("reducer: the hybrid strategy sums its stages in one process, uncompressed; give it a "
                             "Reducer without a job or compression")
        cut = _cut(model, stages, boundaries)
        self.ranges, self.nets = cut.ranges, cut.nets
        groups = hybrid_groups(ctx_list, len(self.ranges))
        self.ctx_list = list(ctx_list)
        self._cut = cut
        self.replicas = [ModelParallel._from_cut(cut, group, self.reducer.bucket_mb) for group in groups]

    def __repr__(self):
        return f"Hybrid({self.describe()})"

    @property
    def model(self):
        """What the training loop returns: the strategy itself."""
        return self

    # ``parallel.step.step_replicas`` takes a Hybrid as its replicas: one model-parallel group of contexts each.
    @property
    def in_ctx_list(self):
        """Where each replica takes its shard: its first stage's context."""
        return [replica.ctx_list[0] for replica in self.replicas]

    @property
    def out_ctx_list(self):
        """Where each replica gives its outputs: its last stage's context."""
        return [replica.ctx_list[-1] for replica in self.replicas]

    def groups(self):
        """The trained arrays as ``parallel.optim.optimizer_step`` takes them: stage ``s``'s replicas form group
        ``s``, summed over the R contexts holding the stage (and sharded over them with ``zero``)."""
        return [[replica.stage_params[s] for replica in self.replicas] for s in range(len(self.ranges))]

    def describe(self, accumulate=1):
        """One line: each stage and the contexts holding it, e.g.
        '2 replicas x 2 stages: conv1,conv2 @ cpu(0),cpu(2) | dense1,dense2 @ cpu(1),cpu(3)' (for a block:
        'children 0-2 @ cpu(0),cpu(2) | 3-6 @ cpu(1),cpu(3)'). ``accumulate`` changes nothing here."""
        names = self._cut.labels
        return (f"{len(self.replicas)} replica{'s' if len(self.replicas) > 1 else ''} x {len(self.ranges)} "
                f"stage{'s' if len(self.ranges) > 1 else ''}: " +
                " | ".join(f"{name} @ {','.join(str(r.ctx_list[s]) for r in self.replicas)}"
                           for s, name in enumerate(names)))

    def params(self):
        """Replica 0's trainable arrays (every replica holds the same values), in ``ModelParallel.params``
        order: LeNet's eight, or the block's in ``block_state(block)[0]`` order."""
        return self.replicas[0].params()

    def aux(self, r=0):
        """Replica ``r``'s running statistics (identical on every replica) in ``block_state(block)[2]`` order;
        ``[]`` for LeNet."""
        return self.replicas[r].aux()

    def names(self):
        """The block's trainable parameter names, in ``params()`` order; ``[]`` for LeNet."""
        return self.replicas[0].names()

    def aux_names(self):
        """The names of ``aux()``'s arrays; ``[]`` for LeNet."""
        return self.replicas[0].aux_names()

    def forward_all(self, X_shards):
        """Outputs of each shard ``X_shards[r]`` through replica ``r``, stage by stage in lockstep.

        Stage ``s`` runs on every replica before stage ``s+1`` (``forward_all`` of the stage's net): in
        training, a block's BatchNorm normalises over all the shards together. Returns the outputs, each on
        its replica's last context; nothing waits for the devices.
        """
        replicas = self.replicas[:len(X_shards)]
        for s, net in enumerate(self.nets):
            X_shards = [X.as_in_context(replica.ctx_list[s]) for X, replica in zip(X_shards, replicas)]
            X_shards = _forward_all(net, X_shards, [replica.stage_params[s] for replica in replicas])
        return X_shards

    def train_step(self, X, y, lr=None, loss=softmax_cross_entropy, optimizer=None, accumulate=1):
        """One optimizer step: split across replicas, forward/backward through the stages, sum, update.

        Parameters
        ----------
        X, y : NDArray
            A batch of images and labels (any context, any batch size >= 1).
        lr : float, optional
            Plain SGD at this rate; the summed gradient is divided by the global batch size ``len(X)``.
        loss : callable
            ``loss(outputs, y)`` returns per-example losses.
        optimizer : parallel.optim.Optimizer, optional
            Instead of ``lr``: the update; with ``zero`` 1 or 2 each stage's state is sharded over the R
            contexts holding the stage.
        accumulate : int
            Micro-batches run one after another before the update (``parallel.step.step_replicas``).

        Returns
        -------
        (NDArray, NDArray)
            Summed loss and count of correct predictions, each (1,) on ``ctx_list[0]``, not yet computed.
            Every replica's parameters (and a block's running statistics) are updated in place.
        """
        return step_replicas(self, X, y, lr, loss, optimizer=optimizer, accumulate=accumulate)

    def evaluate(self, data_iter):
        """Accuracy over ``data_iter``, each batch split across the replicas (see ``parallel.evaluate.accuracy``)."""
        return accuracy(data_iter, [replica.forward for replica in self.replicas],
                        [replica.ctx_list[0] for replica in self.replicas])
