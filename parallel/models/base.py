"""The protocols a model's pieces declare, with their defaults, so that the step and the cutting read a member
rather than ask an object whether it has one (``strategies/base.py`` is the same for a strategy):

- ``Net``: a network of a step's replicas (``CachedNet``, ``GluonNet``, ``Recompute``, ``RankedNet``,
  ``LockstepNet``): whether its replicas are tensor groups recording on a tape, ``forward_all`` over every replica,
  the extra heads of its backward. A plain function ``net(X, params)`` is a network too, run one replica at a time
  (``parallel.models.recompute.run_net``).
- ``Cuttable``: a gluon block that says how recomputation cuts it finer (``parts()``) and how many inputs it takes.
- ``ParallelLayer``: a gluon layer that declares how its parameters split over tensor ranks (``shard_specs()``).

>>> class Doubling(Net):
...     def __call__(self, X, params):
...         return 2 * X
>>> net = Doubling()
>>> net.ranked, net.forward_all([1, 2], [None, None]), net.take_heads()
(False, [2, 4], ((), ()))
"""

__all__ = ["Net", "Cuttable", "ParallelLayer"]


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
