"""An MNIST-format dataset in a directory: the four IDX files of ``FILES``, loaded by ``load_idx_dataset``.

MNIST, Fashion-MNIST and KMNIST all come as four IDX files (images and labels, train and test) with the
same names, each raw or gzipped (``NAME.gz``). ``load_idx_dataset(dir)`` loads any of them and checks that
the four files agree with each other and with the models (28x28 images, 10 classes: what every model of
``parallel.models`` takes). Needs numpy, not MXNet.

>>> import os, tempfile
>>> from parallel.data import synthetic_dataset, write_idx
>>> ds = synthetic_dataset(num_train=20, num_test=10)
>>> with tempfile.TemporaryDirectory() as directory:
...     for role, name in FILES.items():
...         _ = write_idx(os.path.join(directory, name + ".gz"), getattr(ds, role))
...     print(load_idx_dataset(directory).test_images.shape)
(10, 28, 28)
"""
import os

from .idx import IDX_KINDS, IMAGE_SHAPE, NUM_CLASSES, DataError, Dataset, read_idx

__all__ = ['FILES', 'load_idx_dataset']

#: The four files of an MNIST-format dataset, by role; each may also be gzipped as ``NAME.gz``.
FILES = {
    'train_images': 'train-images-idx3-ubyte',
    'train_labels': 'train-labels-idx1-ubyte',
    'test_images': 't10k-images-idx3-ubyte',
    'test_labels': 't10k-labels-idx1-ubyte',
}


def _find(data_dir, name):
    """Return the path of ``name`` or ``name.gz`` in data_dir (raw preferred), or None."""
    for candidate in (name, name + '.gz'):
        path = os.path.join(data_dir, candidate)
        if os.path.isfile(path):
            return path
    return None


def missing_files(data_dir):
    """The names of the four IDX files (raw or ``.gz``) that ``data_dir`` does not hold."""
    return [name for name in FILES.values() if _find(data_dir, name) is None]


def load_idx_dataset(data_dir):
    """Load an MNIST-format dataset (MNIST, Fashion-MNIST, KMNIST, ...) from a directory.

    The directory holds the four files named in ``FILES``, each raw or gzipped (``NAME.gz``);
    if both exist the raw one is read.

    Parameters
    ----------
    data_dir : str or os.PathLike
        Directory holding the four IDX files.

    Returns
    -------
    Dataset
        uint8 arrays: images (n, 28, 28) and labels (n,) in 0..9, for train and test.

    Raises
    ------
    DataError
        If files are missing (all missing ones are listed), or a file is malformed, or the files
        disagree: image and label counts, image sizes, images other than 28x28, labels >= 10.
    """
    data_dir = os.fspath(data_dir)
    missing = missing_files(data_dir)
    if missing:
        raise DataError('%s: missing %s (raw or .gz); put the MNIST-format files there, '
                        'or use the synthetic dataset' % (data_dir, ', '.join(missing)))
    paths = {role: _find(data_dir, name) for role, name in FILES.items()}
    arrays = {role: read_idx(path) for role, path in paths.items()}
    for role, array in arrays.items():
        want = 3 if role.endswith('images') else 1
        if array.ndim != want:
            raise DataError('%s: holds %s (%d-d) but %s should be %d-d %ss; check the file names'
                            % (paths[role], IDX_KINDS[array.ndim] + 's', array.ndim,
                               FILES[role], want, IDX_KINDS[want]))
    for split in ('train', 'test'):
        images, labels = arrays[split + '_images'], arrays[split + '_labels']
        if len(images) != len(labels):
            raise DataError('%s has %d images but %s has %d labels; the %s files must come from the same dataset'
                            % (paths[split + '_images'], len(images), paths[split + '_labels'],
                               len(labels), split))
        if len(images) == 0:
            raise DataError('%s: holds no examples; use a non-empty dataset' % paths[split + '_images'])
    train_hw, test_hw = arrays['train_images'].shape[1:], arrays['test_images'].shape[1:]
    if train_hw != test_hw:
        raise DataError('%s has %dx%d images but %s has %dx%d; train and test must come from the same dataset'
                        % (paths['train_images'], *train_hw, paths['test_images'], *test_hw))
    if train_hw != IMAGE_SHAPE:
        raise DataError('%s: images are %dx%d but the models take 28x28 images; '
                        'use an MNIST-format dataset of 28x28 images' % (paths['train_images'], *train_hw))
    for split in ('train', 'test'):
        labels = arrays[split + '_labels']
        top = int(labels.max())
        if top >= NUM_CLASSES:
            raise DataError('%s: label %d is out of range, the model has %d classes (labels 0..%d); '
                            'use a 10-class dataset' % (paths[split + '_labels'], top, NUM_CLASSES,
                                                        NUM_CLASSES - 1))
    return Dataset(**arrays)
