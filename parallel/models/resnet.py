"""ResNet-18, the textbook's variant for 28x28 one-channel images (d2l, "Multi-GPU, concise").

Unlike the ImageNet ResNet-18, the first convolution is 3x3 with stride 1 and there is no max-pool, so a
28x28 image keeps its size through the first stage: 64 channels at 28x28, then 128 at 14x14, 256 at 7x7 and
512 at 4x4, a global average pool and one dense layer. Every convolution is followed by BatchNorm.
11.2 million parameters in 76 trainable arrays: a 45 MB float32 gradient.

It is a gluon ``HybridSequential``: train it on the from-scratch path (``get_params(net, ctx)``,
``train_batch(..., net=net)``), with gluon's ``Trainer``, or cut it into stages at its children.
"""
import mxnet as mx
from mxnet.gluon import nn

from ..validate import check_seed
from .base import Cuttable

__all__ = ["Residual", "resnet18", "init_resnet18"]


class Residual(nn.HybridBlock, Cuttable):
    """Two 3x3 convolutions with BatchNorm, added to the input (through a 1x1 convolution when the shape
    changes): ``relu(bn2(conv2(relu(bn1(conv1(X))))) + shortcut(X))``.

    ``parts()`` cuts it in two blocks run one after the other (what ZeRO-3 gathers a piece at a time)."""

    def __init__(self, channels, use_1x1conv=False, strides=1, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.conv1 = nn.Conv2D(channels, kernel_size=3, padding=1, strides=strides)
            self.bn1 = nn.BatchNorm()
            self.conv2 = nn.Conv2D(channels, kernel_size=3, padding=1)
            self.bn2 = nn.BatchNorm()
            self.conv3 = nn.Conv2D(channels, kernel_size=1, strides=strides) if use_1x1conv else None

    def _first(self, F, X):
        return F.relu(self.bn1(self.conv1(X)))

    def _second(self, F, Y, X):
        Y = self.bn2(self.conv2(Y))
        if self.conv3 is not None:
            X = self.conv3(X)
        return F.relu(Y + X)

    def hybrid_forward(self, F, X):
        return self._second(F, self._first(F, X), X)

    def parts(self):
        """The block as two blocks, the second taking what the first returns: ``(relu(bn1(conv1(X))), X)`` (the
        input passed on, copied), then the rest. The same operators on the same values as the block, and the
        input's gradient the same two terms added (its convolution's and the shortcut's): bitwise the block's.
        Each part shares the block's layers (and so its parameters, in the block's order); the second has
        ``num_inputs = 2``."""
        first = _Part(lambda F, X: (self._first(F, X), F.identity(X)), [self.conv1, self.bn1],
                      prefix=f"{self.prefix}part0_")
        rest = [self.conv2, self.bn2] + ([self.conv3] if self.conv3 is not None else [])
        return [first, _Part(self._second, rest, num_inputs=2, prefix=f"{self.prefix}part1_")]


class _Part(nn.HybridBlock, Cuttable):
    """``forward(F, *inputs)`` as a block that owns ``layers`` (shared with the block they belong to)."""

    def __init__(self, forward, layers, num_inputs=1, **kwargs):
        super().__init__(**kwargs)
        self._forward, self.num_inputs = forward, num_inputs
        for i, layer in enumerate(layers):
            self.register_child(layer, f"layer{i}")

    def hybrid_forward(self, F, *inputs):
        return self._forward(F, *inputs)


def _stage(channels, residuals, first=False):
    stage = nn.HybridSequential()
    for i in range(residuals):
        if i == 0 and not first:   # halve the size, change the number of channels
            stage.add(Residual(channels, use_1x1conv=True, strides=2))
        else:
            stage.add(Residual(channels))
    return stage


def resnet18(num_classes=10):
    """The textbook's ResNet-18 for small images, uninitialized: 7 children, cut points for model and
    pipeline parallelism (stem, four stages of two residual blocks, pooling, classifier)."""
    net = nn.HybridSequential(prefix="resnet18_")   # a fixed name, its blocks named in its scope: every instance
    with net.name_scope():                           # exports the same names
        net.add(nn.HybridSequential())
        net[0].add(nn.Conv2D(64, kernel_size=3, strides=1, padding=1), nn.BatchNorm(), nn.Activation("relu"))
        net.add(_stage(64, 2, first=True), _stage(128, 2), _stage(256, 2), _stage(512, 2))
        net.add(nn.GlobalAvgPool2D(), nn.Dense(num_classes))
    return net


def init_resnet18(seed=0, num_classes=10, input_shape=(1, 1, 28, 28), dtype="float32", sigma=0.01):
    """``resnet18`` initialized as the textbook does (``init.Normal(sigma=0.01)``; BatchNorm's scale 1 and
    shift 0) from ``seed``, on the CPU, and run once on zeros of ``input_shape`` so every shape is known.

    >>> net = init_resnet18()
    >>> params = [p for p in net.collect_params().values() if p.grad_req != "null"]
    >>> len(params), sum(p.data().size for p in params)
    (76, 11175818)
    """
    check_seed(seed)
    net = resnet18(num_classes)
    mx.random.seed(seed)
    net.initialize(mx.init.Normal(sigma=sigma), ctx=mx.cpu())
    net.cast(dtype)
    net(mx.nd.zeros(input_shape, dtype=dtype))
    return net
