"""A mixture-of-experts feed-forward layer (Shazeer et al. 2017; GShard, Lepikhin et al. 2020; Switch, Fedus et
al. 2021), and expert parallelism: its experts spread over the contexts of an expert-parallel group, the tokens
sent to their experts and back by an all-to-all written here from copies between contexts.

What one forward does, for tokens ``(..., dim)`` (every token of every example: a ViT's 17 a picture):

1. **Route.** A router (one dense layer, no bias) scores each token for each of ``E`` experts; a softmax makes
   the scores probabilities. Each token picks its ``top_k`` experts (ties to the lower index).
2. **Capacity.** An expert takes at most ``capacity = ceil(capacity_factor * top_k * T / E)`` of the T tokens'
   choices. Choices queue in order: every token's first choice, in token order, then every token's second. A
   choice past its expert's capacity is *dropped*: the token gets nothing from that expert, and goes on through
   the residual connection around the layer (the layer adds nothing for it).
3. **Experts.** Each expert is an MLP ``Dense(hidden), GELU, Dense(dim)`` of its own, run on its queue of tokens.
4. **Combine.** A token's output is its choices' outputs weighted by their gates: with ``top_k`` 1 the chosen
   expert's probability (Switch), with more the chosen probabilities normalized to sum to 1 (GShard); each gate
   times ``gate_scale`` (DeepSeek-V2's routed scaling factor; 1: none).
5. **Auxiliary losses.** Switch's load-balancing loss ``aux_weight * E * sum_e f_e P_e`` (``f_e`` the fraction of
   tokens whose first choice is expert ``e``, ``P_e`` the mean probability the router gives it: smallest when both
   are uniform), and optionally the router's z-loss ``z_weight * mean(logsumexp(scores)^2)`` (ST-MoE, Zoph et
   al. 2022), which keeps the scores small. The training step adds them to the loss (``aux_losses``).

Routing is decided on the host: the router's probabilities are read back (one wait a layer a forward, T x E
floats), the choices, queues and drops computed with numpy, and the tokens moved by index (``take``). So the
decisions are exact and the same whatever the layout: over the replicas of a step, the queues are one queue in
the order of the whole batch (replica 0's tokens, then replica 1's, ...), and the capacity is the whole batch's;
K replicas drop exactly the tokens one context drops. So do slices of the same examples: context groups' members
and, with sequence parallelism, a tensor group's ranks (each holding its slice of its replica's tokens) route their
slices as one queue in one context's order (``_one_queue``, over the groups ``forward_all`` is given), and a rank
sends its tokens to the same rank of the member holding their experts.

**Expert parallelism** (``expert_parallel`` P, GShard's and DeepSpeed-MoE's): the replicas of a step form groups
of P consecutive replicas; member ``p`` of a group holds experts ``p E / P`` .. ``(p + 1) E / P - 1`` (its
``fc*`` arrays are those experts': ``expert_specs``). Each replica sends every expert's tokens to the member that
holds it, one array a destination (the all-to-all's dispatch), the member runs its experts on the tokens of its
whole group, and sends each replica its outputs back (the combine): ``2 x 4 x dim`` bytes a token-choice that
leaves its replica, forward, and as many again backward, where autograd sends the gradients back the same way.
The router and everything else are ordinary data parallelism. An expert's gradient is summed over the groups
(the replicas that hold the same experts), the rest over every replica (``parallel.strategies.Hybrid``).

This file holds the mathematics only: ``hybrid_forward`` calls the seam ``parallel.models.base.mixture``, which
runs ``forward_all`` on the layer's input alone with ``mx.nd`` (routing needs the values: imperatively, on one
context), and with the ``F`` of a layout runs it as the layout needs: on the replicas of a step in lockstep
(``parallel.models.layers.run_replicas``), every replica's tokens at once, the proxy saying which arrays are one
queue, which share their experts and which hold slices of the same examples. The layer does not run as a symbol
(a cached graph cannot read the router's choices: the seam refuses ``mx.sym``), nor split over a tensor group.

>>> import mxnet as mx
>>> layer = MoEFeedForward(dim=4, hidden=8, experts=2)
>>> layer.initialize(mx.init.Normal(0.5))
>>> X = mx.nd.random.normal(shape=(3, 5, 4))
>>> out = layer(X)
>>> out.shape, int(layer.last.routed.sum()), layer.last.capacity   # 15 tokens, each to one of 2 experts
((3, 5, 4), 15, 8)
"""
import math
from typing import List, NamedTuple

import mxnet as mx
import numpy as np
from mxnet.gluon import nn

from ..comm import algorithms
from ..shard import Split
from ..validate import BadType, BadValue, check_int
from .base import mixture

__all__ = ["Experts", "as_experts", "MoEFeedForward", "Routing", "route", "moe_layers", "aux_losses",
           "RoutingStats", "capacity_of", "RoutingMeter", "check_shared", "expert_specs"]


def _check_positive(value, name):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadType(name, f"{{{name}}} must be a number, got {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise BadValue(name, f"{{{name}}} must be a finite number above 0, got {value!r}")
    return float(value)


def _check_weight(value, name):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadType(name, f"{{{name}}} must be a number, got {value!r}")
    if not (math.isfinite(value) and value >= 0):
        raise BadValue(name, f"{{{name}}} must be a finite number of at least 0, got {value!r}")
    return float(value)


class Experts(NamedTuple):
    """A mixture of experts' settings (``MoEFeedForward``'s but the sizes): ``count`` experts, each token to
    ``top_k``, each expert at most ``capacity_factor`` x its even share, the auxiliary losses' weights.

    >>> Experts(4, top_k=2)
    Experts(count=4, top_k=2, capacity_factor=1.0, aux_weight=0.01, z_weight=0.0, gate_scale=1.0)
    """
    count: int
    top_k: int = 1
    capacity_factor: float = 1.0
    aux_weight: float = 0.01
    z_weight: float = 0.0
    gate_scale: float = 1.0

    def layer(self, dim, hidden):
        """The ``MoEFeedForward`` of these settings for tokens of ``dim``, experts of ``hidden`` units."""
        return MoEFeedForward(dim, hidden, self.count, self.top_k, self.capacity_factor, self.aux_weight,
                              self.z_weight, self.gate_scale)


def as_experts(experts):
    """A model's ``experts`` argument as its ``Experts``: one itself, a count E (0: None), or None.

    >>> as_experts(4), as_experts(0), as_experts(Experts(2, top_k=2)).top_k
    (Experts(count=4, top_k=1, capacity_factor=1.0, aux_weight=0.01, z_weight=0.0, gate_scale=1.0), None, 2)
    """
    if isinstance(experts, int) and not isinstance(experts, bool):
        return Experts(experts) if experts else None
    if experts is not None and not isinstance(experts, Experts):
        raise BadType("experts", f"{{experts}} must be an Experts or a number of experts, got {experts!r}")
    return experts


def capacity_of(tokens, experts, top_k, capacity_factor):
    """The most token-choices an expert takes: ``ceil(capacity_factor * top_k * tokens / experts)``."""
    return int(math.ceil(capacity_factor * top_k * tokens / experts))


class Routing(NamedTuple):
    """Where T tokens go (``route``): ``choice[t, j]`` token ``t``'s ``j``-th expert, ``slot[t, j]`` its place in
    that expert's queue (-1: dropped), ``routed[e]`` the choices made of expert ``e`` (dropped or not),
    ``first[e]`` the tokens whose first choice is ``e``, ``capacity`` an expert's most."""
    choice: np.ndarray
    slot: np.ndarray
    routed: np.ndarray
    first: np.ndarray
    capacity: int


def route(probs, top_k, capacity, order=None):
    """Route tokens of router probabilities ``probs`` (T x E numpy) to their ``top_k`` experts, each expert taking
    at most ``capacity`` choices, first choices of every token first, each in token order: a ``Routing``.
    ``order``: the tokens' order in the queues when it is not the rows' (``order[i]`` the row queued ``i``-th);
    the ``Routing`` is still by row.

    >>> routing = route(np.array([[0.9, 0.1], [0.8, 0.2], [0.3, 0.7]]), top_k=1, capacity=1)
    >>> routing.choice[:, 0].tolist(), routing.slot[:, 0].tolist(), routing.routed.tolist()
    ([0, 0, 1], [0, -1, 0], [2, 1])
    """
    if order is not None:
        queued = route(probs[order], top_k, capacity)
        rows = np.argsort(order)   # each row's place in the queue order
        return queued._replace(choice=queued.choice[rows], slot=queued.slot[rows])
    T, E = probs.shape
    choice = np.argsort(-probs, axis=1, kind="stable")[:, :top_k]
    slot = np.full((T, top_k), -1, dtype=np.int64)
    counts = np.zeros(E, dtype=np.int64)
    for j in range(top_k):
        experts = choice[:, j]
        onehot = np.zeros((T, E), dtype=np.int64)
        onehot[np.arange(T), experts] = 1
        place = np.cumsum(onehot, axis=0)[np.arange(T), experts] - 1 + counts[experts]
        slot[:, j] = np.where(place < capacity, place, -1)
        counts += onehot.sum(axis=0)
    first = np.bincount(choice[:, 0], minlength=E)
    return Routing(choice, slot, counts, first, capacity)


class RoutingStats(NamedTuple):
    """What a layer's last forward did: ``routed[e]`` choices of expert ``e``, ``dropped`` choices past
    capacity of ``choices`` in all, ``capacity``, ``aux`` the auxiliary loss of each replica (recorded arrays; their
    sum is the layer's loss; none when both weights are 0), ``sent_bytes`` what the all-to-all copied between contexts (forward), ``routing``
    the whole batch's ``Routing`` (which token went where, which choices were dropped)."""
    routed: np.ndarray
    dropped: int
    choices: int
    capacity: int
    aux: List[object]
    sent_bytes: int
    routing: Routing
    #: How many copies of the routing ``aux`` holds the losses of (each rank of a tensor-parallel group routes the
    #: same tokens and computes its own auxiliary losses, Megatron's way: the layer's loss is their sum / copies).
    copies: int = 1


class MoEFeedForward(nn.HybridBlock):
    """A mixture-of-experts MLP on tokens ``(..., dim)`` (see the module's docstring).

    Parameters
    ----------
    dim : int
        The tokens' width.
    hidden : int
        Each expert's hidden units.
    experts : int
        E, the experts (at least 2).
    top_k : int
        The experts a token goes to (1: Switch; 2: GShard), at most E.
    capacity_factor : float
        An expert takes at most ``ceil(capacity_factor * top_k * T / E)`` of T tokens' choices; ``E / top_k`` or
        more never drops one.
    aux_weight : float
        The load-balancing loss's weight (Switch's 0.01); 0: none.
    z_weight : float
        The router z-loss's weight (ST-MoE's 0.001); 0 (the default): none.
    gate_scale : float
        Every gate times this (DeepSeek-V2's ``routed_scaling_factor``); 1 (the default): Switch's and GShard's
        gates. With top-1 and the load-balancing loss keeping the router near uniform, a gate stays near ``1 / E``;
        ``E`` gives a chosen expert about the weight the dense MLP has (docs/experts.md).

    Attributes
    ----------
    last : RoutingStats
        The last forward's routing.
    """

    def __init__(self, dim, hidden, experts, top_k=1, capacity_factor=1.0, aux_weight=0.01, z_weight=0.0,
                 gate_scale=1.0, **kwargs):
        super().__init__(**kwargs)
        self._dim, self._hidden = check_int(dim, "dim", low=1), check_int(hidden, "hidden", low=1)
        self._experts = check_int(experts, "experts", low=2)
        self._top_k = check_int(top_k, "top_k", low=1, high=self._experts)
        self._capacity_factor = _check_positive(capacity_factor, "capacity_factor")
        self._aux_weight, self._z_weight = _check_weight(aux_weight, "aux_weight"), _check_weight(z_weight, "z_weight")
        self._gate_scale = _check_positive(gate_scale, "gate_scale")
        self.last = None
        with self.name_scope():
            self.router_weight = self.params.get("router_weight", shape=(experts, dim))
            self.fc1_weight = self.params.get("fc1_weight", shape=(experts, hidden, dim))
            self.fc1_bias = self.params.get("fc1_bias", shape=(experts, hidden), init="zeros")
            self.fc2_weight = self.params.get("fc2_weight", shape=(experts, dim, hidden))
            self.fc2_bias = self.params.get("fc2_bias", shape=(experts, dim), init="zeros")

    @property
    def experts(self):
        return self._experts

    def __repr__(self):
        return (f"MoEFeedForward({self._dim} -> {self._experts} experts of {self._hidden} units, top-{self._top_k}, "
                f"capacity factor {self._capacity_factor:g})")

    def expert_specs(self):
        """``{attribute: spec}`` of the arrays expert parallelism splits (each expert's MLP: along the experts'
        axis, ``Split(0)``); the router is replicated."""
        return {name: Split(0) for name in ("fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias")}

    def hybrid_forward(self, F, x, router_weight, fc1_weight, fc1_bias, fc2_weight, fc2_bias):
        # the seam: this layer on x alone with mx.nd, every replica's tokens as one queue on a layout's F
        return mixture(F, self, x, router_weight, fc1_weight, fc1_bias, fc2_weight, fc2_bias)

    def forward_all(self, xs, weights, groups, slices=None):
        """The layer on several arrays of tokens at once, routed as one queue: ``xs`` the arrays (each on its
        context), ``weights`` the layer's five arrays (router, ``fc1`` weight and bias, ``fc2`` weight and bias),
        each a list of one an array of ``xs``; ``groups`` the arrays (their positions in ``xs``) of each group that
        shares its experts (each member holding its ``E / len(group)``, ``Mesh.replica_groups("expert")``);
        ``slices`` the arrays that hold slices of the same examples' tokens, slice after slice (a tuple of positions
        a group, in the batch's order; None: no array shares its examples), queued in one context's order. Returns
        the outputs, one an array, and sets ``last``. What the seam ``parallel.models.base.mixture`` runs: on one
        array with ``mx.nd``, on every replica of a layout with its ``F``. Waits for the router (``route``)."""
        order = None if slices is None else _one_queue(slices, [x.shape for x in xs])
        return self._forward(xs, *weights, groups, order)

    def _forward(self, xs, routers, w1s, b1s, w2s, b2s, groups, order=None):
        """``forward_all`` with the arrays' queue ``order`` (where each token of the arrays' (concatenated) is in one
        context's queue, when the two differ: ``_one_queue``)."""
        E, k, dim = self._experts, self._top_k, self._dim
        group = len(groups[0])
        check_shared([self], group)
        held = E // group
        for r, w in enumerate(w1s):
            if w.shape[0] != held:
                raise BadValue("expert_parallel", f"replica {r} holds {w.shape[0]} experts where {{expert_parallel="
                                                  f"{group}}} deals {held} a context; give each its experts' arrays")
        tokens = [x.reshape((-1, dim)) for x in xs]
        logits = [mx.nd.FullyConnected(t, w, no_bias=True, num_hidden=E) for t, w in zip(tokens, routers)]
        probs = [mx.nd.softmax(s, axis=-1) for s in logits]
        counts = [t.shape[0] for t in tokens]
        T = sum(counts)
        capacity = capacity_of(T, E, k, self._capacity_factor)
        routing = route(np.concatenate([p.asnumpy() for p in probs]), k, capacity, order)   # waits for the router
        starts = np.cumsum([0] + counts)
        outputs, sent = [None] * len(xs), 0
        for members in groups:
            outs, moved = self._group([tokens[r] for r in members], [probs[r] for r in members],
                                      [(w1s[r], b1s[r], w2s[r], b2s[r]) for r in members],
                                      [(starts[r], starts[r + 1]) for r in members], routing, held)
            sent += moved
            for r, out in zip(members, outs):
                outputs[r] = out.reshape_like(xs[r])
        first = mx.nd.array(routing.first / T, dtype=xs[0].dtype)
        weighted = self._aux_weight or self._z_weight   # else no auxiliary loss: nothing for backward to start from
        aux = [self._aux(p, s, first, T) for p, s in zip(probs, logits)] if weighted else []
        self.last = RoutingStats(routing.routed, int((routing.slot < 0).sum()), routing.slot.size, capacity,
                                 aux, sent, routing)
        return outputs

    def _aux(self, probs, logits, first, T):
        """This replica's part of the auxiliary losses (they add up over the replicas to the batch's): Switch's
        ``aux_weight E sum_e f_e P_e``, ``P_e`` its tokens' probabilities summed over T, and the z-loss."""
        loss = mx.nd.zeros((1,), ctx=probs.context, dtype=probs.dtype)
        if self._aux_weight:
            f = first.as_in_context(probs.context)
            loss = loss + mx.nd.sum(mx.nd.broadcast_mul(probs, f.reshape((1, -1)))) * (
                self._aux_weight * self._experts / T)
        if self._z_weight:
            top = mx.nd.max(logits, axis=1, keepdims=True).detach()
            lse = mx.nd.log(mx.nd.sum(mx.nd.exp(mx.nd.broadcast_sub(logits, top)), axis=1)) + top.reshape((-1,))
            loss = loss + mx.nd.sum(lse * lse) * (self._z_weight / T)
        return loss.reshape((1,))

    def _group(self, tokens, probs, experts, bounds, routing, held):
        """One expert-parallel group: its members' ``tokens`` (rows ``bounds`` of the whole batch's routing) sent
        to the members holding their experts, run, sent back and combined. Returns (outputs, bytes copied)."""
        plans = [_plan(routing, a, b) for a, b in bounds]
        received, moved = _dispatch(tokens, plans, held)
        back = [dict() for _ in tokens]   # back[r][q]: the outputs of r's rows on q's experts, on r's context
        for q, rows in enumerate(received):
            if rows:
                moved += self._run_experts(q, rows, experts[q], held, tokens, back)
        outputs = [self._combine(tokens[r], probs[r], plan, back[r], routing, bounds[r][0])
                   for r, plan in enumerate(plans)]
        return outputs, moved

    def _run_experts(self, q, received, arrays, held, tokens, back):
        """Member ``q`` runs its ``held`` experts (``arrays``: their stacked weights and biases) on the rows it
        ``received`` (``(source, rows, experts, slots)`` a source), each expert's in queue order, and sends each
        source its outputs back into ``back``; returns the bytes copied back."""
        ctx = tokens[q].context
        rows = mx.nd.concat(*[x for _, x, _, _ in received], dim=0) if len(received) > 1 else received[0][1]
        e = np.concatenate([x for _, _, x, _ in received])
        order = np.lexsort((np.concatenate([x for _, _, _, x in received]), e))   # by expert, then queue place
        inverse = np.empty_like(order)
        inverse[order] = np.arange(len(order))
        sorted_rows = mx.nd.take(rows, mx.nd.array(order, ctx=ctx))
        pieces = [mx.nd.split(w, num_outputs=held, axis=0, squeeze_axis=True) if held > 1 else
                  [w.reshape(w.shape[1:])] for w in arrays]
        outs, start = [], 0
        for i in range(held):
            n = int((e == q * held + i).sum())
            if not n:
                continue
            x = mx.nd.slice_axis(sorted_rows, axis=0, begin=start, end=start + n)
            h = mx.nd.LeakyReLU(mx.nd.FullyConnected(x, pieces[0][i], pieces[1][i], num_hidden=self._hidden),
                                act_type="gelu")
            outs.append(mx.nd.FullyConnected(h, pieces[2][i], pieces[3][i], num_hidden=self._dim))
            start += n
        done = mx.nd.concat(*outs, dim=0) if len(outs) > 1 else outs[0]
        done = mx.nd.take(done, mx.nd.array(inverse, ctx=ctx))   # back in the order the rows came
        offset, moved = 0, 0
        for r, x, _, _ in received:   # the combine's half of the all-to-all
            part = mx.nd.slice_axis(done, axis=0, begin=offset, end=offset + x.shape[0])
            offset += x.shape[0]
            if r != q:
                moved += part.size * part.dtype(0).itemsize
                part = algorithms.copy_to(part, tokens[r].context)
            back[r][q] = part
        return moved

    def _combine(self, tokens, probs, plan, back, routing, first):
        """A member's output: each of its tokens' choices weighted by their gates, a dropped choice reading a row
        of zeros. ``back``: its rows' outputs from each destination (in ``plan``'s order, which follows the
        destinations), ``first`` its first token's row in ``routing``."""
        _, _, t, j = plan
        ctx, n, k = tokens.context, tokens.shape[0], routing.choice.shape[1]
        zero = mx.nd.zeros((1, self._dim), ctx=ctx, dtype=tokens.dtype)
        table = mx.nd.concat(*([back[q] for q in sorted(back)] + [zero]), dim=0)
        row_of = np.full((n, k), len(t), dtype=np.int64)   # the zero row unless accepted
        row_of[t, j] = np.arange(len(t))
        choice = mx.nd.array(routing.choice[first:first + n], ctx=ctx)
        gates = [mx.nd.pick(probs, mx.nd.slice_axis(choice, axis=1, begin=i, end=i + 1).reshape((-1,)), axis=1)
                 for i in range(k)]
        if k > 1:
            total = mx.nd.add_n(*gates)
            gates = [g / total for g in gates]
        if self._gate_scale != 1:
            gates = [g * self._gate_scale for g in gates]
        out = None
        for i in range(k):
            term = mx.nd.broadcast_mul(mx.nd.take(table, mx.nd.array(row_of[:, i], ctx=ctx)),
                                       gates[i].reshape((-1, 1)))
            out = term if out is None else out + term
        return out


def _plan(routing, a, b):
    """The accepted choices of tokens ``a .. b - 1`` as ``(expert, slot, token, choice)`` arrays (tokens counted
    from ``a``), sorted by expert then queue place: so by destination too, which follows the experts."""
    choice, slot = routing.choice[a:b], routing.slot[a:b]
    t, j = np.nonzero(slot >= 0)
    e, s = choice[t, j], slot[t, j]
    order = np.lexsort((s, e))
    return e[order], s[order], t[order], j[order]


def _dispatch(tokens, plans, held):
    """The dispatch half of the all-to-all: member ``r``'s tokens for member ``q``'s experts, one array a pair,
    copied to ``q``'s context. Returns ``(received, bytes copied)``, ``received[q]`` a list of ``(source, rows,
    their experts, their slots)``."""
    received, moved = [[] for _ in tokens], 0
    for r, (e, s, t, _) in enumerate(plans):
        for q in range(len(tokens)):
            mine = (e // held) == q
            if not mine.any():
                continue
            rows = mx.nd.take(tokens[r], mx.nd.array(t[mine], ctx=tokens[r].context))
            if q != r:
                moved += rows.size * rows.dtype(0).itemsize
                rows = algorithms.copy_to(rows, tokens[q].context)
            received[q].append((r, rows, e[mine], s[mine]))
    return received, moved


def moe_layers(block):
    """The ``MoEFeedForward`` layers of ``block``, in order."""
    found = []
    block.apply(lambda b: found.append(b) if isinstance(b, MoEFeedForward) else None)
    return found


def aux_losses(block):
    """The auxiliary losses of ``block``'s MoE layers' last forward, one array (shape (1,)) a replica, summed over
    the layers (the replicas' sum is the batch's); ``[]`` when it has none."""
    layers = [layer for layer in moe_layers(block) if layer.last is not None]
    if not layers:
        return []
    return [mx.nd.add_n(*parts) if len(parts) > 1 else parts[0] for parts in zip(*[l.last.aux for l in layers])]


def _one_queue(groups, shapes):
    """Where each token of the arrays' inputs (``shapes``, one ``(examples, tokens, ...)`` an array, in order; their
    tokens concatenated row after row) stands in one context's queue: the examples of each group (``groups``, the
    positions of arrays that split each example's sequence, slice after slice, in the batch's order) in order,
    each example's tokens whole (its members' slices one after another). None when that order is the arrays'
    already (no array shares its examples)."""
    if all(len(members) == 1 for members in groups):
        return None
    starts = np.cumsum([0] + [int(np.prod(shape[:-1])) for shape in shapes])
    order = []
    for members in groups:
        for i in range(shapes[members[0]][0]):
            for r in members:
                tokens = shapes[r][1]
                order.extend(range(starts[r] + i * tokens, starts[r] + (i + 1) * tokens))
    return np.array(order, dtype=np.int64)


def expert_specs(block):
    """``{param.name: spec}`` of the arrays of ``block`` that expert parallelism splits (its MoE layers'
    experts, ``MoEFeedForward.expert_specs``); every other array is whole on every replica."""
    return {getattr(layer, attr).name: spec for layer in moe_layers(block)
            for attr, spec in layer.expert_specs().items()}


def check_shared(layers, expert_parallel):
    """``BadValue`` naming ``expert_parallel`` unless its contexts can share every one of the MoE ``layers``'
    experts equally."""
    for layer in layers:
        if layer.experts % expert_parallel:
            raise BadValue("expert_parallel", f"{{expert_parallel={expert_parallel}}} contexts cannot share "
                                              f"{layer.experts} experts equally; give a divisor of the experts")


class RoutingMeter:
    """What the training forwards of a model's MoE layers did, summed until ``read``: the choices routed to each
    expert of each layer, the choices dropped, and the auxiliary losses (queued sums, read once). ``add`` takes the
    layers one recorded forward ran (the whole model's, or one block's of a pipeline stage: each layer is counted
    where it ran), so a model run block by block is counted as a whole one is.

    >>> layer = MoEFeedForward(dim=4, hidden=8, experts=2)
    >>> layer.initialize(mx.init.Normal(0.5))
    >>> meter = RoutingMeter([layer])
    >>> _ = layer(mx.nd.ones((3, 5, 4)))
    >>> meter.add([layer])
    >>> sorted(meter.read()["experts"]["tokens"][0])   # the 15 identical tokens all choose one expert
    [0, 15]
    """

    def __init__(self, layers):
        self.layers = list(layers)
        self.experts = self.layers[0].experts if self.layers else 0
        self._index = {id(layer): i for i, layer in enumerate(self.layers)}
        self._sums = None

    def add(self, layers):
        """Count the last forward of ``layers`` (some of ``self.layers``, all run in one recorded forward)."""
        if not layers:
            return
        m = self._sums or {"tokens": np.zeros((len(self.layers), self.experts), dtype=np.int64), "dropped": 0,
                           "choices": 0, "aux": None, "runs": 0}
        for layer in layers:
            stats = layer.last
            m["tokens"][self._index[id(layer)]] += stats.routed
            m["dropped"] += stats.dropped
            m["choices"] += stats.choices
            m["runs"] += 1
            if stats.aux:   # the replicas' parts, summed on the first's context (queued, not read)
                ctx = stats.aux[0].context
                total = mx.nd.add_n(*[a.detach().as_in_context(ctx) for a in stats.aux]) / stats.copies
                m["aux"] = total if m["aux"] is None else m["aux"] + total.as_in_context(m["aux"].context)
        self._sums = m

    def read(self):
        """``{"experts": {"tokens": [per layer, per expert: the choices routed to it], "dropped": the fraction of
        choices dropped past capacity, "aux_loss": the auxiliary losses of all layers of a forward, the mean over
        the forwards}}`` since the last call, ``{}`` before any; waits for the summed auxiliary loss."""
        m, self._sums = self._sums, None
        if m is None:
            return {}
        forwards = m["runs"] / len(self.layers)
        aux = 0.0 if m["aux"] is None else float(m["aux"].asscalar())
        return {"experts": {"tokens": m["tokens"].tolist(), "dropped": m["dropped"] / max(m["choices"], 1),
                            "aux_loss": aux / forwards}}
