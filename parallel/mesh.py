"""The device mesh: a process's contexts (and a job's workers) as named axes, the one place ranks are computed.

A layout (``parallel.layout.Layout``) spreads a model over five axes. ``Mesh`` names them and fixes their order,
outermost first (torchtitan's ``DeviceMesh`` and Megatron-core's ``parallel_state`` do the same for theirs):

- ``data``: replicas that hold the same arrays and sum their gradients;
- ``expert``: members of an expert-parallel group (a mixture of experts' experts dealt over them, tokens sent
  between them by an all-to-all); with the data axis, the replicas of the step;
- ``context``: members that share each example's sequence (ring attention), each a replica of its own;
- ``stage``: the pipeline stages of a replica;
- ``tensor``: the ranks each layer is split over (Megatron-LM).

Rank ``((((d E + e) C + c) S + s) T + t)`` holds coordinate ``(d, e, c, s, t)``: the tensor ranks of a stage are
neighbours, then the stages of a replica, then the members of a context group and of an expert group. The first
three axes together are the step's *replicas*, numbered in the same order (``replica``): replica
``(d E + e) C + c``. A *group* is the ranks along some axes with the other coordinates fixed (``groups``): the
groups along an axis partition the mesh, and those of two different axes meet in exactly one rank.

>>> mesh = Mesh(data=2, stage=2, tensor=2)
>>> mesh.size, mesh.rank(data=1, stage=0, tensor=1), mesh.coords(5)
(8, 5, Coords(data=1, expert=0, context=0, stage=0, tensor=1))
>>> [g.ranks for g in mesh.groups("tensor")]       # each stage's ranks: neighbours
[(0, 1), (2, 3), (4, 5), (6, 7)]
>>> [g.ranks for g in mesh.groups("data")]         # the replicas of each stage's rank: summed together
[(0, 4), (1, 5), (2, 6), (3, 7)]
>>> Mesh(data=2, expert=2).groups("expert")[1].ranks, Mesh(data=2, expert=2).holders(expert=1)
((2, 3), (1, 3))

With contexts a rank is a context (``context``, ``Group.contexts``); in a job the data axis goes on over the
workers (``workers``, ``worker``): worker ``w``'s replica ``r`` is the job's replica ``w R + r`` of its ``R`` a
worker (``global_replica``), and a group along the data axis spans the workers (``Group.workers``).
Nothing here imports MXNet.
"""
import itertools
from typing import NamedTuple, Optional, Tuple

from .validate import BadValue, check_int

__all__ = ["Mesh", "Group", "Coords", "Shape", "AXES", "REPLICA_AXES"]

#: The axes, outermost first: the order of a rank's coordinates.
AXES = ("data", "expert", "context", "stage", "tensor")

#: The axes whose coordinates together number the step's replicas.
REPLICA_AXES = ("data", "expert", "context")


class Coords(NamedTuple):
    """A rank's coordinate on each axis."""
    data: int = 0
    expert: int = 0
    context: int = 0
    stage: int = 0
    tensor: int = 0


class Shape(NamedTuple):
    """Each axis's size."""
    data: int = 1
    expert: int = 1
    context: int = 1
    stage: int = 1
    tensor: int = 1


class Group(NamedTuple):
    """The ranks along ``axes`` with the other coordinates fixed (``fixed``), in rank order; their ``contexts``
    (None for a mesh without contexts); ``workers``: how many workers' copies of the group a collective over it
    spans (the job's workers when the group runs along the data axis, else 1)."""
    axes: Tuple[str, ...]
    fixed: Coords
    ranks: Tuple[int, ...]
    contexts: Optional[tuple]
    workers: int

    def __len__(self):
        return len(self.ranks)


class Mesh:
    """Named axes over ranks (see the module's docstring).

    Parameters
    ----------
    data, expert, context, stage, tensor : int
        Each axis's size (at least 1).
    contexts : sequence of mxnet.Context, optional
        The context of each rank, in rank order (``len(contexts) == size``); None for a mesh of ranks alone.
    workers, worker : int
        The job's workers and this process's rank among them (1 and 0 in one process): the data axis goes on over
        them.
    """

    def __init__(self, data=1, expert=1, context=1, stage=1, tensor=1, contexts=None, workers=1, worker=0):
        sizes = dict(data=data, expert=expert, context=context, stage=stage, tensor=tensor)
        for axis, n in sizes.items():
            check_int(n, axis, low=1)
        self.shape = Shape(**sizes)
        self.size = data * expert * context * stage * tensor
        self.workers = check_int(workers, "workers", low=1)
        self.worker = check_int(worker, "worker", low=0, high=workers - 1)
        if contexts is not None:
            contexts = tuple(contexts)
            if len(contexts) != self.size:
                raise BadValue("contexts", f"a mesh of {' x '.join(map(str, self.shape))} = {self.size} ranks takes "
                                           f"{self.size} contexts, got {len(contexts)}")
        self.contexts = contexts

    def __repr__(self):
        axes = ", ".join(f"{axis}={n}" for axis, n in zip(AXES, self.shape) if n > 1) or "one rank"
        job = f", worker {self.worker} of {self.workers}" if self.workers > 1 else ""
        return f"Mesh({axes}{job})"

    def __eq__(self, other):
        return (isinstance(other, Mesh) and (self.shape, self.contexts, self.workers, self.worker) ==
                (other.shape, other.contexts, other.workers, other.worker))

    __hash__ = None

    # ---- ranks and coordinates -----------------------------------------------------------------------------------

    @property
    def replicas(self):
        """The step's replicas in this process: the product of the data, expert and context axes."""
        return self.shape.data * self.shape.expert * self.shape.context

    def rank(self, replica=None, **coords):
        """The rank at ``coords`` (axis names; an axis not given is 0). ``replica`` instead of the data, expert and
        context coordinates: the replica's number (``replica``)."""
        if replica is not None:
            if set(coords) & set(REPLICA_AXES):
                raise BadValue("replica", "give {replica} or the data, expert and context coordinates, not both")
            at = self.replica_coords(replica)
            coords.update((axis, getattr(at, axis)) for axis in REPLICA_AXES)
        unknown = set(coords) - set(AXES)
        if unknown:
            raise BadValue("coords", f"{sorted(unknown)} are not axes of a mesh; its axes are {', '.join(AXES)}")
        rank = 0
        for axis, n in zip(AXES, self.shape):
            i = check_int(coords.get(axis, 0), axis, low=0, high=n - 1)
            rank = rank * n + i
        return rank

    def coords(self, rank):
        """Rank ``rank``'s coordinates (``Coords``)."""
        rank = check_int(rank, "rank", low=0, high=self.size - 1)
        values = []
        for n in reversed(self.shape):
            rank, i = divmod(rank, n)
            values.append(i)
        return Coords(*reversed(values))

    def replica(self, rank):
        """The number of the replica rank ``rank`` belongs to: ``(d E + e) C + c``."""
        c = self.coords(rank)
        return (c.data * self.shape.expert + c.expert) * self.shape.context + c.context

    def replica_coords(self, replica):
        """Replica ``replica``'s data, expert and context coordinates (a ``Coords``, its stage and tensor 0)."""
        replica = check_int(replica, "replica", low=0, high=self.replicas - 1)
        rest, c = divmod(replica, self.shape.context)
        d, e = divmod(rest, self.shape.expert)
        return Coords(data=d, expert=e, context=c)

    def global_replica(self, replica):
        """Replica ``replica`` of this worker as the job numbers it: ``worker R + replica``."""
        return self.worker * self.replicas + check_int(replica, "replica", low=0, high=self.replicas - 1)

    def context(self, replica=None, **coords):
        """The context of the rank at ``coords`` (``rank``'s arguments)."""
        if self.contexts is None:
            raise BadValue("contexts", "this mesh has ranks alone: give it contexts")
        return self.contexts[self.rank(replica, **coords)]

    # ---- groups -----------------------------------------------------------------------------------------------------

    def groups(self, *axes):
        """Every group along ``axes`` (axis names, outermost first as ``AXES`` orders them), in the order of their
        first ranks: a partition of the mesh. ``groups()`` is each rank alone; ``groups(*AXES)`` the whole mesh."""
        self._check_axes(axes)
        others = [axis for axis in AXES if axis not in axes]
        made = []
        for values in itertools.product(*[range(getattr(self.shape, axis)) for axis in others]):
            made.append(self.group(*axes, **dict(zip(others, values))))
        return sorted(made, key=lambda g: g.ranks[0])

    def group(self, *axes, **fixed):
        """The group along ``axes`` through the coordinates ``fixed`` (of the other axes; those not given are 0)."""
        self._check_axes(axes)
        clash = set(axes) & set(fixed)
        if clash:
            raise BadValue("axes", f"{sorted(clash)} cannot run along the group and be fixed")
        at = Coords(**fixed)
        ranks = tuple(self.rank(**dict(at._asdict(), **dict(zip(axes, values))))
                      for values in itertools.product(*[range(getattr(self.shape, axis)) for axis in axes]))
        contexts = None if self.contexts is None else tuple(self.contexts[r] for r in ranks)
        return Group(tuple(axes), at, ranks, contexts, self.workers if "data" in axes else 1)

    def group_of(self, rank, *axes):
        """The group along ``axes`` that holds rank ``rank``."""
        at = self.coords(rank)
        return self.group(*axes, **{axis: getattr(at, axis) for axis in AXES if axis not in axes})

    def holders(self, **fixed):
        """The replicas (numbers, in order) whose coordinates are ``fixed`` (of the data, expert and context axes):
        ``holders(expert=m)``, the replicas that hold expert-parallel member ``m``'s experts."""
        unknown = set(fixed) - set(REPLICA_AXES)
        if unknown:
            raise BadValue("fixed", f"{sorted(unknown)} are not replica axes ({', '.join(REPLICA_AXES)})")
        return tuple(r for r in range(self.replicas)
                     if all(getattr(self.replica_coords(r), axis) == i for axis, i in fixed.items()))

    def replica_groups(self, *axes):
        """The groups of replicas (numbers) along ``axes`` of the replica axes: ``replica_groups("expert")``, each
        expert-parallel group's members; ``replica_groups("context")``, each context group's."""
        unknown = set(axes) - set(REPLICA_AXES)
        if unknown:
            raise BadValue("axes", f"{sorted(unknown)} are not replica axes ({', '.join(REPLICA_AXES)})")
        return [tuple(self.replica(r) for r in group.ranks) for group in self.groups(*axes)
                if group.fixed.stage == 0 and group.fixed.tensor == 0]

    def _check_axes(self, axes):
        unknown = [axis for axis in axes if axis not in AXES]
        if unknown or len(set(axes)) != len(axes):
            raise BadValue("axes", f"{list(axes)} must be distinct axes of a mesh: {', '.join(AXES)}")
