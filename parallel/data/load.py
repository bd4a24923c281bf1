"""Loading a dataset by its name in ``parallel.data.DATASETS``: ``load_data``, as the CLI's ``--dataset`` does.

>>> load_data("cifar")
Traceback (most recent call last):
    ...
parallel.validate.BadValue: name must be one of fashion-mnist, synthetic; got 'cifar'
"""
from ..validate import check_choice
from . import DATASETS
from .fashion_mnist import load_fashion_mnist
from .synthetic import synthetic_dataset

__all__ = ["load_data"]


def load_data(name, data_dir=None, seed=0, progress=True):
    """Load ``"fashion-mnist"`` (downloading it if missing) or the in-memory ``"synthetic"`` set.

    Parameters
    ----------
    name : str
        One of ``DATASETS``: ``"fashion-mnist"`` or ``"synthetic"``.
    data_dir : str or os.PathLike, optional
        Fashion-MNIST's directory (``load_fashion_mnist``); defaults to ``default_data_dir()``. The synthetic
        set ignores it.
    seed : int, default 0
        The synthetic set's seed (``synthetic_dataset``); Fashion-MNIST ignores it.
    progress : bool, default True
        Show download progress bars on stderr.

    Returns
    -------
    Dataset
        The dataset's train and test examples, at full size.

    Raises
    ------
    TypeError, ValueError
        For a name that is not a string, or not in ``DATASETS``.
    DataError
        If Fashion-MNIST's files are missing and cannot be downloaded, or are malformed.
    """
    check_choice(name, "name", DATASETS)
    if name == "synthetic":
        return synthetic_dataset(seed=seed)
    return load_fashion_mnist(data_dir, download=True, progress=progress)
