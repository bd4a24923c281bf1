"""The device mesh (``parallel.mesh``): its documented rank order, groups that partition it and meet once, the
replicas' numbering, and its refusals; and that the strategies place their arrays where it says."""
import itertools

import mxnet as mx
import pytest

from parallel.layout import Layout
from parallel.mesh import AXES, REPLICA_AXES, Coords, Mesh, Shape
from parallel.validate import BadValue

SHAPES = [dict(), dict(data=3), dict(data=2, stage=2, tensor=2), dict(data=2, expert=2, stage=3),
          dict(data=1, context=3, tensor=2), dict(data=2, expert=2, context=2, stage=2, tensor=2)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_a_rank_is_its_coordinates_in_the_documented_order(shape):
    mesh = Mesh(**shape)
    sizes = [shape.get(axis, 1) for axis in AXES]
    ranks = []
    for values in itertools.product(*[range(n) for n in sizes]):   # outermost first: the docstring's formula
        d, e, c, s, t = values
        expected = (((d * sizes[1] + e) * sizes[2] + c) * sizes[3] + s) * sizes[4] + t
        assert mesh.rank(**dict(zip(AXES, values))) == expected
        assert mesh.coords(expected) == Coords(*values)
        assert mesh.replica(expected) == (d * sizes[1] + e) * sizes[2] + c
        ranks.append(expected)
    assert ranks == list(range(mesh.size))


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_the_groups_of_an_axis_partition_the_mesh_and_two_axes_meet_once(shape):
    mesh = Mesh(**shape)
    for axes in [(axis,) for axis in AXES] + [REPLICA_AXES, ("stage", "tensor")]:
        groups = mesh.groups(*axes)
        assert sorted(r for g in groups for r in g.ranks) == list(range(mesh.size))
        size = 1
        for axis in axes:
            size *= getattr(mesh.shape, axis)
        assert all(len(g) == size for g in groups)
        for g in groups:   # along the group only its own axes change
            fixed = {axis for axis in AXES if axis not in axes}
            assert all({getattr(mesh.coords(r), axis) for r in g.ranks} == {getattr(g.fixed, axis)} for axis in fixed)
            assert all(mesh.group_of(r, *axes) == g for r in g.ranks)
    for a, b in itertools.combinations(AXES, 2):
        for ga in mesh.groups(a):
            for gb in mesh.groups(b):
                shared = set(ga.ranks) & set(gb.ranks)
                assert len(shared) <= 1
                assert bool(shared) == all(getattr(ga.fixed, x) == getattr(gb.fixed, x)
                                           for x in AXES if x not in (a, b))


def test_the_tensor_ranks_are_neighbours_and_the_replicas_far_apart():
    mesh = Mesh(data=2, stage=2, tensor=2)
    assert [g.ranks for g in mesh.groups("tensor")] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert [g.ranks for g in mesh.groups("data")] == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert [g.ranks for g in mesh.groups("stage")] == [(0, 2), (1, 3), (4, 6), (5, 7)]
    # not the other way round: the rank order is the documented one, not any partition
    assert [g.ranks for g in mesh.groups("data")] != [(0, 1), (2, 3), (4, 5), (6, 7)]


def test_experts_members_and_holders():
    mesh = Mesh(data=3, expert=2)
    assert mesh.replica_groups("expert") == [(0, 1), (2, 3), (4, 5)]   # each all-to-all group: consecutive
    assert mesh.holders(expert=0) == (0, 2, 4) and mesh.holders(expert=1) == (1, 3, 5)
    assert [mesh.replica_coords(r).expert for r in range(6)] == [0, 1, 0, 1, 0, 1]
    context = Mesh(data=2, context=2, tensor=2)
    assert context.replica_groups("context") == [(0, 1), (2, 3)]
    assert [g.ranks for g in context.groups("context")] == [(0, 2), (1, 3), (4, 6), (5, 7)]


def test_contexts_and_workers():
    ctx = [mx.cpu(i) for i in range(4)]
    mesh = Mesh(data=2, stage=2, contexts=ctx, workers=3, worker=1)
    assert mesh.context(replica=1, stage=0) == ctx[2]
    assert mesh.group("stage", data=1).contexts == (ctx[2], ctx[3])
    assert mesh.group("data").workers == 3 and mesh.group("stage").workers == 1
    assert [mesh.global_replica(r) for r in range(2)] == [2, 3]
    assert "worker 1 of 3" in repr(mesh)


@pytest.mark.parametrize("make, argument", [
    (lambda: Mesh(data=0), "data"),
    (lambda: Mesh(data=2, contexts=[mx.cpu(0)]), "contexts"),
    (lambda: Mesh(data=2).rank(data=2), "data"),
    (lambda: Mesh(data=2).rank(depth=1), "coords"),
    (lambda: Mesh(data=2).rank(replica=0, data=0), "replica"),
    (lambda: Mesh(data=2).groups("data", "data"), "axes"),
    (lambda: Mesh(data=2).group("data", data=1), "axes"),
    (lambda: Mesh(data=2).holders(stage=0), "fixed"),
    (lambda: Mesh(data=2).context(data=0), "contexts"),
    (lambda: Mesh(workers=2, worker=2), "worker"),
])
def test_refusals_name_the_argument(make, argument):
    with pytest.raises(BadValue) as error:
        make()
    assert error.value.argument == argument


def test_a_layout_places_its_axes_on_a_mesh_of_the_contexts_it_uses():
    ctx = [mx.cpu(i) for i in range(6)]
    mesh = Layout("model", stages=2).place(ctx)
    assert mesh.shape == Shape(stage=2) and mesh.contexts == tuple(ctx[:2])   # the model preset: the rest idle
    mesh = Layout("hybrid", stages=3).place(ctx, workers=2, worker=1)
    assert (mesh.replicas, mesh.shape.stage, mesh.workers) == (2, 3, 2)
    assert Layout(expert_parallel=2).place(4).shape == Shape(data=2, expert=2)
    assert Layout(context=2).place(4).replicas == 4   # each member of a context group is a replica of its own
