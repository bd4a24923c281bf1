"""LeNet written from scratch: parameters are plain arrays, the network is a function of (X, params).

The textbook's variant: conv 20x3x3, ReLU, avg-pool 2, conv 50x5x5, ReLU, avg-pool 2,
dense 800->128 ReLU, dense 128->10, trained with softmax cross-entropy.
"""
import mxnet as mx
import numpy as np
from mxnet import gluon

__all__ = ["LENET_SHAPES", "init_lenet_params", "lenet", "softmax_cross_entropy"]

#: Shapes of the eight LeNet parameters, in the order ``lenet`` takes them.
LENET_SHAPES = [
    (20, 1, 3, 3), (20,),      # conv1 weight, bias
    (50, 20, 5, 5), (50,),     # conv2 weight, bias
    (800, 128), (128,),        # dense1 weight, bias
    (128, 10), (10,),          # dense2 weight, bias
]


def init_lenet_params(seed=0, scale=0.01, dtype="float32"):
    """Fresh LeNet parameters on the CPU: weights ~ normal(0, scale), biases zero.

    Parameters
    ----------
    seed : int
        Seed of a private ``numpy.random.RandomState``; the global MXNet and numpy seeds are untouched,
        so the same seed always gives the same parameters.
    scale : float
        Standard deviation of the weights.
    dtype : str
        Data type of the arrays.

    Returns
    -------
    list of NDArray
        Eight arrays on ``mx.cpu()`` with shapes ``LENET_SHAPES``, without gradients attached
        (``get_params`` copies them to a context and attaches gradients).
    """
    if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int, got {seed!r}")
    rng = np.random.RandomState(seed)
    return [mx.nd.array(rng.normal(0.0, scale, shape) if len(shape) > 1 else np.zeros(shape), dtype=dtype)
            for shape in LENET_SHAPES]


def lenet(X, params, F=None):
    """Forward pass of LeNet.

    Parameters
    ----------
    X : NDArray or Symbol
        Images of shape (batch, 1, 28, 28) on the same context as ``params``.
    params : list of NDArray or Symbol
        The eight parameters in ``LENET_SHAPES`` order.
    F : module, optional
        ``mx.nd`` or ``mx.sym``; inferred from ``X``. Passing symbols lets the same definition
        run as a cached graph inside a ``HybridBlock``.

    Returns
    -------
    NDArray or Symbol
        Logits of shape (batch, 10), on the context of ``X`` (computed there, asynchronously).
    """
    if F is None:
        F = mx.sym if isinstance(X, mx.sym.Symbol) else mx.nd
    W1, b1, W2, b2, W3, b3, W4, b4 = params
    h = F.relu(F.Convolution(X, W1, b1, kernel=(3, 3), num_filter=20))
    h = F.Pooling(h, pool_type="avg", kernel=(2, 2), stride=(2, 2))
    h = F.relu(F.Convolution(h, W2, b2, kernel=(5, 5), num_filter=50))
    h = F.Pooling(h, pool_type="avg", kernel=(2, 2), stride=(2, 2))
    h = F.flatten(h)
    h = F.relu(F.broadcast_add(F.dot(h, W3), b3))
    return F.broadcast_add(F.dot(h, W4), b4)


#: Per-example softmax cross-entropy of (logits, integer labels); returns shape (batch,).
softmax_cross_entropy = gluon.loss.SoftmaxCrossEntropyLoss()
