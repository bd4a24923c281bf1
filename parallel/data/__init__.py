"""Data for training, one module per concept: IDX files, MNIST-format directories, Fashion-MNIST's download
and cache, synthetic data, batches.

- ``idx``: the IDX file format (``read_idx``, ``write_idx``), the in-memory ``Dataset`` and ``DataError``.
- ``folder``: an MNIST-format dataset in a directory: four IDX files (images and labels, train and test),
  raw or gzipped (``FILES``); ``load_idx_dataset(dir)`` loads any of them (MNIST, Fashion-MNIST, KMNIST).
- ``fashion_mnist``: ``load_fashion_mnist()`` downloads Fashion-MNIST into ``$MXNET_HOME/datasets/fashion-mnist``
  (``~/.mxnet`` by default, the same cache as ``mxnet.gluon.data.vision.FashionMNIST``) and loads it.
- ``synthetic``: ``synthetic_dataset()`` needs no files at all.
- ``load``: ``load_data(name)`` loads one of ``DATASETS`` by its name.
- ``batches``: ``iterate_batches`` turns the uint8 arrays into float32 NDArray batches on the CPU (and
  ``epoch_seed`` gives each epoch's shuffle in a seeded run):

>>> import parallel.data as d
>>> ds = d.synthetic_dataset(num_train=100, num_test=20)
>>> ds.train_images.shape, ds.train_labels.shape, ds.test_images.shape, ds.test_labels.shape
((100, 28, 28), (100,), (20, 28, 28), (20,))
>>> X, y = next(d.iterate_batches(ds.train_images, ds.train_labels, batch_size=32))
>>> X.shape, y.shape, X.dtype
((32, 1, 28, 28), (32,), <class 'numpy.float32'>)

``load_fashion_mnist()`` is used the same way (``ds = d.load_fashion_mnist()``); it downloads
only into an empty directory or one holding genuine Fashion-MNIST files, and
``identify_dataset(dir)`` tells whether a directory holds exactly those.

Every problem with the data raises ``DataError``, a ``ValueError`` whose one-line message names the
file, what is wrong and how to fix it.

This package holds only the names of the datasets (``DATASETS``) and loads each submodule on first use of
one of its names, so ``import parallel.data`` imports neither MXNet nor numpy. The names here are the
submodules' own objects: to change a module setting such as ``FASHION_MNIST_MIRRORS``, set it in its module
(``parallel.data.fashion_mnist``), where the code reads it.
"""
from ..lazy import lazy_exports

#: The datasets the CLI offers (``--dataset``), by the names ``load_data`` takes.
DATASETS = ("fashion-mnist", "synthetic")

# Every public name of the submodules, by the submodule that defines it.
_SOURCES = {
    "idx": ["DataError", "Dataset", "read_idx", "write_idx", "IDX_KINDS", "IMAGE_SHAPE", "NUM_CLASSES"],
    "folder": ["FILES", "load_idx_dataset"],
    "fashion_mnist": ["FASHION_MNIST_MIRRORS", "FASHION_MNIST_SHA1", "DOWNLOAD_TIMEOUT", "default_data_dir",
                      "download_fashion_mnist", "load_fashion_mnist", "identify_dataset"],
    "synthetic": ["synthetic_dataset"],
    "load": ["load_data"],
    "batches": ["iterate_batches", "num_batches", "epoch_seed"],
}

__all__ = ["DATASETS"] + [name for names in _SOURCES.values() for name in names]

__getattr__, __dir__ = lazy_exports(__name__, _SOURCES)
