"""The IDX file format of MNIST-format datasets: ``read_idx``, ``write_idx``, ``Dataset``, ``DataError``.

An IDX file is a header (two zero bytes, the data type, the number of dimensions, then each dimension as a
big-endian uint32) followed by the values. MNIST-format datasets use two kinds of IDX file, both of unsigned
bytes: 3-d images and 1-d labels, raw or gzipped. ``Dataset`` holds a dataset's four arrays in memory;
``IMAGE_SHAPE`` and ``NUM_CLASSES`` are what the models take (every model of ``parallel.models``). Needs numpy, not
MXNet.

>>> import os, tempfile
>>> import numpy as np
>>> with tempfile.TemporaryDirectory() as directory:
...     path = write_idx(os.path.join(directory, "labels.gz"), np.array([3, 1, 4], dtype=np.uint8))
...     print(read_idx(path).tolist())
[3, 1, 4]

Every problem with the data raises ``DataError``, a ``ValueError`` whose one-line message names the
file, what is wrong and how to fix it.
"""
import gzip
import os
import struct
import zlib
from typing import NamedTuple

import numpy as np

from ..files import atomic_write

__all__ = ['DataError', 'Dataset', 'read_idx', 'write_idx', 'IMAGE_SHAPE', 'NUM_CLASSES', 'IDX_KINDS']

#: The models (LeNet, ResNet-18) take 28x28 grey images and predict 10 classes.
IMAGE_SHAPE = (28, 28)
NUM_CLASSES = 10

_GZIP_MAGIC = b'\x1f\x8b'
_IDX_UBYTE = 0x08
#: What an IDX file of each number of dimensions holds.
IDX_KINDS = {1: 'label', 3: 'image'}


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
    if zero != 0 or ndim not in IDX_KINDS:
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
    if array.ndim not in IDX_KINDS:
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
