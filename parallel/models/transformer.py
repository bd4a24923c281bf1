"""A small Transformer encoder that reads a 28x28 image as a sequence of its 28 rows, built of the tensor-parallel
layers (``parallel.models.layers``): a second model that splits over a tensor-parallel group with no code of its
own for it.

Each row of 28 pixels is a token: a dense layer projects it to ``dim`` and a learned position embedding is added
(28 tokens, no class token). Then ``depth`` *post-norm* Transformer blocks (the original Transformer's order,
Vaswani et al. 2017): ``X = LayerNorm(X + attention(X))``, then ``X = LayerNorm(X + MLP(X))``, with the ViT's
multi-head self-attention (``parallel.models.vit.MultiHeadAttention``) and an MLP of ``mlp_dim`` ReLU units. Last,
the mean over the 28 tokens and a dense layer to the classes. No dropout, no BatchNorm. With ``experts``, every
other block's MLP is a mixture of experts (``parallel.models.moe``), as the ViT's.

What differs from the ViT (``parallel.models.vit``): rows, not patches, as tokens; no class token; post-norm, not
pre-norm; ReLU, not GELU; mean pooling, not the class token; Xavier's initialization. What splits over T ranks:
the attention's heads (its query, key and value layer column-parallel, its output projection row-parallel), the
MLP's units (column- then row-parallel) and the classifier's classes (column-parallel, gathered); the row
embedding, the positions and the layer norms are replicated, every rank computing them on the same values.

The defaults, ``dim=32, heads=4, depth=2, mlp_dim=64``: 19,242 parameters in 29 trainable arrays, a gluon
``HybridSequential`` of ``depth + 2`` children of one input and one output (tokens ``(N, 28, dim)`` between them):
0 the row embedding, 1 .. ``depth`` the blocks, ``depth + 1`` the head.

The model is only mathematics, as the ViT is: where a layout gives its tokens, its attention or its pooling another
form, it calls a seam of ``parallel.models.base`` on its ``F`` (``split_tokens`` after the row embedding, the
ViT's attention and so its ``attention`` seam in each block, ``mark_kept`` of each block's residual stream,
``gather_tokens`` before the mean), which with ``mx.nd`` or ``mx.sym`` is the mathematics itself.

>>> net = init_transformer(seed=0)
>>> len(net), net(mx.nd.zeros((2, 1, 28, 28))).shape
(4, (2, 10))
"""
import mxnet as mx
from mxnet.gluon import nn

from ..validate import BadValue, check_int, check_seed
from .base import gather_tokens, mark_kept, split_tokens
from .layers import ColumnParallelDense, RowParallelDense
from .moe import as_experts
from .vit import MultiHeadAttention

__all__ = ["RowEmbedding", "PostNormBlock", "MeanPoolHead", "transformer", "init_transformer"]


class RowEmbedding(nn.HybridBlock):
    """Images ``(N, 1, rows, width)`` to tokens ``(N, rows, dim)``: each row of pixels through a dense layer, plus
    a learned position embedding (normal, standard deviation 0.02). Replicated on a tensor-parallel group."""

    def __init__(self, dim, rows=28, width=28, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.positions = self.params.get("positions", shape=(1, rows, dim), init=mx.init.Normal(0.02))
            self.dense = nn.Dense(dim, flatten=False, in_units=width)

    def hybrid_forward(self, F, X, positions):
        rows = F.reshape(X, (0, -3, 0))   # (N, 1, rows, width) -> (N, rows, width): one channel
        tokens = F.broadcast_add(self.dense(rows), positions)   # (N, rows, dim)
        return split_tokens(F, tokens, axis=1)   # the seam: the tokens the blocks compute on (all of them here)


class PostNormBlock(nn.HybridBlock):
    """A post-norm Transformer block: ``X = LayerNorm(X + attention(X))``, then ``X = LayerNorm(X + MLP(X))``
    with the MLP ``Dense(mlp_dim), ReLU, Dense(dim)`` (column- then row-parallel); with ``moe``
    (``parallel.models.moe.Experts``), a mixture of experts of that width instead (``MoEFeedForward``: GELU experts;
    a token the experts drop adds nothing to its residual)."""

    def __init__(self, dim, heads, mlp_dim, moe=None, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.attention = MultiHeadAttention(dim, heads)
            self.norm1 = nn.LayerNorm(in_channels=dim)
            if moe:
                self.moe = moe.layer(dim, mlp_dim)
            else:
                self.moe = None
                self.hidden = ColumnParallelDense(mlp_dim, activation="relu", flatten=False, in_units=dim)
                self.out = RowParallelDense(dim, flatten=False, in_units=mlp_dim)
            self.norm2 = nn.LayerNorm(in_channels=dim)

    def hybrid_forward(self, F, X):
        first = X + self.attention(X)
        mid = self.norm1(first)
        second = mid + (self.moe(mid) if self.moe is not None else self.out(self.hidden(mid)))
        mark_kept(F, X, first, second)   # the seam: the block's input and the layer norms' inputs, kept for backward
        return self.norm2(second)


class MeanPoolHead(nn.HybridBlock):
    """Tokens ``(N, T, dim)`` to class scores ``(N, num_classes)``: the mean over the tokens, a dense layer
    (column-parallel over the classes, gathered)."""

    def __init__(self, dim, num_classes, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.dense = ColumnParallelDense(num_classes, gather_output=True, in_units=dim)

    def hybrid_forward(self, F, X):
        X = gather_tokens(F, X, axis=1)   # the seam: every token again, for their mean
        return self.dense(F.mean(X, axis=1))


def transformer(num_classes=10, dim=32, heads=4, depth=2, mlp_dim=64, rows=28, width=28, experts=None):
    """The row Transformer for one-channel ``rows`` x ``width`` images, uninitialized: ``depth + 2`` children
    (row embedding, ``depth`` post-norm blocks, head), the cut points of model and pipeline parallelism.

    With ``experts`` (``parallel.models.moe.Experts``, or its count E, at least 2), every other block's MLP (the
    second, the fourth, ...) is a mixture of E experts of ``mlp_dim`` units each, as ``vit``'s.

    >>> [type(child).__name__ for child in transformer(depth=1)]
    ['RowEmbedding', 'PostNormBlock', 'MeanPoolHead']
    >>> [type(child.moe).__name__ for child in transformer(experts=4)[1:3]]
    ['NoneType', 'MoEFeedForward']
    """
    for value, name in ((num_classes, "num_classes"), (dim, "dim"), (heads, "heads"), (depth, "depth"),
                        (mlp_dim, "mlp_dim"), (rows, "rows"), (width, "width")):
        check_int(value, name, low=1)
    if dim % heads:
        raise BadValue("dim", f"{{dim={dim}}} must be a multiple of {{heads={heads}}}")
    moe = as_experts(experts)
    net = nn.HybridSequential(prefix="transformer_")   # a fixed name: every instance exports the same names
    with net.name_scope():
        net.add(RowEmbedding(dim, rows, width))
        for i in range(depth):
            net.add(PostNormBlock(dim, heads, mlp_dim, moe=moe if i % 2 == 1 else None))
        net.add(MeanPoolHead(dim, num_classes))
    return net


def init_transformer(seed=0, num_classes=10, input_shape=(1, 1, 28, 28), dtype="float32", **sizes):
    """``transformer(num_classes, **sizes)`` for images of ``input_shape`` initialized from ``seed`` on the CPU
    (weights Xavier-uniform, biases 0, LayerNorm's scale 1 and shift 0, positions normal 0.02), and run once on
    zeros of ``input_shape`` so every shape is known.

    >>> net = init_transformer()
    >>> params = [p for p in net.collect_params().values() if p.grad_req != "null"]
    >>> len(params), sum(p.data().size for p in params)
    (29, 19242)
    """
    check_seed(seed)
    net = transformer(num_classes, rows=input_shape[-2], width=input_shape[-1], **sizes)
    mx.random.seed(seed)
    net.initialize(mx.init.Xavier(), ctx=mx.cpu())
    net.cast(dtype)
    net(mx.nd.zeros(input_shape, dtype=dtype))
    return net
