"""A small Transformer encoder that reads a 28x28 image as a sequence of its 28 rows, built of the tensor-parallel
layers (``parallel.models.layers``): a second model that splits over a tensor-parallel group with no code of its
own for it.

Each row of 28 pixels is a token: a dense layer projects it to ``dim`` and a learned position embedding is added
(28 tokens, no class token). Then ``depth`` *post-norm* Transformer blocks (the original Transformer's order,
Vaswani et al. 2017): ``X = LayerNorm(X + attention(X))``, then ``X = LayerNorm(X + MLP(X))``, with the ViT's
multi-head self-attention (``parallel.models.vit.MultiHeadAttention``) and an MLP of ``mlp_dim`` ReLU units. Last,
the mean over the 28 tokens and a dense layer to the classes. No dropout, no BatchNorm.

What differs from the ViT (``parallel.models.vit``): rows, not patches, as tokens; no class token; post-norm, not
pre-norm; ReLU, not GELU; mean pooling, not the class token; Xavier's initialization. What splits over T ranks:
the attention's heads (its query, key and value layer column-parallel, its output projection row-parallel), the
MLP's units (column- then row-parallel) and the classifier's classes (column-parallel, gathered); the row
embedding, the positions and the layer norms are replicated, every rank computing them on the same values.

The defaults, ``dim=32, heads=4, depth=2, mlp_dim=64``: 19,242 parameters in 29 trainable arrays, a gluon
``HybridSequential`` of ``depth + 2`` children of one input and one output (tokens ``(N, 28, dim)`` between them):
0 the row embedding, 1 .. ``depth`` the blocks, ``depth + 1`` the head.

>>> net = init_transformer(seed=0)
>>> len(net), net(mx.nd.zeros((2, 1, 28, 28))).shape
(4, (2, 10))
"""
import mxnet as mx
from mxnet.gluon import nn

from ..validate import BadValue, check_int, check_seed
from .layers import ColumnParallelDense, RowParallelDense
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
        return F.broadcast_add(self.dense(rows), positions)


class PostNormBlock(nn.HybridBlock):
    """A post-norm Transformer block: ``X = LayerNorm(X + attention(X))``, then ``X = LayerNorm(X + MLP(X))``
    with the MLP ``Dense(mlp_dim), ReLU, Dense(dim)`` (column- then row-parallel)."""

    def __init__(self, dim, heads, mlp_dim, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.attention = MultiHeadAttention(dim, heads)
            self.norm1 = nn.LayerNorm(in_channels=dim)
            self.hidden = ColumnParallelDense(mlp_dim, activation="relu", flatten=False, in_units=dim)
            self.out = RowParallelDense(dim, flatten=False, in_units=mlp_dim)
            self.norm2 = nn.LayerNorm(in_channels=dim)

    def hybrid_forward(self, F, X):
        X = self.norm1(X + self.attention(X))
        return self.norm2(X + self.out(self.hidden(X)))


class MeanPoolHead(nn.HybridBlock):
    """Tokens ``(N, T, dim)`` to class scores ``(N, num_classes)``: the mean over the tokens, a dense layer
    (column-parallel over the classes, gathered)."""

    def __init__(self, dim, num_classes, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.dense = ColumnParallelDense(num_classes, gather_output=True, in_units=dim)

    def hybrid_forward(self, F, X):
        return self.dense(F.mean(X, axis=1))


def transformer(num_classes=10, dim=32, heads=4, depth=2, mlp_dim=64, rows=28, width=28):
    """The row Transformer for one-channel ``rows`` x ``width`` images, uninitialized: ``depth + 2`` children
    (row embedding, ``depth`` post-norm blocks, head), the cut points of model and pipeline parallelism.

    >>> [type(child).__name__ for child in transformer(depth=1)]
    ['RowEmbedding', 'PostNormBlock', 'MeanPoolHead']
    """
    for value, name in ((num_classes, "num_classes"), (dim, "dim"), (heads, "heads"), (depth, "depth"),
                        (mlp_dim, "mlp_dim"), (rows, "rows"), (width, "width")):
        check_int(value, name, low=1)
    if dim % heads:
        raise BadValue("dim", f"{{dim={dim}}} must be a multiple of {{heads={heads}}}")
    net = nn.HybridSequential(prefix="transformer_")   # a fixed name: every instance exports the same names
    with net.name_scope():
        net.add(RowEmbedding(dim, rows, width))
        for _ in range(depth):
            net.add(PostNormBlock(dim, heads, mlp_dim))
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
