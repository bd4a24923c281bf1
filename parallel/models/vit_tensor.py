"""The small ViT (``parallel.models.vit``) split over the T ranks of a tensor-parallel group, Megatron's way.

Each Transformer block's attention heads and MLP hidden units are split over the ranks (heads and units that
differ by at most one from rank to rank): the layer that makes a block's queries, keys and values and its MLP's
hidden layer are *column-parallel* (rank ``t`` holds the rows of its heads, of its units), the attention's output
projection and the MLP's output layer *row-parallel* (the columns that read them); between, Megatron's ``f``
before each column-parallel layer (identity forward, allreduce of the input's gradient backward) and ``g`` after
each row-parallel one (allreduce of the partial outputs forward, identity backward): ``parallel.comm.tensor``. A
row-parallel layer's bias is added once, after ``g``. The layer norms, the residual stream, the class token and
the positions are replicated: every rank computes them on the same bits.

The embedding and the head, as Megatron handles its word embedding and output layer: the patch projection (a
7x7 convolution of stride 7, one input channel: a linear map of each patch's 49 pixels) is split along its
input, the pixels (Megatron splits the embedding table along its vocabulary, the embedding's input), each rank's
partial projection summed by ``g``; the classifier is column-parallel over the classes (Megatron's output layer
over the vocabulary) and its outputs gathered on the group's first rank (``gather_output``; Megatron fuses the
gather into a parallel cross-entropy because its vocabulary is 50,000 wide, where 10 classes are 40 bytes an
example).

``TensorViT(block, T)`` is the plan: ``shard(arrays, t)`` gives rank ``t``'s arrays (the model's arrays in its
order, each cut to the rank's part), ``unshard(ranks)`` the model's whole arrays back, and ``forward(X, ranks)``
runs a batch through a group's ranks in lockstep, op by op, returning the logits on the first rank's context.
The same arithmetic as ``init_vit``'s network on one context up to float32 rounding (a row-parallel sum adds the
ranks' parts in another order; the patch projection is a dense layer on the unfolded patches, not a
convolution): ``tests/test_tensor.py``.
"""
import mxnet as mx
import numpy as np

from ..comm import algorithms
from ..comm.algorithms import chunk_bounds
from ..comm.replica import block_state
from ..validate import BadValue, check_int
from .layout import block_names

__all__ = ["TensorViT"]


def _parts(bounds, t):
    return bounds[t], bounds[t + 1]


class TensorViT:
    """``init_vit``'s network (or any ``vit(...)``, initialized) split over ``tensor`` ranks (see the module's
    docstring).

    Parameters
    ----------
    block : mxnet.gluon.nn.HybridSequential
        The ViT: a ``PatchEmbedding``, Transformer blocks, a ``ClassifierHead`` (``parallel.models.vit``).
    tensor : int
        T, the ranks of a group: 1 to the number of heads.
    algorithm : str
        The allreduce of ``f`` and ``g`` (``parallel.comm.ALGORITHMS``).

    Attributes
    ----------
    names : list of str
        The model's trainable arrays' structural names, in its order (what a checkpoint stores).
    heads, units, pixels, classes : list of int
        The bounds of each rank's heads, MLP units, patch pixels and classes.
    """

    def __init__(self, block, tensor, algorithm="fused"):
        from .vit import ClassifierHead, PatchEmbedding, TransformerBlock
        check_int(tensor, "tensor", low=1)
        children = list(block)
        if (len(children) < 3 or not isinstance(children[0], PatchEmbedding)
                or not isinstance(children[-1], ClassifierHead)
                or not all(isinstance(c, TransformerBlock) for c in children[1:-1])):
            # the Transformer's layers split too (MODELS), but only run_ranks (parallel.models.layers) runs them so
            raise BadValue("tensor", "{tensor} is the ViT's alone until a strategy runs "
                                     "parallel.models.layers.run_ranks; use --model vit")
        self.names = block_names(block)[0]
        _, arrays, _, _ = block_state(block)
        shapes = dict(zip(self.names, [a.shape for a in arrays]))
        self.depth, self.dim = len(children) - 2, shapes["0.cls_token"][-1]
        attention = children[1].attention
        self.num_heads, self.scale = attention._heads, attention._scale
        self.head_dim = self.dim // self.num_heads
        self.patch, self.tokens = shapes["0.proj.weight"][-1], shapes["0.pos_embedding"][1]
        self.image = self.patch * int(round((self.tokens - 1) ** 0.5))
        self.mlp_dim, self.num_classes = shapes["1.hidden.weight"][0], shapes[f"{self.depth + 1}.dense.weight"][0]
        self.eps = [children[1].norm1._epsilon, children[1].norm2._epsilon, children[-1].norm._epsilon]
        if tensor > self.num_heads:
            raise BadValue("tensor", f"{{tensor={tensor}}} ranks cannot split the ViT's {self.num_heads} attention "
                                     f"heads; use at most {self.num_heads}")
        self.tensor, self.algorithm = int(tensor), algorithm
        self.heads = chunk_bounds(self.num_heads, tensor)
        self.units = chunk_bounds(self.mlp_dim, tensor)
        self.pixels = chunk_bounds(self.patch * self.patch, tensor)
        self.classes = chunk_bounds(self.num_classes, tensor)
        self.shapes = [shapes[name] for name in self.names]

    def __repr__(self):
        return f"TensorViT({self.tensor} ranks: {self.num_heads} heads, {self.mlp_dim} units, depth {self.depth})"

    # ---- which part of each array a rank holds ------------------------------------------------------------------

    def _rule(self, name, t):
        """``(axis, indices)`` of array ``name`` that rank ``t`` holds (None: the whole array, replicated)."""
        child, _, rest = name.partition(".")
        d = self.head_dim
        if rest == "proj.weight" and child == "0":
            return 1, np.arange(*_parts(self.pixels, t))   # the weight seen as (dim, pixels)
        if rest in ("attention.qkv.weight", "attention.qkv.bias"):
            h0, h1 = _parts(self.heads, t)
            return 0, np.concatenate([np.arange(p * self.dim + h0 * d, p * self.dim + h1 * d) for p in range(3)])
        if rest == "attention.proj.weight":
            h0, h1 = _parts(self.heads, t)
            return 1, np.arange(h0 * d, h1 * d)
        if rest in ("hidden.weight", "hidden.bias"):
            return 0, np.arange(*_parts(self.units, t))
        if rest == "out.weight":
            return 1, np.arange(*_parts(self.units, t))
        if child == str(self.depth + 1) and rest in ("dense.weight", "dense.bias"):
            return 0, np.arange(*_parts(self.classes, t))
        return None

    def replicated(self, name):
        """Whether every rank holds array ``name`` whole (a layer norm, a row-parallel layer's bias, the class
        token, the positions)."""
        return self._rule(name, 0) is None

    def _flat(self, name, array):
        """The patch projection's weight as (dim, pixels); every other array as it is."""
        return array.reshape((array.shape[0], -1)) if name == "0.proj.weight" else array

    def shard(self, arrays, t):
        """Rank ``t``'s arrays: each of ``arrays`` (the model's, in ``names`` order) cut to the rank's part,
        replicated ones copied; on the arrays' context."""
        out = []
        for name, array in zip(self.names, arrays):
            rule = self._rule(name, t)
            if rule is None:
                out.append(array.copy())
                continue
            axis, indices = rule
            out.append(mx.nd.take(self._flat(name, array), mx.nd.array(indices, ctx=array.context), axis=axis))
        return out

    def unshard(self, ranks):
        """The model's whole arrays (numpy, in ``names`` order) from each rank's arrays (``ranks[t]``, as
        ``shard`` lays them out): the split ones put together, the replicated ones rank 0's."""
        out = []
        for i, (name, shape) in enumerate(zip(self.names, self.shapes)):
            if self.replicated(name):
                out.append(ranks[0][i].asnumpy())
                continue
            whole = np.zeros(self._flat(name, np.zeros(shape)).shape, dtype=ranks[0][i].dtype)
            for t in range(self.tensor):
                axis, indices = self._rule(name, t)
                where = [slice(None)] * whole.ndim
                where[axis] = indices
                whole[tuple(where)] = ranks[t][i].asnumpy()
            out.append(whole.reshape(shape))
        return out

    def allreduces(self, batch):
        """The allreduces f and g make in one training step of a group on ``batch`` examples, by Megatron's count:
        ``[(elements of each rank's array, how many)]``. Each Transformer block sums its activations (batch x
        tokens x dim) twice forward (g after the attention and after the MLP) and twice backward (f before
        each); the patch projection's g sums batch x patches x dim forward, the head's f batch x dim backward."""
        activations = batch * self.tokens * self.dim
        return [(activations, 4 * self.depth), (batch * (self.tokens - 1) * self.dim, 1), (batch * self.dim, 1)]

    # ---- the forward pass of one group -------------------------------------------------------------------------

    def indices_of(self, start, stop):
        """The indices in ``names`` of children ``start .. stop - 1``'s trainable arrays, in the model's order (what
        a stage of them holds)."""
        return [i for i, name in enumerate(self.names) if start <= int(name.split(".", 1)[0]) < stop]

    def names_of(self, start, stop):
        """The structural names of children ``start .. stop - 1``'s trainable arrays (``indices_of``'s)."""
        return [self.names[i] for i in self.indices_of(start, stop)]

    def forward(self, X, ranks, tape, start=0, stop=None):
        """Children ``start .. stop - 1`` (default all: the logits of the images ``X``) of a group whose rank ``t``
        holds ``ranks[t]`` (``shard``'s arrays, in ``names`` order, or a stage's: ``names_of(start, stop)``, each on
        the rank's context): each rank's work run by ``tape`` (a ``parallel.comm.TensorTape``) a segment at a time,
        f and g between. ``X``: the images (from child 0), else the ranks' hidden states of the stage before
        (copied to this stage's ranks, recorded). Returns the logits on the first rank's context after the last
        child, else the ranks' hidden states. Recording, the tape keeps what its ``backward`` needs after
        ``autograd.backward`` of the loss; nothing waits."""
        stop = self.depth + 2 if stop is None else stop
        P = [dict(zip(self.names_of(start, stop), arrays)) for arrays in ranks]
        contexts = [arrays[0].context for arrays in ranks]
        if start == 0:
            h = [X if X.context == ctx else algorithms.copy_to(X, ctx) for ctx in contexts]
            h = tape.run(lambda t, e: self._embedded(e, P[t]), self._g(tape, tape.run(self._patches, h, P)))
        else:   # the stage before's hidden states, rank t's to rank t (every rank holds the same), recorded copies
            h = tape.run(lambda t, x: algorithms.copy_to(x, contexts[t]), X)
        for i in range(max(start, 1), min(stop, self.depth + 1)):
            h = self._block(tape, h, P, str(i))
        return self._head(tape, h, P) if stop == self.depth + 2 else h

    def _head(self, tape, h, P):
        """The classifier: the class token's LayerNorm on every rank, f, each rank's classes, gathered."""
        head = str(self.depth + 1)
        cls = tape.run(lambda t, x: mx.nd.LayerNorm(mx.nd.slice_axis(x, axis=1, begin=0, end=1),
                                                    P[t][f"{head}.norm.gamma"], P[t][f"{head}.norm.beta"], axis=-1,
                                                    eps=self.eps[2]), h)
        logits = tape.run(lambda t, c: mx.nd.FullyConnected(c, P[t][f"{head}.dense.weight"],
                                                            P[t][f"{head}.dense.bias"],
                                                            num_hidden=P[t][f"{head}.dense.weight"].shape[0]),
                          self._f(tape, cls))
        if self.tensor == 1:
            return logits[0]
        first = logits[0].context   # Megatron's gather_output: the classes side by side on the first rank
        return mx.nd.concat(logits[0], *[algorithms.copy_to(part, first) for part in logits[1:]], dim=1)

    def _f(self, tape, xs):
        return tape.f(xs) if self.tensor > 1 else xs

    def _g(self, tape, xs):
        return tape.g(xs) if self.tensor > 1 else xs

    def _patches(self, t, x, p):
        """Rank ``t``'s part of the patch projection: its pixels of every patch, (N, tokens, dim) partial sums."""
        side = x.shape[-1] // self.patch
        patches = x.reshape((0, 1, side, self.patch, side, self.patch)).transpose((0, 2, 4, 1, 3, 5))
        patches = patches.reshape((0, side * side, -1))                       # (N, patches, pixels)
        a, b = _parts(self.pixels, t)
        return mx.nd.FullyConnected(mx.nd.slice_axis(patches, axis=2, begin=a, end=b), p["0.proj.weight"],
                                    no_bias=True, num_hidden=self.dim, flatten=False)

    def _embedded(self, x, p):
        """The summed patch projection plus its bias, after the class token, plus the positions."""
        x = mx.nd.broadcast_add(x, p["0.proj.bias"])
        cls = mx.nd.broadcast_like(p["0.cls_token"], x, lhs_axes=(0,), rhs_axes=(0,))
        return mx.nd.broadcast_add(mx.nd.concat(cls, x, dim=1), p["0.pos_embedding"])

    def _block(self, tape, h, P, i):
        """Transformer block ``i``: ``h + g(attention_t(f(LayerNorm(h))))``, then the same with the MLP."""
        def norm(which, eps):
            return lambda t, x: mx.nd.LayerNorm(x, P[t][f"{i}.{which}.gamma"], P[t][f"{i}.{which}.beta"], axis=-1,
                                                eps=eps)

        def attention(t, x):
            p, heads = P[t], self.heads[t + 1] - self.heads[t]
            qkv = mx.nd.FullyConnected(x, p[f"{i}.attention.qkv.weight"], p[f"{i}.attention.qkv.bias"],
                                       num_hidden=3 * heads * self.head_dim, flatten=False)
            return mx.nd.FullyConnected(self._attention(qkv, heads), p[f"{i}.attention.proj.weight"], no_bias=True,
                                        num_hidden=self.dim, flatten=False)

        def mlp(t, x):
            p = P[t]
            hidden = mx.nd.FullyConnected(x, p[f"{i}.hidden.weight"], p[f"{i}.hidden.bias"],
                                          num_hidden=p[f"{i}.hidden.weight"].shape[0], flatten=False)
            return mx.nd.FullyConnected(mx.nd.LeakyReLU(hidden, act_type="gelu"), p[f"{i}.out.weight"],
                                        no_bias=True, num_hidden=self.dim, flatten=False)

        def residual(bias):
            return lambda t, x, o: x + mx.nd.broadcast_add(o, P[t][f"{i}.{bias}"])

        o = self._g(tape, tape.run(attention, self._f(tape, tape.run(norm("norm1", self.eps[0]), h))))
        h = tape.run(residual("attention.proj.bias"), h, o)
        v = self._g(tape, tape.run(mlp, self._f(tape, tape.run(norm("norm2", self.eps[1]), h))))
        return tape.run(residual("out.bias"), h, v)

    def _attention(self, qkv, heads):
        """``MultiHeadAttention``'s arithmetic on one rank's ``heads`` heads: (N, T, 3 heads d) -> (N, T, heads d)."""
        qkv = mx.nd.reshape(qkv, (0, 0, 3, heads, -1)).transpose((2, 0, 3, 1, 4)).reshape((0, -3, 0, 0))
        q, k, v = mx.nd.split(qkv, num_outputs=3, axis=0, squeeze_axis=True)
        weights = mx.nd.softmax(mx.nd.batch_dot(q * self.scale, k, transpose_b=True), axis=-1)
        out = mx.nd.reshape(mx.nd.batch_dot(weights, v), (-4, -1, heads, 0, 0))
        return mx.nd.reshape(mx.nd.transpose(out, (0, 2, 1, 3)), (0, 0, -3))
