"""Data for training: IDX files, Fashion-MNIST download and cache, synthetic data, batches.

An MNIST-format dataset is four IDX files (images and labels, train and test), raw or gzipped.
``load_fashion_mnist()`` downloads Fashion-MNIST into ``$MXNET_HOME/datasets/fashion-mnist``
(``~/.mxnet`` by default, the same cache as ``mxnet.gluon.data.vision.FashionMNIST``) and loads it;
``load_idx_dataset(dir)`` loads any MNIST-format dataset (MNIST, Fashion-MNIST, KMNIST) from a
directory; ``synthetic_dataset()`` needs no files at all. ``iterate_batches`` turns the uint8
arrays into float32 NDArray batches on the CPU:

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
"""
import gzip
import hashlib
import os
import re
import struct
import sys
import zlib
from typing import NamedTuple

import mxnet as mx
import numpy as np
import requests
from mxnet.gluon.utils import check_sha1
from tqdm import tqdm

from .files import atomic_write

__all__ = [
    'DataError', 'Dataset', 'FILES', 'FASHION_MNIST_MIRRORS', 'FASHION_MNIST_SHA1',
    'read_idx', 'write_idx', 'load_idx_dataset', 'default_data_dir', 'download_fashion_mnist',
    'load_fashion_mnist', 'identify_dataset', 'synthetic_dataset', 'iterate_batches', 'num_batches',
]

#: The four files of an MNIST-format dataset, by role; each may also be gzipped as ``NAME.gz``.
FILES = {
    'train_images': 'train-images-idx3-ubyte',
    'train_labels': 'train-labels-idx1-ubyte',
    'test_images': 't10k-images-idx3-ubyte',
    'test_labels': 't10k-labels-idx1-ubyte',
}

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

#: The LeNet model takes 28x28 grey images and predicts 10 classes.
IMAGE_SHAPE = (28, 28)
NUM_CLASSES = 10

_GZIP_MAGIC = b'\x1f\x8b'
_IDX_UBYTE = 0x08
_IDX_KINDS = {1: 'label', 3: 'image'}  # ndim -> what such a file holds


class DataError(ValueError):
    """A data file is missing, unreadable or malformed, or a download failed.

    The message is one line naming the file, what is wrong and how to fix it.
    """


class Dataset(NamedTuple):
    """An image classification dataset held in memory as uint8 numpy arrays.

    Attributes
    ----------
    train_images : numpy.ndarray
        uint8, shape (n_train, 28, 28), pixel values 0..255.
    train_labels : numpy.ndarray
        uint8, shape (n_train,), class indices 0..9.
    test_images : numpy.ndarray
        uint8, shape (n_test, 28, 28).
    test_labels : numpy.ndarray
        uint8, shape (n_test,).
    """
    train_images: np.ndarray
    train_labels: np.ndarray
    test_images: np.ndarray
    test_labels: np.ndarray


# ---------------------------------------------------------------------------------------------
# IDX files
# ---------------------------------------------------------------------------------------------

def _read_bytes(path):
    """Return the content of ``path``, gunzipped if it starts with the gzip magic bytes."""
    try:
        with open(path, 'rb') as f:
            buf = f.read()
    except FileNotFoundError:
        raise DataError('%s: no such file; check the path or download the dataset' % path) from None
    except IsADirectoryError:
        raise DataError('%s: is a directory, not an IDX file; pass the path of a file' % path) from None
    except OSError as e:
        raise DataError('%s: cannot read (%s); check the file and its permissions'
                        % (path, e.strerror or e)) from None
    if not buf:
        raise DataError('%s: file is empty; delete it and download it again' % path)
    if buf[:2] == _GZIP_MAGIC:
        try:
            buf = gzip.decompress(buf)
        except (OSError, EOFError, zlib.error) as e:
            reason = str(e).replace('\n', ' ') or type(e).__name__
            raise DataError('%s: corrupt gzip stream (%s); delete it and download it again'
                            % (path, reason)) from None
        if not buf:
            raise DataError('%s: gzip stream is empty; delete it and download it again' % path)
    return buf


def read_idx(path):
    """Read an IDX file of unsigned bytes, raw or gzipped, into a numpy array.

    Gzip is detected by the magic bytes ``1f 8b``, not by the file name. Only the two kinds of
    file in MNIST-format datasets are accepted: images (magic ``0x00000803``, 3-d) and labels
    (magic ``0x00000801``, 1-d), both of data type ``0x08`` (uint8).

    Parameters
    ----------
    path : str or os.PathLike
        The file to read.

    Returns
    -------
    numpy.ndarray
        A writable uint8 array whose shape is the dimensions in the header.

    Raises
    ------
    DataError
        If the file is missing, empty, not gzip-decodable, has a bad magic number or data type,
        or its payload is not exactly the product of the header dimensions.
    """
    path = os.fspath(path)
    buf = _read_bytes(path)
    if len(buf) < 4:
        raise DataError('%s: only %d bytes, too short for an IDX header; delete it and download it again'
                        % (path, len(buf)))
    zero, dtype, ndim = struct.unpack('>HBB', buf[:4])
    magic = '0x%08x' % struct.unpack('>I', buf[:4])[0]
    if zero != 0 or ndim not in _IDX_KINDS:
        raise DataError('%s: bad magic number %s, expected 0x00000803 (images) or 0x00000801 (labels); '
                        'is it an uncompressed MNIST-format IDX file?' % (path, magic))
    if dtype != _IDX_UBYTE:
        raise DataError('%s: IDX data type 0x%02x is not supported (magic %s), only 0x08 (unsigned byte); '
                        'use an MNIST-format file of uint8 pixels' % (path, dtype, magic))
    header_len = 4 + 4 * ndim
    if len(buf) < header_len:
        raise DataError('%s: header truncated (%d bytes, a %d-d IDX header has %d); '
                        'delete it and download it again' % (path, len(buf), ndim, header_len))
    shape = struct.unpack('>%dI' % ndim, buf[4:header_len])
    expected = int(np.prod(shape, dtype=np.int64))
    payload = len(buf) - header_len
    if payload != expected:
        what = 'truncated' if payload < expected else 'has trailing bytes'
        raise DataError('%s: %s: header dims %s need %d payload bytes but the file has %d; '
                        'delete it and download it again'
                        % (path, what, 'x'.join(map(str, shape)), expected, payload))
    # One copy so the result is writable and does not pin the file's bytes object.
    return np.frombuffer(buf, dtype=np.uint8, count=expected, offset=header_len).reshape(shape).copy()


def write_idx(path, array):
    """Write a uint8 array as an IDX file, gzipped if ``path`` ends in ``.gz``.

    The write is atomic: the data goes to a temporary file in the same directory, which then
    replaces ``path``, so a reader never sees a half-written file.

    Parameters
    ----------
    path : str or os.PathLike
        Destination file; its directory must exist.
    array : numpy.ndarray
        uint8 array with 1 dimension (labels) or 3 dimensions (images).

    Returns
    -------
    str
        ``path``.
    """
    path = os.fspath(path)
    if not isinstance(array, np.ndarray) or array.dtype != np.uint8:
        raise TypeError('write_idx needs a numpy uint8 array, got %s; convert with array.astype(np.uint8)'
                        % (type(array).__name__ if not isinstance(array, np.ndarray) else array.dtype))
    if array.ndim not in _IDX_KINDS:
        raise ValueError('write_idx writes 1-d labels or 3-d images, got an array of shape %s'
                         % (array.shape,))
    if any(d >= 2 ** 32 for d in array.shape):
        raise ValueError('IDX dimensions must be < 2**32, got shape %s' % (array.shape,))
    header = struct.pack('>HBB', 0, _IDX_UBYTE, array.ndim) + struct.pack('>%dI' % array.ndim, *array.shape)
    payload = np.ascontiguousarray(array).tobytes()
    with atomic_write(path, 'wb') as f:
        if path.endswith('.gz'):
            with gzip.GzipFile(fileobj=f, mode='wb', mtime=0) as gz:
                gz.write(header)
                gz.write(payload)
        else:
            f.write(header)
            f.write(payload)
    return path


# ---------------------------------------------------------------------------------------------
# MNIST-format datasets on disk
# ---------------------------------------------------------------------------------------------

def _find(data_dir, name):
    """Return the path of ``name`` or ``name.gz`` in data_dir (raw preferred), or None."""
    for candidate in (name, name + '.gz'):
        path = os.path.join(data_dir, candidate)
        if os.path.isfile(path):
            return path
    return None


def _missing_files(data_dir):
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
    missing = _missing_files(data_dir)
    if missing:
        raise DataError('%s: missing %s (raw or .gz); put the MNIST-format files there, '
                        'or run with --dataset synthetic' % (data_dir, ', '.join(missing)))
    paths = {role: _find(data_dir, name) for role, name in FILES.items()}
    arrays = {role: read_idx(path) for role, path in paths.items()}
    for role, array in arrays.items():
        want = 3 if role.endswith('images') else 1
        if array.ndim != want:
            raise DataError('%s: holds %s (%d-d) but %s should be %d-d %ss; check the file names'
                            % (paths[role], _IDX_KINDS[array.ndim] + 's', array.ndim,
                               FILES[role], want, _IDX_KINDS[want]))
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
        raise DataError('%s: images are %dx%d but the LeNet model needs 28x28; '
                        'use an MNIST-format dataset of 28x28 images' % (paths['train_images'], *train_hw))
    for split in ('train', 'test'):
        labels = arrays[split + '_labels']
        top = int(labels.max())
        if top >= NUM_CLASSES:
            raise DataError('%s: label %d is out of range, the model has %d classes (labels 0..%d); '
                            'use a 10-class dataset' % (paths[split + '_labels'], top, NUM_CLASSES,
                                                        NUM_CLASSES - 1))
    return Dataset(**arrays)


# ---------------------------------------------------------------------------------------------
# Fashion-MNIST download and cache
# ---------------------------------------------------------------------------------------------

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
                            'or run with --dataset synthetic' % (data_dir, e.strerror or _reason(e))) from None
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
                raise DataError('could not download %s into %s (last error: %s); put the files there by hand '
                                'or run with --dataset synthetic' % (', '.join(todo[i:]), data_dir, reason))
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
                'put the missing files there, or use an empty directory (or the default one, without '
                '--data-dir) to download Fashion-MNIST' % (data_dir, ', '.join(missing), held))
    return ('%s: %s; not downloading Fashion-MNIST over another dataset: use an empty directory '
            '(or the default one, without --data-dir) to download Fashion-MNIST' % (data_dir, held))


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
    if download and _missing_files(data_dir):
        download_fashion_mnist(data_dir, progress=progress)
    return load_idx_dataset(data_dir)


# ---------------------------------------------------------------------------------------------
# Synthetic data
# ---------------------------------------------------------------------------------------------

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


def _check_count(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError('%s must be an int >= 1, got %r' % (name, value))
    return int(value)


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
    """
    num_train = _check_count('num_train', num_train)
    num_test = _check_count('num_test', num_test)
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError('seed must be an int >= 0, got %r' % (seed,))
    template_seq, train_seq, test_seq = np.random.SeedSequence(int(seed)).spawn(3)
    templates = _class_templates(np.random.default_rng(template_seq))
    train_images, train_labels = _render(templates, num_train, np.random.default_rng(train_seq))
    test_images, test_labels = _render(templates, num_test, np.random.default_rng(test_seq))
    return Dataset(train_images, train_labels, test_images, test_labels)


# ---------------------------------------------------------------------------------------------
# Batches
# ---------------------------------------------------------------------------------------------

def _check_batch_size(batch_size):
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ValueError('batch_size must be an int >= 1, got %r' % (batch_size,))
    return int(batch_size)


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
    """
    batch_size = _check_batch_size(batch_size)
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise ValueError('n must be an int >= 0, got %r' % (n,))
    return -(-int(n) // batch_size)


def iterate_batches(images, labels, batch_size, shuffle=False, seed=None, start=0):
    """Yield ``(X, y)`` minibatches as float32 NDArrays on ``mx.cpu()``.

    Every example appears exactly once per call; the last batch holds the remainder and may be
    smaller (nothing is padded or dropped). Only the current batch is converted to float32, with
    one numpy slice and one ``mx.nd.array`` copy per batch.

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
    """
    batch_size = _check_batch_size(batch_size)
    images, labels = np.asarray(images), np.asarray(labels)
    if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
        raise ValueError('need images of shape (n, height, width) and labels of shape (n,), got %s and %s'
                         % (images.shape, labels.shape))
    if isinstance(start, bool) or not isinstance(start, (int, np.integer)) or start < 0:
        raise ValueError('start must be an int >= 0 (batches to skip), got %r' % (start,))
    return _batches(images, labels, batch_size, shuffle, seed, int(start))


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
        yield (mx.nd.array(X, ctx=mx.cpu(), dtype=np.float32),
               mx.nd.array(labels[sl], ctx=mx.cpu(), dtype=np.float32))
