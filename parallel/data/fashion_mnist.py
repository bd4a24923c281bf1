"""Fashion-MNIST, downloaded and cached: ``load_fashion_mnist``, ``download_fashion_mnist``, ``identify_dataset``.

``load_fashion_mnist()`` downloads Fashion-MNIST into ``default_data_dir()``,
``$MXNET_HOME/datasets/fashion-mnist`` (``~/.mxnet`` by default, the same cache as
``mxnet.gluon.data.vision.FashionMNIST``), and loads it with ``parallel.data.folder.load_idx_dataset``. It
downloads only into an empty directory or one holding genuine Fashion-MNIST files (``FASHION_MNIST_SHA1``),
never into another dataset's; ``identify_dataset(dir)`` tells whether a directory holds exactly those files.
Downloads try ``FASHION_MNIST_MIRRORS`` in order (or ``$PARALLEL_FASHION_MNIST_MIRRORS``), each request
timing out after ``DOWNLOAD_TIMEOUT`` seconds. These settings, and ``FASHION_MNIST_SHA1``, are read at call
time from this module: change them here (``parallel.data.fashion_mnist.FASHION_MNIST_MIRRORS``), not in
``parallel.data``, which only re-exports them. Imports MXNet (for ``MXNET_HOME`` and its sha1 check).
"""
import hashlib
import os
import re
import sys

import mxnet as mx
import requests
from mxnet.gluon.utils import check_sha1
from tqdm import tqdm

from ..files import atomic_write
from .folder import FILES, missing_files, load_idx_dataset
from .idx import DataError

__all__ = ['FASHION_MNIST_MIRRORS', 'FASHION_MNIST_SHA1', 'DOWNLOAD_TIMEOUT', 'default_data_dir',
           'download_fashion_mnist', 'load_fashion_mnist', 'identify_dataset']

#: Where Fashion-MNIST is downloaded from, tried in order. The environment variable
#: ``PARALLEL_FASHION_MNIST_MIRRORS`` (comma-separated base URLs) replaces this list, e.g. for a
#: private mirror.
FASHION_MNIST_MIRRORS = [
    'http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/',
    'https://apache-mxnet.s3-accelerate.dualstack.amazonaws.com/gluon/dataset/fashion-mnist/',
]

#: sha1 of each gzipped Fashion-MNIST file, as in mxnet.gluon.data.vision.FashionMNIST.
FASHION_MNIST_SHA1 = {
    'train-images-idx3-ubyte.gz': '0cf37b0d40ed5169c6b3aba31069a9770ac9043d',
    'train-labels-idx1-ubyte.gz': '236021d52f1e40852b06a4c3008d8de8aef1e40b',
    't10k-images-idx3-ubyte.gz': '626ed6a7c06dd17c0eec72fa3be1740f146a2863',
    't10k-labels-idx1-ubyte.gz': '17f9ab60e7257a1620f4ad76bbbaf857c3920701',
}

#: Seconds to wait for a mirror to connect or send the next chunk, so that offline fails fast.
DOWNLOAD_TIMEOUT = 30


def default_data_dir():
    """Return where Fashion-MNIST is cached: ``$MXNET_HOME/datasets/fashion-mnist``.

    ``$MXNET_HOME`` defaults to ``~/.mxnet``; this is the directory
    ``mxnet.gluon.data.vision.FashionMNIST`` uses, so the two share one download.
    Read at call time, so setting ``MXNET_HOME`` later takes effect.

    Returns
    -------
    str
        The directory; it may not exist yet.
    """
    return os.path.join(mx.base.data_dir(), 'datasets', 'fashion-mnist')


def _reason(error):
    """One short line saying why a download failed."""
    if isinstance(error, requests.HTTPError) and error.response is not None:
        return 'HTTP %d %s' % (error.response.status_code, error.response.reason or '')
    if isinstance(error, requests.Timeout):
        return 'timed out after %d s' % DOWNLOAD_TIMEOUT
    if isinstance(error, requests.ConnectionError) and error.args:
        # requests wraps urllib3's MaxRetryError, whose .reason is the underlying failure.
        error = getattr(error.args[0], 'reason', None) or error.args[0]
    text = str(error) or type(error).__name__
    # urllib3 prefixes "<HTTPConnection object at 0x...>: " or "HTTPConnection(host=..., port=...): ".
    text = re.sub(r'^(<[^>]*>|\w+\(host=[^)]*\)): ', '', text)
    return ' '.join(text.split())


class _ChecksumMismatch(Exception):
    pass


def _fetch(url, path, sha1, progress):
    """Download url to path atomically, checking its sha1 while it streams in.

    Returns None on success, else the reason it failed (nothing is left behind either way).
    """
    try:
        with atomic_write(path, 'wb') as f, \
                requests.get(url, stream=True, timeout=DOWNLOAD_TIMEOUT) as response:
            response.raise_for_status()
            total = int(response.headers.get('content-length', 0)) or None
            digest = hashlib.sha1()
            with tqdm(total=total, unit='B', unit_scale=True, unit_divisor=1024,
                      desc=os.path.basename(path), file=sys.stderr, disable=not progress,
                      leave=False) as bar:
                for chunk in response.iter_content(chunk_size=1 << 16):
                    f.write(chunk)
                    digest.update(chunk)
                    bar.update(len(chunk))
            if digest.hexdigest() != sha1:
                raise _ChecksumMismatch()   # atomic_write drops the temporary file
        return None
    except _ChecksumMismatch:
        return 'sha1 mismatch for %s' % url
    except (requests.RequestException, OSError) as e:
        return '%s: %s' % (url, _reason(e))


def _survey(data_dir):
    """Sort the four dataset files in data_dir into genuine, foreign and missing.

    Returns three lists of file names: genuine Fashion-MNIST ``.gz`` files (sha1 as in
    ``FASHION_MNIST_SHA1``), foreign files (any raw file, which cannot be identified, or a ``.gz``
    with another sha1) and the missing names from ``FILES`` (neither raw nor ``.gz`` present).
    A raw file is what ``load_idx_dataset`` would read, so its ``.gz`` beside it is not looked at.
    """
    genuine, foreign, missing = [], [], []
    for name in FILES.values():
        raw, gz = os.path.join(data_dir, name), os.path.join(data_dir, name + '.gz')
        if os.path.isfile(raw):
            foreign.append(name)
        elif not os.path.isfile(gz):
            missing.append(name)
        elif check_sha1(gz, FASHION_MNIST_SHA1[name + '.gz']):
            genuine.append(name + '.gz')
        else:
            foreign.append(name + '.gz')
    return genuine, foreign, missing


def identify_dataset(data_dir=None):
    """Name the dataset in data_dir if it is known: today only genuine Fashion-MNIST.

    The four files of ``FILES`` must all be the gzipped Fashion-MNIST files, each with the sha1 in
    ``FASHION_MNIST_SHA1``. Raw (gunzipped) files cannot be identified, so a directory holding
    any raw dataset file is not identified. Reads the files once to hash them (about 30 MB for
    Fashion-MNIST), cheap enough for once per run; never raises for missing files.

    Parameters
    ----------
    data_dir : str or os.PathLike, optional
        Directory holding (or not) the four IDX files; it need not exist. Defaults to
        ``default_data_dir()``, as in ``load_fashion_mnist``.

    Returns
    -------
    str or None
        ``"fashion-mnist"`` if the directory holds exactly the genuine Fashion-MNIST ``.gz`` files,
        else None (missing files, raw files, other sha1s: MNIST, KMNIST, the user's own data).

    Examples
    --------
    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as empty:
    ...     print(identify_dataset(empty))
    None
    """
    data_dir = default_data_dir() if data_dir is None else os.fspath(data_dir)
    # Cheap checks first: hash nothing unless all four .gz files are there and no raw file is.
    for name in FILES.values():
        if os.path.isfile(os.path.join(data_dir, name)) or not os.path.isfile(os.path.join(data_dir, name + '.gz')):
            return None
    genuine, _, _ = _survey(data_dir)
    return 'fashion-mnist' if len(genuine) == len(FILES) else None


def _remove_empty_dirs(directories):
    """Remove the given directories, deepest first, stopping at the first that is gone or not empty."""
    for directory in directories:
        try:
            os.rmdir(directory)   # only ever removes an empty directory
        except OSError:
            break


def download_fashion_mnist(data_dir, mirrors=None, progress=True):
    """Download the missing gzipped Fashion-MNIST files into data_dir, keeping the valid ones.

    First the four dataset files in data_dir are checked: a ``.gz`` whose sha1 matches
    ``FASHION_MNIST_SHA1`` is kept; any other dataset file there (a raw file, which cannot be
    identified, or a ``.gz`` with another sha1) means the directory holds another dataset (MNIST,
    KMNIST, the user's own files), and nothing is downloaded. Each missing file is streamed from the
    mirrors in order into a temporary file, which becomes the file only once its sha1 matches; a
    failure or a checksum mismatch moves on to the next mirror. If the download fails, the
    directories this call created are removed again if they are still empty. Blocks on the network
    (each request times out after ``DOWNLOAD_TIMEOUT`` seconds).

    Parameters
    ----------
    data_dir : str or os.PathLike
        Directory to download into; created if needed.
    mirrors : list of str, optional
        Base URLs to try in order; defaults to ``$PARALLEL_FASHION_MNIST_MIRRORS`` (comma-separated)
        if set, else ``FASHION_MNIST_MIRRORS``.
    progress : bool, default True
        Show a byte progress bar per file on stderr.

    Returns
    -------
    list of str
        Paths of the files actually downloaded (empty if all were already there).

    Raises
    ------
    DataError
        If data_dir holds files of another dataset (the message names the directory, the missing
        and the foreign files), or data_dir cannot be created, or a file could not be fetched from
        any mirror (the message lists the files still missing, the directory and the last reason).
    """
    data_dir = os.fspath(data_dir)
    if mirrors is None:
        from_env = os.environ.get('PARALLEL_FASHION_MNIST_MIRRORS', '')
        mirrors = [m.strip() for m in from_env.split(',') if m.strip()] or FASHION_MNIST_MIRRORS
    mirrors = list(mirrors)
    if not mirrors:
        raise ValueError('mirrors is empty; pass at least one base URL or None for the defaults')
    _, foreign, missing = _survey(data_dir)
    if foreign:
        # Never mix Fashion-MNIST into (or over) another dataset's files.
        raise DataError(_foreign_message(data_dir, foreign, missing))
    todo = [name + '.gz' for name in missing]
    if not todo:
        return []
    # The directories makedirs is about to create, deepest first, to remove again if all fails.
    created, parent = [], os.path.abspath(data_dir)
    while not os.path.exists(parent) and os.path.dirname(parent) != parent:
        created.append(parent)
        parent = os.path.dirname(parent)
    try:
        try:
            os.makedirs(data_dir, exist_ok=True)
        except OSError as e:
            raise DataError('%s: cannot create the data directory (%s); pick a writable directory '
                            'or use the synthetic dataset' % (data_dir, e.strerror or _reason(e))) from None
        downloaded = []
        for i, name in enumerate(todo):
            path = os.path.join(data_dir, name)
            reason = None
            for mirror in mirrors:
                url = mirror.rstrip('/') + '/' + name
                reason = _fetch(url, path, FASHION_MNIST_SHA1[name], progress)
                if reason is None:
                    break
            if reason is not None:
                # Stop at the first file no mirror can serve: offline, the rest would fail the same way.
                made = ' (mkdir -p %s: the directory made for the download is removed again)' % data_dir \
                    if created else ''
                raise DataError('could not download %s into %s (last error: %s); put the files there%s, set '
                                'PARALLEL_FASHION_MNIST_MIRRORS to a mirror you can reach (docs/data.md), or use '
                                'the synthetic dataset' % (', '.join(todo[i:]), data_dir, reason, made))
            downloaded.append(path)
    except BaseException:
        _remove_empty_dirs(created)
        raise
    return downloaded


def _foreign_message(data_dir, foreign, missing):
    """The one-line DataError message for a directory holding files that are not Fashion-MNIST's."""
    held = '%s %s not Fashion-MNIST (a raw file cannot be identified; a .gz must match FASHION_MNIST_SHA1)' % (
        ', '.join(foreign), 'is' if len(foreign) == 1 else 'are')
    if missing:
        return ('%s: missing %s (raw or .gz), and %s; not downloading Fashion-MNIST into another dataset: '
                'put the missing files there, or use an empty directory (or the default directory, '
                'data_dir=None) to download Fashion-MNIST' % (data_dir, ', '.join(missing), held))
    return ('%s: %s; not downloading Fashion-MNIST over another dataset: use an empty directory '
            '(or the default directory, data_dir=None) to download Fashion-MNIST' % (data_dir, held))


def load_fashion_mnist(data_dir=None, download=True, progress=True):
    """Load Fashion-MNIST, downloading it first if any file is missing.

    When all four files are present (raw or .gz) they are loaded as they are, whatever they hold.
    When some are missing, ``download_fashion_mnist`` fetches them, unless the directory holds
    files of another dataset, in which case nothing is downloaded.

    Parameters
    ----------
    data_dir : str or os.PathLike, optional
        Directory of the four IDX files (raw or .gz); defaults to ``default_data_dir()``.
    download : bool, default True
        Download missing files with ``download_fashion_mnist``; if False, missing files raise.
    progress : bool, default True
        Show download progress bars on stderr.

    Returns
    -------
    Dataset
        60000 train and 10000 test examples of 28x28 uint8 images with labels 0..9.

    Raises
    ------
    DataError
        If files are missing and cannot be downloaded (download=False, another dataset in
        data_dir, no mirror reachable; the message names exactly the missing files), or a file is
        malformed (see ``load_idx_dataset``).
    """
    data_dir = default_data_dir() if data_dir is None else os.fspath(data_dir)
    if download and missing_files(data_dir):
        download_fashion_mnist(data_dir, progress=progress)
    return load_idx_dataset(data_dir)
