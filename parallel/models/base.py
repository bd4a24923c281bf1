"""The protocols a model's pieces declare, with their defaults, so that the step and the cutting read a member
rather than ask an object whether it has one (``strategies/base.py`` is the same for a strategy):

- ``Net``: a network of a step's replicas (``CachedNet``, ``GluonNet``, ``Recompute``, ``RankedNet``,
  ``LockstepNet``): whether its replicas are tensor groups recording on a tape, ``forward_all`` over every replica,
  the extra heads of its backward. A plain function ``net(X, params)`` is a network too, run one replica at a time
  (``parallel.models.recompute.run_net``).
- ``Cuttable``: a gluon block that says how recomputation cuts it finer (``parts()``) and how many inputs it takes.
- ``ParallelLayer``: a gluon layer that declares how its parameters split over tensor ranks (``shard_specs()``).
- ``ParallelF``: the ``F`` a layout runs a model's blocks with (``RanksF`` on a tensor group's ranks, ``ReplicasF``
  on replicas in lockstep), declared: ``mx.nd``'s operators and the *seams*, the few places where a model's
  mathematics may take a parallel form. A model calls the seams as functions of its ``F`` (``split_tokens``,
  ``attention``, ``mark_kept``, ``gather_tokens``, ``mixture``, here): with ``mx.nd`` or ``mx.sym`` each is the
  mathematics itself (the identity, dot-product attention, nothing, a mixture of experts routing its tokens on one
  array); with a ``ParallelF`` it is the proxy's method, which knows its axes (a slice of the sequence, ring
  attention, a gather, every replica's tokens routed as one queue and sent to their experts' replicas). So a model
  file (``vit.py``, ``transformer.py``, ``moe.py``) names no axis and asks its ``F`` nothing: what a layout does at
  a seam is the proxy's, and a new axis touches the proxy, not the models.

>>> class Doubling(Net):
...     def __call__(self, X, params):
...         return 2 * X
>>> net = Doubling()
>>> net.ranked, net.forward_all([1, 2], [None, None]), net.take_heads()
(False, [2, 4], ((), ()))

The seams with ``mx.nd``, the mathematics itself:

>>> import mxnet as mx
>>> x = mx.nd.ones((2, 3, 4))
>>> split_tokens(mx.nd, x) is x, gather_tokens(mx.nd, x) is x, mark_kept(mx.nd, x) is None
(True, True, True)
>>> attention(mx.nd, x, x, x, 0.5).shape
(2, 3, 4)
"""

import mxnet as mx

from ..validate import BadType

__all__ = ["Net", "Cuttable", "ParallelLayer", "ParallelF", "split_tokens", "attention", "dot_product_attention",
           "mark_kept", "gather_tokens", "mixture"]


class Net:
    """A network ``net(X, params)`` of a replica, declared: what ``run_net`` and ``Blocks`` read of it.

    Attributes
    ----------
    ranked : bool
        Each replica is a tensor-parallel group whose ranks record on a tape: ``forward_all`` takes the tape as
        its third argument. False by default.
    tensor : int or None
        For a ranked net that knows it: the ranks of each replica's group, which its tape's collectives span
        (``SegmentTape(group=tensor)``). None by default.
    """
    ranked = False
    tensor = None

    def forward_all(self, X_shards, parts):
        """Every replica's output, ``parts[r]`` replica ``r``'s arrays; by default ``self(X, part)`` one replica
        at a time. A net that runs the replicas together (synchronized BatchNorm, lockstep) overrides it."""
        return [self(X, part) for X, part in zip(X_shards, parts)]

    def take_heads(self):
        """What the last recorded run added to the loss besides its outputs, ``(heads, gradients)``, once (a
        mixture of experts' auxiliary losses); by default nothing."""
        return (), ()

    def idle_all(self, parts):
        """What the net makes in a forward where none of the replicas ``parts`` has an example (a job's worker
        without one, an empty micro-batch): nothing by default; a ``GluonNet`` in a job's step gathers each
        BatchNorm's statistics with the other workers and updates the running statistics with them."""


class Cuttable:
    """A gluon block that says how ``GluonModel.units`` cuts it (a mixin beside its gluon base class).

    Attributes
    ----------
    num_inputs : int
        The arrays its forward takes (1 by default): a block cut out of another may take two.
    """
    num_inputs = 1

    def parts(self):
        """The blocks it is cut into, run one after the other; by default itself, whole."""
        return [self]


class ParallelLayer:
    """A gluon layer whose parameters split over tensor ranks (a mixin beside its gluon base class)."""

    def shard_specs(self):
        """``{attribute: spec}`` (``parallel.shard``) of the parameters it splits; the others are replicated. By
        default none is split."""
        return {}


# ---- the seams: where a model's mathematics may take a parallel form -------------------------------------------

def dot_product_attention(F, q, k, v, scale):
    """``softmax(q k^T * scale) v`` with ``F``'s operators: ``q``, ``k``, ``v`` of shape ``(B, S, d)`` (a head of an
    example a row of B)."""
    weights = F.softmax(F.batch_dot(q * scale, k, transpose_b=True), axis=-1)   # (B, S, S)
    return F.batch_dot(weights, v)


def _mixture_alone(layer, x, weights):
    """A mixture of experts ``layer`` on the tokens of ``x`` alone, one queue, every expert on ``x``'s context."""
    return layer.forward_all([x], [[w] for w in weights], [(0,)])[0]


class ParallelF:
    """The ``F`` of a parallel layout (a mixin of the proxies ``RanksF`` and ``ReplicasF``): ``mx.nd``'s operators
    (the proxy's own) and the seams, each by default what ``mx.nd`` does at it, overridden where an axis of the
    proxy changes it. The model calls them through the functions of the same name (``split_tokens(F, x)``)."""

    def split_tokens(self, x, axis=1):
        """The tokens (along ``axis``) this ``F``'s arrays compute on from here on; by default all of them."""
        return x

    def attention(self, q, k, v, scale):
        """Each query's attention over the keys and values of its sequence; by default ``dot_product_attention``."""
        return dot_product_attention(self, q, k, v, scale)

    def mark_kept(self, *values):
        """Count ``values`` as the activations a block keeps outside its layers (the residual stream, the layer
        norms' inputs); by default nothing."""

    def gather_tokens(self, x, axis=1):
        """Every token of the sequence (along ``axis``) again, where ``split_tokens`` kept some; by default ``x``."""
        return x

    def mixture(self, layer, x, *weights):
        """The mixture of experts ``layer`` on the tokens of ``x`` (``weights``: its arrays as this ``F`` gives
        them); by default ``layer.forward_all`` on ``x`` alone (what ``mx.nd`` does)."""
        return _mixture_alone(layer, x, weights)


def split_tokens(F, x, axis=1):
    """The seam where a model's tokens ``x`` enter its blocks: ``x`` itself with ``mx.nd`` or ``mx.sym``, else
    ``F.split_tokens`` (a ``ParallelF``'s share of the sequence)."""
    return F.split_tokens(x, axis) if isinstance(F, ParallelF) else x


def attention(F, q, k, v, scale):
    """The seam of self-attention, ``softmax(q k^T * scale) v`` over the sequence: ``dot_product_attention`` with
    ``mx.nd`` or ``mx.sym``, else ``F.attention`` (which may hold a slice of the sequence and go round a ring)."""
    if isinstance(F, ParallelF):
        return F.attention(q, k, v, scale)
    return dot_product_attention(F, q, k, v, scale)


def mark_kept(F, *values):
    """The seam that names the activations a block keeps between its layers (``F.mark_kept``: what a layout's
    memory accounting counts); nothing with ``mx.nd`` or ``mx.sym``. Returns None."""
    if isinstance(F, ParallelF):
        F.mark_kept(*values)


def gather_tokens(F, x, axis=1):
    """The seam where the model needs every token again (its head): ``x`` with ``mx.nd`` or ``mx.sym``, else
    ``F.gather_tokens``."""
    return F.gather_tokens(x, axis) if isinstance(F, ParallelF) else x


def mixture(F, layer, x, *weights):
    """The seam of a mixture of experts (``parallel.models.moe.MoEFeedForward``, ``layer``; ``weights`` its router's
    and experts' arrays): ``layer.forward_all`` routing the tokens of ``x`` alone with ``mx.nd``; else
    ``F.mixture`` (which may route every replica's tokens as one queue and send them to the replicas holding their
    experts). Refused with ``mx.sym`` (``BadType`` naming ``F``): routing reads the router's values on the host."""
    if isinstance(F, ParallelF):
        return F.mixture(layer, x, *weights)
    if F is not mx.nd:
        raise BadType("F", "an MoE layer routes its tokens on the host and cannot run as a symbol (a cached "
                           "graph, hybridize(), export); run it imperatively")
    return _mixture_alone(layer, x, weights)
