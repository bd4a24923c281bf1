"""Batches: ``iterate_batches`` turns uint8 arrays into float32 NDArray minibatches on the CPU.

Every example appears once per pass; the last batch may be smaller, and ``num_batches`` says how many
batches a pass has. ``epoch_seed`` gives the seed of each epoch's shuffle in a seeded run. Imports MXNet.

>>> num_batches(23, batch_size=5)
5
"""
import numpy as np

from ..mxnet_compat import host_array
from ..validate import check_int, check_seed

__all__ = ['iterate_batches', 'num_batches', 'epoch_seed']


def num_batches(n, batch_size):
    """Return how many batches ``iterate_batches`` yields for n examples.

    Parameters
    ----------
    n : int
        Number of examples, >= 0.
    batch_size : int
        Examples per batch, >= 1.

    Returns
    -------
    int
        ``ceil(n / batch_size)``: the last batch may be smaller.

    Raises
    ------
    TypeError
        If n or batch_size is not an int.
    ValueError
        If n < 0 or batch_size < 1.
    """
    batch_size = check_int(batch_size, 'batch_size', low=1)
    n = check_int(n, 'n', low=0)
    return -(-n // batch_size)


def iterate_batches(images, labels, batch_size, shuffle=False, seed=None, start=0):
    """Yield ``(X, y)`` minibatches as float32 NDArrays on ``mx.cpu()``.

    Every example appears exactly once per call; the last batch holds the remainder and may be
    smaller (nothing is padded or dropped). Only the current batch is converted to float32, with
    one numpy slice and one copy into an NDArray per batch (``parallel.mxnet_compat.host_array``).

    Parameters
    ----------
    images : numpy.ndarray
        uint8, shape (n, height, width), pixel values 0..255.
    labels : numpy.ndarray
        Shape (n,), class indices.
    batch_size : int
        Examples per batch, >= 1.
    shuffle : bool, default False
        Visit the examples in a random order drawn from ``np.random.RandomState(seed)``.
    seed : int, optional
        Seed for the shuffle; None draws a fresh order each call.
    start : int, default 0
        Batches to skip: the first batch yielded is batch ``start`` (from 0) of this order, so that a run
        resumed mid-epoch sees exactly the batches it had not trained on. Skipped batches cost nothing.

    Returns
    -------
    generator of (mxnet.nd.NDArray, mxnet.nd.NDArray)
        X of shape (b, 1, height, width) scaled to [0, 1], y of shape (b,), both float32.

    Raises
    ------
    TypeError
        If batch_size or start is not an int.
    ValueError
        If batch_size < 1, start < 0, or the arrays' shapes do not fit together.
    """
    batch_size = check_int(batch_size, 'batch_size', low=1)
    images, labels = np.asarray(images), np.asarray(labels)
    if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
        raise ValueError('need images of shape (n, height, width) and labels of shape (n,), got %s and %s'
                         % (images.shape, labels.shape))
    start = check_int(start, 'start', low=0)
    return _batches(images, labels, batch_size, shuffle, seed, start)


def _batches(images, labels, batch_size, shuffle, seed, first):
    n = len(images)
    order = np.random.RandomState(seed).permutation(n) if shuffle else None
    for start in range(first * batch_size, n, batch_size):
        if order is None:
            sl = slice(start, start + batch_size)
        else:
            sl = order[start:start + batch_size]
        X = images[sl].astype(np.float32)
        X /= np.float32(255)
        X = X[:, None, :, :]
        yield host_array(X, np.float32), host_array(labels[sl], np.float32)


def epoch_seed(seed, epoch):
    """The shuffling seed of ``epoch`` in a run seeded with ``seed``: any seed in 0 .. 2**32-1 gives one.

    Both numbers feed a ``numpy.random.SeedSequence``, so neighbouring seeds and epochs give unrelated
    orders and nothing overflows (a formula such as ``seed * 100003 + epoch`` leaves numpy's range for
    seeds above 42949).

    >>> epoch_seed(2**32 - 1, 1) <= 2**32 - 1
    True
    >>> epoch_seed(0, 1) == epoch_seed(0, 1) != epoch_seed(0, 2)
    True
    """
    check_seed(seed)
    return int(np.random.SeedSequence([int(seed), int(epoch)]).generate_state(1)[0])
