"""Synthetic data: ``synthetic_dataset``, a learnable Fashion-MNIST-shaped dataset made in memory.

It needs no files and no network, so examples, tests and benchmarks run anywhere; the same seed gives the
same dataset. Needs numpy, not MXNet.

>>> ds = synthetic_dataset(num_train=100, num_test=20, seed=1)
>>> ds.train_images.shape, ds.train_images.dtype, sorted(set(ds.test_labels.tolist())) == list(range(10))
((100, 28, 28), dtype('uint8'), True)
"""
import numpy as np

from ..validate import check_int
from .idx import NUM_CLASSES, Dataset

__all__ = ['synthetic_dataset']

# What makes the synthetic task hard or easy. The template constants decide how far apart the ten
# classes are (smoothness, how much of a template is shared with its look-alike class, how sharp
# its silhouette is); the per-example constants decide how much examples of one class vary (shift,
# brightness, noise). A nearest-class-mean classifier gets about 0.8 test accuracy on this data
# (0.795 with 3000 + 1000 examples, seed 0; tests/test_data.py checks 0.5 to 0.97). LeNet with the
# package's normal(0, 0.01) init (init_lenet_params) sits at chance for a few hundred SGD steps, as
# on any data, then learns it, but not to 1.0.
_KNOTS = 5  # templates are random values on a _KNOTS x _KNOTS grid ...
_BUMP = 3.0  # ... blended by Gaussian bumps of this width (pixels)
_OWN = 0.5  # weight of a template's own field against the one it shares with its look-alike class
_CONTRAST = 6.0  # sigmoid steepness turning the field into a silhouette
_MASK_RADIUS = 14.0  # pixels from the centre where the silhouette fades to black
_MAX_SHIFT = 3  # pixels an example may be shifted from its template
_BRIGHTNESS = (0.7, 1.0)  # range of the per-example brightness, times 255
_NOISE = 0.6  # standard deviation of the per-pixel noise, times 255
_CHUNK = 8192  # examples generated at a time, to bound the float32 temporaries


def _class_templates(rng):
    """Ten smooth 28x28 templates in [0, 1]: random silhouettes on a dark background.

    Classes come in five look-alike pairs (like shirt and T-shirt): each template is a random
    smooth field shared by its pair plus a weaker field of its own, pushed through a sigmoid.
    """
    grid = np.arange(28, dtype=np.float32)
    knots = np.linspace(4, 23, _KNOTS, dtype=np.float32)
    # A smooth random field: random values on a coarse grid of knots, blended by Gaussian bumps.
    bumps = np.exp(-0.5 * ((grid[:, None] - knots[None, :]) / _BUMP) ** 2)  # (28, knots)
    shared = rng.uniform(-1, 1, size=(NUM_CLASSES // 2, _KNOTS, _KNOTS))
    own = rng.uniform(-1, 1, size=(NUM_CLASSES, _KNOTS, _KNOTS))
    values = (np.repeat(shared, 2, axis=0) + _OWN * own).astype(np.float32)
    field = np.einsum('hi,cij,wj->chw', bumps, values, bumps)
    field /= field.std(axis=(1, 2), keepdims=True)
    # Fade to black away from the centre, like a garment photographed on black.
    r2 = ((grid[:, None] - 13.5) ** 2 + (grid[None, :] - 13.5) ** 2) / _MASK_RADIUS ** 2
    mask = np.exp(-r2 ** 2)
    return (mask / (1 + np.exp(-np.clip(_CONTRAST * field, -30, 30)))).astype(np.float32)


def _render(templates, n, rng):
    """Draw n examples: shifted, scaled, noisy copies of the class templates."""
    labels = rng.permutation(np.arange(n) % NUM_CLASSES).astype(np.uint8)  # balanced classes
    shifts = rng.integers(-_MAX_SHIFT, _MAX_SHIFT + 1, size=(n, 2))
    brightness = rng.uniform(*_BRIGHTNESS, size=n).astype(np.float32) * 255
    padded = np.pad(templates, ((0, 0), (_MAX_SHIFT, _MAX_SHIFT), (_MAX_SHIFT, _MAX_SHIFT)))
    base = np.arange(28) + _MAX_SHIFT
    images = np.empty((n, 28, 28), dtype=np.uint8)
    for start in range(0, n, _CHUNK):
        sl = slice(start, min(start + _CHUNK, n))
        rows = base[None, :] - shifts[sl, 0, None]  # (b, 28)
        cols = base[None, :] - shifts[sl, 1, None]
        x = padded[labels[sl, None, None].astype(np.intp), rows[:, :, None], cols[:, None, :]]
        x *= brightness[sl, None, None]
        x += rng.standard_normal(x.shape, dtype=np.float32) * np.float32(_NOISE * 255)
        np.clip(x, 0, 255, out=x)
        images[sl] = x
    return images, labels


def synthetic_dataset(num_train=60000, num_test=10000, seed=0):
    """Make a learnable Fashion-MNIST-shaped dataset in memory, with no files or network.

    Each class has a fixed smooth random template (a silhouette on black; classes come in five
    look-alike pairs); an example is its class template shifted by up to 3 pixels, scaled in
    brightness and covered in strong Gaussian noise, then clipped to 0..255. The default size is
    Fashion-MNIST's (60000 + 10000). With the textbook's normal(0, 0.01) weights LeNet first sits at
    chance for a few hundred SGD steps, on this data as on any other, then learns it well, but not
    to 1.0.

    Parameters
    ----------
    num_train, num_test : int, default 60000 and 10000
        Number of train and test examples, each >= 1.
    seed : int, default 0
        Seed; the same seed gives the same dataset, and the test set does not depend on num_train.

    Returns
    -------
    Dataset
        uint8 images (n, 28, 28) and uint8 labels (n,) in 0..9, each class equally often (+-1).

    Raises
    ------
    TypeError
        If num_train, num_test or seed is not an int.
    ValueError
        If num_train or num_test is < 1, or seed < 0.
    """
    num_train = check_int(num_train, 'num_train', low=1)
    num_test = check_int(num_test, 'num_test', low=1)
    seed = check_int(seed, 'seed', low=0)
    template_seq, train_seq, test_seq = np.random.SeedSequence(seed).spawn(3)
    templates = _class_templates(np.random.default_rng(template_seq))
    train_images, train_labels = _render(templates, num_train, np.random.default_rng(train_seq))
    test_images, test_labels = _render(templates, num_test, np.random.default_rng(test_seq))
    return Dataset(train_images, train_labels, test_images, test_labels)
