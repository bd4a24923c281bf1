"""A small Vision Transformer (ViT, Dosovitskiy et al. 2021) for 28x28 one-channel images.

The image is cut into 16 patches of 7x7 pixels, each projected to a token of width ``dim`` (one convolution of
kernel 7 and stride 7: 1x28x28 -> dim x 4 x 4 -> 16 tokens). A learned class token is put in front (17 tokens)
and a learned position embedding added to each of the 17. Then ``depth`` pre-norm Transformer blocks, each
``X + attention(LayerNorm(X))`` followed by ``X + MLP(LayerNorm(X))``: multi-head self-attention of ``heads``
heads of width ``dim / heads`` (one dense layer makes the queries, keys and values of every head, softmax of
their scaled dot products, one dense layer mixes the heads back), and an MLP of one hidden layer of ``mlp_dim``
units with GELU. Last, a LayerNorm of the class token and a dense layer to the classes. No dropout, no BatchNorm:
every array is trained, and every example is computed on its own (K contexts train the same model as one up to
float32 rounding, with nothing to synchronize).

The defaults, ``dim=64, heads=4, depth=4, mlp_dim=128``: 139,018 parameters in 56 trainable arrays (a 0.56 MB
float32 gradient, 80 times smaller than ResNet-18's); 20 epochs of 1500 images take about 20 seconds on one
context of a 2-core CPU (0.946 test accuracy on scikit-learn's digits with AdamW: docs/gluon.md).

It is a gluon ``HybridSequential`` of ``depth + 2`` children, each a ``HybridBlock`` of one input and one output
(tokens ``(N, 17, dim)`` between them): 0 the patch embedding (with the class token and the positions), 1 ..
``depth`` the Transformer blocks, ``depth + 1`` the head. Model and pipeline parallelism cut it at its children,
activation recomputation and ZeRO-3 keep each child's input; train it on the from-scratch path
(``get_params(net, ctx)``, ``train_batch(..., net=net)``) or with gluon's ``Trainer``. Every ``hybrid_forward``
runs on symbols as well as arrays (no shape is read from an input), so ``GluonNet`` runs it as one cached graph.

Its dense layers and its patch projection are the tensor-parallel layers of ``parallel.models.layers``, which in
gluon's own calls are exactly ``nn.Dense`` and ``nn.Conv2D`` (the same names, initial values, outputs and
gradients, bit for bit, as when it was built of those), and which ``run_ranks`` splits over T ranks Megatron's
way: the query, key and value layer column-parallel by heads (``parts=3``, ``unit`` a head's width), the
attention's projection row-parallel, the MLP column- then row-parallel, the patch projection over its pixels,
the classifier over its classes. ``MultiHeadAttention`` reads no head count from its input: it reshapes by the
head width, so the same code runs a rank's heads.

The model is only mathematics: where a layout gives its tokens, its attention or its head another form, it calls a
seam of ``parallel.models.base`` on its ``F`` (``split_tokens`` after the embedding, ``attention`` in each block,
``mark_kept`` of each block's residual stream, ``gather_tokens`` before the head). With ``mx.nd`` or ``mx.sym`` a
seam is the mathematics itself (the identity, dot-product attention, nothing); with the ``F`` of a layout (a
``ParallelF``) it is that ``F``'s method, which knows the layout's axes. The model asks its ``F`` nothing.
"""
import mxnet as mx
from mxnet.gluon import nn

from ..validate import check_int, check_seed
from .base import attention, gather_tokens, mark_kept, split_tokens
from .layers import ColumnParallelDense, ParallelPatchEmbedding, RowParallelDense
from .moe import as_experts

__all__ = ["PatchEmbedding", "MultiHeadAttention", "TransformerBlock", "ClassifierHead", "vit", "init_vit"]


class PatchEmbedding(nn.HybridBlock):
    """Images ``(N, 1, 28, 28)`` to tokens ``(N, 17, dim)``: the 16 patches of ``patch`` x ``patch`` pixels
    projected to ``dim`` (a convolution of kernel and stride ``patch``), after a learned class token, plus a
    learned position embedding. The class token and the positions are this block's own parameters, initialized
    as ViT's are: normal, standard deviation 0.02."""

    def __init__(self, dim, patch=7, image=28, **kwargs):
        super().__init__(**kwargs)
        tokens = (image // patch) ** 2 + 1
        with self.name_scope():
            self.cls_token = self.params.get("cls_token", shape=(1, 1, dim), init=mx.init.Normal(0.02))
            self.pos_embedding = self.params.get("pos_embedding", shape=(1, tokens, dim), init=mx.init.Normal(0.02))
            self.proj = ParallelPatchEmbedding(dim, patch, in_channels=1)

    def hybrid_forward(self, F, X, cls_token, pos_embedding):
        patches = F.reshape(self.proj(X), (0, 0, -1))              # (N, dim, 16)
        patches = F.transpose(patches, (0, 2, 1))                  # (N, 16, dim)
        cls = F.broadcast_like(cls_token, patches, lhs_axes=(0,), rhs_axes=(0,))   # (N, 1, dim)
        tokens = F.broadcast_add(F.concat(cls, patches, dim=1), pos_embedding)     # (N, 17, dim)
        return split_tokens(F, tokens, axis=1)   # the seam: the tokens the blocks compute on (all of them here)


class MultiHeadAttention(nn.HybridBlock):
    """Self-attention of ``heads`` heads on tokens ``(N, T, dim)``: ``softmax(Q K^T / sqrt(d)) V`` for each head's
    queries, keys and values of width ``d = dim / heads``, the heads side by side again, then a dense layer."""

    def __init__(self, dim, heads, **kwargs):
        super().__init__(**kwargs)
        if dim % heads:
            raise ValueError(f"dim must be a multiple of heads, got dim {dim} and {heads} heads")
        self._heads, self._head_dim, self._scale = heads, dim // heads, (dim // heads) ** -0.5
        with self.name_scope():
            self.qkv = ColumnParallelDense(3 * dim, parts=3, unit=dim // heads, flatten=False, in_units=dim)
            self.proj = RowParallelDense(dim, unit=dim // heads, flatten=False, in_units=dim)

    def hybrid_forward(self, F, X):
        # h below is the heads this block computes: all of them, or a tensor-parallel rank's (qkv's rows); the
        # shapes come from the head width d, never from h
        qkv = F.reshape(self.qkv(X), (0, 0, 3, -1, self._head_dim))   # (N, T, 3, h, d)
        qkv = F.transpose(qkv, (2, 0, 3, 1, 4))                    # (3, N, h, T, d)
        heads = F.reshape(qkv, (0, -3, 0, 0))                      # (3, N*h, T, d)
        parts = F.split(heads, num_outputs=3, axis=0, squeeze_axis=True)
        q, k, v = parts[0], parts[1], parts[2]                     # each (N*h, T, d)
        attended = attention(F, q, k, v, self._scale)   # the seam: softmax(q k^T / sqrt(d)) v, (N*h, T, d)
        out = F.reshape_like(attended, qkv, lhs_begin=0, lhs_end=1, rhs_begin=1, rhs_end=3)
        out = F.reshape(F.transpose(out, (0, 2, 1, 3)), (0, 0, -3))   # (N, h, T, d) -> (N, T, h*d)
        return self.proj(out)


class TransformerBlock(nn.HybridBlock):
    """A pre-norm Transformer block: ``X + attention(LayerNorm(X))``, then ``X + MLP(LayerNorm(X))`` with the
    MLP ``Dense(mlp_dim), GELU, Dense(dim)``; with ``moe`` (``parallel.models.moe.Experts``), a mixture of experts
    of that MLP instead (a token an expert drops goes on through the residual)."""

    def __init__(self, dim, heads, mlp_dim, moe=None, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.norm1 = nn.LayerNorm(in_channels=dim)
            self.attention = MultiHeadAttention(dim, heads)
            self.norm2 = nn.LayerNorm(in_channels=dim)
            if moe:
                self.moe = moe.layer(dim, mlp_dim)
            else:
                self.moe = None
                self.hidden = ColumnParallelDense(mlp_dim, flatten=False, in_units=dim)
                self.out = RowParallelDense(dim, flatten=False, in_units=mlp_dim)

    def hybrid_forward(self, F, X):
        mid = X + self.attention(self.norm1(X))
        if self.moe is not None:
            out = mid + self.moe(self.norm2(mid))
        else:
            out = mid + self.out(F.LeakyReLU(self.hidden(self.norm2(mid)), act_type="gelu"))
        mark_kept(F, X, mid, out)   # the seam: the residual stream and the layer norms' inputs, kept for backward
        return out


class ClassifierHead(nn.HybridBlock):
    """Tokens ``(N, T, dim)`` to class scores ``(N, num_classes)``: the class token (token 0), a LayerNorm, a
    dense layer."""

    def __init__(self, dim, num_classes, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.norm = nn.LayerNorm(in_channels=dim)
            # flattens (N, 1, dim) to (N, dim); on T ranks, each rank's classes, gathered
            self.dense = ColumnParallelDense(num_classes, gather_output=True, in_units=dim)

    def hybrid_forward(self, F, X):
        X = gather_tokens(F, X, axis=1)   # the seam: every token again, the class token among them
        return self.dense(self.norm(F.slice_axis(X, axis=1, begin=0, end=1)))


def vit(num_classes=10, dim=64, heads=4, depth=4, mlp_dim=128, patch=7, image=28, experts=None):
    """The small ViT for ``image`` x ``image`` one-channel images, uninitialized: ``depth + 2`` children, cut
    points for model and pipeline parallelism (patch embedding, ``depth`` Transformer blocks, head).

    With ``experts`` (``parallel.models.moe.Experts``, or its count E, at least 2), every other block's MLP (the
    second, the fourth, ...) is a mixture of E experts of ``mlp_dim`` units each (``MoEFeedForward``): Switch's and
    GShard's placement, which halves the routing and the all-to-alls of a step against every block's while each
    token still meets experts every two blocks.

    >>> net = vit()
    >>> len(net), type(net[0]).__name__, type(net[1]).__name__, type(net[-1]).__name__
    (6, 'PatchEmbedding', 'TransformerBlock', 'ClassifierHead')
    """
    for value, name in ((num_classes, "num_classes"), (dim, "dim"), (heads, "heads"), (depth, "depth"),
                        (mlp_dim, "mlp_dim"), (patch, "patch")):
        check_int(value, name, low=1)
    if image % patch:
        raise ValueError(f"the image's side must be a multiple of patch, got image {image} and patch {patch}")
    net = nn.HybridSequential(prefix="vit_")   # a fixed name: every instance exports the same names
    with net.name_scope():
        net.add(PatchEmbedding(dim, patch, image))
        moe = as_experts(experts)
        for i in range(depth):
            net.add(TransformerBlock(dim, heads, mlp_dim, moe=moe if i % 2 == 1 else None))
        net.add(ClassifierHead(dim, num_classes))
    return net


def init_vit(seed=0, num_classes=10, input_shape=(1, 1, 28, 28), dtype="float32", sigma=0.02, **sizes):
    """``vit(num_classes, **sizes)`` initialized from ``seed`` on the CPU as ViT is (every weight normal with
    standard deviation ``sigma``; biases 0; LayerNorm's scale 1 and shift 0; the class token and positions normal
    0.02), and run once on zeros of ``input_shape`` so every shape is known.

    >>> net = init_vit()
    >>> params = [p for p in net.collect_params().values() if p.grad_req != "null"]
    >>> len(params), sum(p.data().size for p in params), net(mx.nd.zeros((3, 1, 28, 28))).shape
    (56, 139018, (3, 10))
    """
    check_seed(seed)
    net = vit(num_classes, image=input_shape[-1], **sizes)
    mx.random.seed(seed)
    net.initialize(mx.init.Normal(sigma=sigma), ctx=mx.cpu())
    net.cast(dtype)
    net(mx.nd.zeros(input_shape, dtype=dtype))
    return net
