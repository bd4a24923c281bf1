"""From scratch into the MXNet ecosystem: trained arrays as a symbol + params pair, or as a gluon network.

The from-scratch LeNet (``parallel.models.lenet``) is a function of ``(X, params)``. This module hands the same
network to the rest of MXNet in two ways:

- ``export_lenet`` writes MXNet's standard deployable pair ``PREFIX-symbol.json`` + ``PREFIX-0000.params``,
  which ``gluon.SymbolBlock.imports`` and ``mx.model.load_checkpoint`` read;
- ``to_gluon`` builds the textbook's gluon LeNet (``Conv2D``, ``AvgPool2D``, ``Dense``) holding the same weights.

Both predict what ``lenet(X, params)`` predicts. A gluon network trained on flat replicas (ResNet-18, the ViT, the
Transformer: ``get_params(block, ctx)``, or a strategy's ``params()`` and ``aux()``) goes back into its block and
out through gluon's own ``export``: ``export_gluon``.

The ``.params`` files are written here in plain Python, one array at a time (``save_arrays``): a value may be a
function that produces its array when its turn comes, so a model never needs to be whole on the host at once.
``array_thunks`` gives ``check_arrays``'s checks as one such function per array, and ``LazyArrays`` is a
sequence whose items are computed when read (a sharded model's arrays, gathered one at a time).

>>> import os, tempfile
>>> import mxnet as mx
>>> from mxnet import gluon
>>> from parallel.models import init_lenet_params, lenet
>>> params = init_lenet_params(seed=0)
>>> X = mx.nd.ones((2, 1, 28, 28))
>>> with tempfile.TemporaryDirectory() as tmp:
...     symbol_file, params_file = export_lenet(params, os.path.join(tmp, "lenet"))
...     net = gluon.SymbolBlock.imports(symbol_file, ["data"], params_file)
...     print(net(X).shape, (net(X) - lenet(X, params)).abs().max().asscalar() < 1e-6)
(2, 10) True
"""
import collections.abc
import errno
import operator
import os
import shutil
import struct
import tempfile

import mxnet as mx
import numpy as np
from mxnet import gluon

from .files import atomic_write, fsync_directory
from .comm.replica import Replica, block_state
from .models.lenet import LENET_PARAM_NAMES, LENET_SHAPES, lenet

__all__ = ["lenet_symbol", "LazyArrays", "array_thunks", "check_arrays", "lenet_thunks", "check_lenet_params",
           "save_arrays", "write_arrays", "write_array", "export_lenet", "export_gluon", "to_gluon"]

#: Floating-point types a LeNet can be exported in (the from-scratch network runs in any of them).
_FLOAT_DTYPES = (np.float16, np.float32, np.float64)


def lenet_symbol():
    """LeNet as an MXNet symbol: the same definition as ``lenet``, run with ``F=mx.sym``.

    Returns
    -------
    mx.sym.Symbol
        One output, the logits (batch, 10). Its arguments are the variable ``data`` (images (batch, 1, 28, 28))
        followed by ``LENET_PARAM_NAMES``. The operators get the same names on every call (a fresh name
        manager), so two exports write the same JSON.

    >>> from parallel.models import LENET_SHAPES
    >>> sym = lenet_symbol()
    >>> sym.list_arguments()[:3]
    ['data', 'conv1_weight', 'conv1_bias']
    >>> sym.infer_shape(data=(4, 1, 28, 28), **dict(zip(LENET_PARAM_NAMES, LENET_SHAPES)))[1]
    [(4, 10)]
    """
    with mx.name.NameManager():
        return lenet(mx.sym.var("data"), [mx.sym.var(name) for name in LENET_PARAM_NAMES], F=mx.sym)


class LazyArrays(collections.abc.Sequence):
    """A sequence of ``length`` arrays whose item ``i`` is ``get(i)``, computed every time it is read, never kept.

    What a sharded strategy hands ``save_checkpoint`` (``parallel.checkpoint``) and ``check_arrays``: ``get`` may
    gather a parameter from the contexts (and workers) that hold its shards, so only the array being checked and
    written is ever whole. ``len`` calls no ``get``; a slice is another ``LazyArrays`` (nothing is read).

    Parameters
    ----------
    length : int
        How many arrays, >= 0.
    get : callable
        ``get(i)`` for ``0 <= i < length``: the array (an NDArray, on any context).

    >>> import mxnet as mx
    >>> calls = []
    >>> arrays = LazyArrays(3, lambda i: calls.append(i) or mx.nd.full((2,), i))
    >>> len(arrays), calls
    (3, [])
    >>> arrays[-1].asnumpy(), len(arrays[1:]), calls
    (array([2., 2.], dtype=float32), 2, [2])
    """

    def __init__(self, length, get):
        if isinstance(length, bool) or not isinstance(length, int) or length < 0:
            raise TypeError(f"length must be an int >= 0, got {length!r}")
        if not callable(get):
            raise TypeError(f"get must be a function of the index, got {type(get).__name__}")
        self._length, self._get = length, get

    def __len__(self):
        return self._length

    def __getitem__(self, index):
        if isinstance(index, slice):
            indices = range(self._length)[index]
            return LazyArrays(len(indices), lambda j: self._get(indices[j]))
        i = operator.index(index)
        if i < 0:
            i += self._length
        if not 0 <= i < self._length:
            raise IndexError(f"index {index} out of range for {self._length} arrays")
        return self._get(i)

    def __repr__(self):
        return f"LazyArrays({self._length}, {self._get!r})"


def array_thunks(arrays, names, shapes, what="the model's"):
    """``check_arrays``'s checks, one function per array: each checks its array and returns a numpy copy.

    The container and the count are checked at once; thunk ``i`` reads ``arrays[i]`` (once per call: a
    ``LazyArrays`` computes it then) and raises what ``check_arrays`` raises for it; the last thunk also
    raises for mixed dtypes (of the arrays its group's thunks read). Called in order, once each, they do
    exactly what ``check_arrays`` does, holding one array at a time.

    Parameters
    ----------
    arrays : list, tuple or LazyArrays of NDArray
    names, shapes : sequence
        The expected arrays, in order (``check_arrays``).
    what : str
        How the messages name the set of arrays.

    Returns
    -------
    list of callable
        ``len(shapes)`` functions of no argument, each returning a numpy array.

    Raises
    ------
    TypeError
        For a container that is not a list, a tuple or a ``LazyArrays``.
    ValueError
        For the wrong number of arrays.
    """
    if not isinstance(arrays, (list, tuple, LazyArrays)):
        raise TypeError(f"params must be a list of {what} {len(shapes)} NDArrays, got {type(arrays).__name__}")
    if len(arrays) != len(shapes):
        listed = f" ({', '.join(names)})" if len(names) <= 8 else ""
        raise ValueError(f"{what} {len(shapes)} arrays{listed} are expected, got {len(arrays)}; pass all of them "
                         "in order")
    dtypes = {}   # index -> dtype name, of the arrays read so far

    def thunk(i, name, shape):
        a = _checked_copy(arrays[i], i, name, shape, what)
        dtypes[i] = a.dtype.name
        if i == len(shapes) - 1 and len(set(dtypes.values())) > 1:
            raise TypeError(f"params mix dtypes {sorted(set(dtypes.values()))}; cast them all to one "
                            "(e.g. p.astype('float32'))")
        return a

    return [lambda i=i, name=name, shape=shape: thunk(i, name, shape)
            for i, (name, shape) in enumerate(zip(names, shapes))]


def _checked_copy(p, i, name, shape, what):
    """``p`` (``params[i]``) checked (an NDArray of ``shape``, a float dtype, finite) and copied to the host."""
    if not isinstance(p, mx.nd.NDArray):
        raise TypeError(f"params[{i}] ({name}) must be an NDArray, got {type(p).__name__}; "
                        f"convert it with mx.nd.array")
    if p.shape != tuple(shape):
        raise ValueError(f"params[{i}] ({name}) has shape {p.shape}, expected {tuple(shape)}; "
                         f"pass {what} arrays in order")
    if np.dtype(p.dtype) not in _FLOAT_DTYPES:
        raise TypeError(f"params[{i}] ({name}) has dtype {np.dtype(p.dtype).name}; "
                        f"{what} arrays must be float16, float32 or float64")
    a = p.asnumpy()
    if not np.isfinite(a).all():
        raise ValueError(f"params[{i}] ({name}) holds {np.size(a) - np.isfinite(a).sum()} non-finite values "
                         f"(NaN or inf); refusing to export a diverged network, use earlier parameters")
    return a


def check_arrays(arrays, names, shapes, what="the model's"):
    """Raise unless ``arrays`` are finite float NDArrays of ``shapes``, all of one dtype; return numpy copies.

    Parameters
    ----------
    arrays : list, tuple or LazyArrays of NDArray
        On any context; ``asnumpy`` waits for them and copies them to the host.
    names, shapes : sequence
        The expected arrays, in order; the messages name the offending one (``params[4] (dense1_weight)``).
    what : str
        How the messages name the set of arrays, e.g. "LeNet's" or "ResNet-18's running statistics".

    Raises
    ------
    TypeError
        For a container that is not a list, tuple or ``LazyArrays``, a member that is not an NDArray, a dtype
        that is not float16, float32 or float64, or mixed dtypes.
    ValueError
        For the wrong number of arrays, a wrong shape, or a NaN or infinite value.
    """
    return [thunk() for thunk in array_thunks(arrays, names, shapes, what)]


def lenet_thunks(params):
    """``check_lenet_params``'s checks, one function per array (``array_thunks``), in ``LENET_SHAPES`` order."""
    if isinstance(params, (list, tuple, LazyArrays)) and len(params) != len(LENET_SHAPES):
        raise ValueError(f"LeNet has {len(LENET_SHAPES)} parameters ({', '.join(LENET_PARAM_NAMES)}), "
                         f"got {len(params)}; pass all of them in LENET_SHAPES order")
    return array_thunks(params, LENET_PARAM_NAMES, LENET_SHAPES, "LeNet's")


def check_lenet_params(params):
    """Raise unless ``params`` are LeNet's eight finite float NDArrays; return copies as numpy arrays.

    The arrays may live on any context; ``asnumpy`` waits for them and copies them to the host.
    """
    return [thunk() for thunk in lenet_thunks(params)]


def _ctx_list(ctx):
    """``ctx`` (None, a Context or a list of them) as a non-empty list of Contexts."""
    if ctx is None:
        return [mx.cpu()]
    ctx_list = list(ctx) if isinstance(ctx, (list, tuple)) else [ctx]
    if not ctx_list or not all(isinstance(c, mx.Context) for c in ctx_list):
        raise TypeError(f"ctx must be a Context or a non-empty list of them, got {ctx!r}")
    return ctx_list


#: MXNet's NDArray-list file (``NDArray::Save`` of a list): its magic, then a reserved 0, both uint64.
_LIST_MAGIC = 0x112
#: The magic of each array: version 2 (with a storage type), version 3 under numpy shape semantics.
_ARRAY_MAGIC, _ARRAY_MAGIC_NP = 0xF993FAC9, 0xF993FACA
#: MXNet's type flags (mshadow) of the numpy dtypes ``save_arrays`` writes.
_TYPE_FLAGS = {np.float32: 0, np.float64: 1, np.float16: 2, np.uint8: 3, np.int32: 4, np.int8: 5, np.int64: 6}
#: Dense storage (``kDefaultStorage``) and the CPU (device type 1, id 0): what the arrays are saved as.
_DENSE, _CPU = 0, (1, 0)


def save_arrays(path, arrays):
    """Write named arrays in MXNet's ``.params`` format (``mx.nd.load`` reads it back), one at a time, atomically.

    The file is byte for byte what ``mx.nd.save(path, {name: mx.nd.array(a, ctx=mx.cpu(), dtype=a.dtype)})``
    writes (MXNet's ``NDArray::Save`` of a list: the list's header and count, each array's magic, storage type,
    shape, context, type flag and data, then the names), written here in Python so that each array is produced
    when its turn comes and dropped once written: the host holds one array at a time.

    Parameters
    ----------
    path : str or os.PathLike
        Written through a temporary file beside it (``atomic_write``): a failure (a full disk, a file size
        limit, an exception of a value's function) leaves ``path`` as it was and no temporary file.
    arrays : mapping
        ``{name (str): array}``, in the file's order; an array is a numpy array (float16, float32, float64,
        uint8, int8, int32 or int64), or a function of no argument that returns one, called once, when its
        entry is written.

    Raises
    ------
    TypeError
        For a name that is not a string or an array of another dtype (when its entry is written).
    OSError
        When a write fails.

    >>> import os, tempfile
    >>> import mxnet as mx, numpy as np
    >>> with tempfile.TemporaryDirectory() as d:
    ...     save_arrays(os.path.join(d, "a.params"), {"w": np.ones((2, 3)), "b": lambda: np.zeros(3, "float16")})
    ...     loaded = mx.nd.load(os.path.join(d, "a.params"))
    >>> {name: (a.shape, a.dtype.__name__) for name, a in loaded.items()}
    {'w': ((2, 3), 'float64'), 'b': ((3,), 'float16')}
    """
    for name in arrays:   # before any file is touched (write_arrays checks them too, for its own callers)
        if not isinstance(name, str):
            raise TypeError(f"array names must be strings, got {name!r}")
    with atomic_write(path, "wb") as f:
        write_arrays(f, arrays)


def write_arrays(f, arrays):
    """Write what ``save_arrays`` writes into the binary file ``f`` (an open file, or an ``io.BytesIO``: the
    bytes ``mx.nd.load_frombuffer`` reads), each array produced when its turn comes and dropped once written.

    >>> import io
    >>> import mxnet as mx, numpy as np
    >>> buffer = io.BytesIO()
    >>> write_arrays(buffer, {"w": np.arange(3, dtype="float32")})
    >>> mx.nd.load_frombuffer(buffer.getvalue())["w"].asnumpy()
    array([0., 1., 2.], dtype=float32)
    """
    names = list(arrays)
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"array names must be strings, got {name!r}")
    magic = _ARRAY_MAGIC_NP if mx.util.is_np_shape() else _ARRAY_MAGIC
    f.write(struct.pack("<QQQ", _LIST_MAGIC, 0, len(names)))
    for name in names:
        value = arrays[name]
        array = value() if callable(value) else value
        write_array(f, array, name, magic)
        del array, value   # the host holds no array between two entries
    f.write(struct.pack("<Q", len(names)))
    for name in names:
        encoded = name.encode("utf-8")
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)


def write_array(f, array, name, magic):
    """Write one entry of a ``.params`` file at ``f``'s position, as ``NDArray::Save`` does: ``array`` as a dense
    array on the CPU, its data little-endian, in C order. ``save_arrays`` writes each of its entries with it.

    Parameters
    ----------
    f : binary file
        Open for writing, after the list's header and the entries before this one.
    array : array_like
        Of one of the dtypes ``save_arrays`` takes; it is not kept.
    name : str
        The entry's name, for the error message.
    magic : int
        The array format's magic number: version 2, or version 3 under ``mx.util.np_shape(True)``.

    Raises
    ------
    TypeError
        For an array of another dtype.
    """
    array = np.asarray(array)
    flag = _TYPE_FLAGS.get(array.dtype.type)
    if flag is None:
        raise TypeError(f"{name}: arrays of dtype {array.dtype.name} cannot be saved; use one of "
                        f"{', '.join(np.dtype(t).name for t in _TYPE_FLAGS)}")
    data = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
    f.write(struct.pack(f"<Iii{array.ndim}qiii", magic, _DENSE, array.ndim, *array.shape, *_CPU, flag))
    f.write(data.reshape(-1).view(np.uint8))


def _export_paths(prefix, epoch):
    """``(symbol file, params file, directory)`` of an export; raise for a bad prefix or epoch."""
    if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)):
        raise TypeError(f"epoch must be an int, got {type(epoch).__name__} {epoch!r}")
    if not 0 <= epoch <= 9999:
        raise ValueError(f"epoch must be between 0 and 9999 (the file name's four digits), got {epoch}")
    prefix = os.fspath(prefix)
    if not os.path.basename(prefix):
        raise ValueError(f"prefix {prefix!r} names a directory; add a file name prefix, "
                         f"e.g. {os.path.join(prefix, 'lenet')!r}")
    directory = os.path.dirname(os.path.abspath(prefix))
    if not os.path.isdir(directory):
        raise ValueError(f"cannot export to prefix {prefix!r}: directory {directory!r} does not exist; create it first")
    return f"{prefix}-symbol.json", "%s-%04d.params" % (prefix, epoch), directory


def export_lenet(params, prefix, epoch=0):
    """Write LeNet as MXNet's deployable pair ``PREFIX-symbol.json`` and ``PREFIX-%04d.params``.

    The symbol is ``lenet_symbol()``; the params file holds the eight arrays under the names ``arg:<name>``
    (``LENET_PARAM_NAMES``), the layout of MXNet's Module checkpoints. So both
    ``gluon.SymbolBlock.imports(symbol_file, ['data'], params_file, ctx=ctx)`` (whose ``load`` strips
    ``arg:``) and ``mx.model.load_checkpoint(prefix, epoch)`` read the pair.

    Each file is written atomically (a temporary file beside it, fsync, rename), so an
    interrupted export leaves a file either whole or as it was, and an existing pair is replaced. The params
    file is written first; the symbol is the same for every export, so the two files always form a pair.

    Parameters
    ----------
    params : list or tuple of NDArray
        The eight parameters in ``LENET_SHAPES`` order, on any context (they are copied to the CPU; this
        waits for them), all of one float dtype, all finite.
    prefix : str or os.PathLike
        Path prefix of the two files, e.g. ``"out/lenet"``; its directory must exist.
    epoch : int
        0 .. 9999, the number in the params file name (``load_checkpoint``'s ``epoch``).

    Returns
    -------
    (str, str)
        The paths of the symbol file and of the params file.

    Raises
    ------
    TypeError
        For params that are not a list of float NDArrays, or a non-integer epoch.
    ValueError
        For the wrong number of params, a wrong shape, non-finite values, a negative or too large epoch,
        or a prefix whose directory does not exist.

    >>> import os, tempfile
    >>> import mxnet as mx
    >>> from parallel.models import init_lenet_params
    >>> with tempfile.TemporaryDirectory() as tmp:
    ...     paths = export_lenet(init_lenet_params(seed=0), os.path.join(tmp, "lenet"))
    ...     print(sorted(os.listdir(tmp)))
    ...     sym, arg_params, aux_params = mx.model.load_checkpoint(os.path.join(tmp, "lenet"), 0)
    ['lenet-0000.params', 'lenet-symbol.json']
    >>> arg_params["dense1_weight"].shape, aux_params
    ((800, 128), {})
    """
    arrays = check_lenet_params(params)
    symbol_file, params_file, _ = _export_paths(prefix, epoch)
    save_arrays(params_file, {f"arg:{name}": a for name, a in zip(LENET_PARAM_NAMES, arrays)})
    with atomic_write(symbol_file, "w") as f:
        f.write(lenet_symbol().tojson())
    return symbol_file, params_file


def export_gluon(block, prefix, params=None, aux=None, epoch=0, input_shape=(1, 1, 28, 28)):
    """Write a gluon block holding trained arrays as MXNet's deployable pair, with gluon's own ``export``.

    The arrays (``params``, ``aux``) are copied into ``block`` (in place: they replace its parameters on every
    context), then ``block.hybridize(); block(zeros(input_shape)); block.export(prefix, epoch)`` writes
    ``PREFIX-symbol.json`` and ``PREFIX-%04d.params`` (``arg:`` and ``aux:`` names), which
    ``gluon.SymbolBlock.imports(symbol_file, ['data'], params_file)`` and ``mx.model.load_checkpoint`` read.
    gluon writes both files into a temporary directory beside ``prefix``; each is then renamed into place
    (params first), so an interrupted export leaves each file whole or as it was.

    Parameters
    ----------
    block : mxnet.gluon.HybridBlock
        Initialized, with known shapes (``init_resnet18()``): a network of the same architecture as the one
        trained; its own values do not matter when ``params`` is given. It is left hybridized.
    prefix : str or os.PathLike
        Path prefix of the two files, e.g. ``"out/resnet18"``; its directory must exist.
    params : list of NDArray, optional
        The trainable arrays in ``block_state(block)`` order: a replica from ``get_params`` (its ``aux`` is
        taken too unless ``aux`` is given), or a strategy's ``params()``. On any context; all finite. Default:
        export the block as it is.
    aux : list of NDArray, optional
        The block's other arrays (BatchNorm's running statistics) in ``block_state(block)`` order: a
        strategy's ``aux()``.
    epoch : int
        0 .. 9999, the number in the params file name.
    input_shape : tuple of int
        The shape of the example batch that builds the graph (zeros).

    Returns
    -------
    (str, str)
        The paths of the symbol file and of the params file.

    Raises
    ------
    TypeError, ValueError
        For arrays that are not the block's (count, shapes, dtypes) or not finite, a bad epoch, or a prefix
        whose directory does not exist; nothing is written then.
    OSError
        When a write fails.

    >>> import os, tempfile
    >>> import mxnet as mx
    >>> from mxnet import gluon
    >>> from parallel import get_params, init_resnet18
    >>> trained = init_resnet18(seed=0)
    >>> replica = get_params(trained, mx.cpu())   # trained elsewhere
    >>> X = mx.nd.ones((2, 1, 28, 28))
    >>> with tempfile.TemporaryDirectory() as tmp:
    ...     symbol_file, params_file = export_gluon(init_resnet18(seed=1), os.path.join(tmp, "resnet18"), replica)
    ...     net = gluon.SymbolBlock.imports(symbol_file, ["data"], params_file)
    >>> net(X).shape, (net(X) - trained(X)).abs().max().asscalar() < 1e-5
    ((2, 10), True)
    """
    if not isinstance(block, gluon.HybridBlock):
        raise TypeError(f"block must be a gluon HybridBlock, got {type(block).__name__}")
    names, arrays, aux_names, aux_arrays = block_state(block)
    if params is not None:
        if aux is None and isinstance(params, Replica):
            aux = params.aux
        values = check_arrays(list(params), names, [a.shape for a in arrays], "the block's")
        aux_values = [] if aux is None else check_arrays(list(aux), aux_names, [a.shape for a in aux_arrays],
                                                         "the block's non-trained")
        by_name = block.collect_params()
        for name, value in zip(names + aux_names, values + aux_values):
            by_name[name].set_data(mx.nd.array(value, dtype=value.dtype))
    else:
        check_arrays(arrays, names, [a.shape for a in arrays], "the block's")
    symbol_file, params_file, directory = _export_paths(prefix, epoch)
    block.hybridize()
    block(mx.nd.zeros(input_shape, ctx=arrays[0].context, dtype=arrays[0].dtype))
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(prefix)}.", suffix=".tmp", dir=directory)
    try:
        try:
            block.export(os.path.join(staging, "net"), epoch)
        except mx.base.MXNetError as e:
            last = [line for line in str(e).splitlines() if line.strip()][-1:] or ["no detail"]
            raise OSError(errno.EIO, f"MXNet could not write the export ({last[0].strip()})", prefix) from None
        for name, target in ((f"net-{epoch:04d}.params", params_file), ("net-symbol.json", symbol_file)):
            source = os.path.join(staging, name)
            with open(source, "rb") as f:
                os.fsync(f.fileno())
            os.replace(source, target)
        fsync_directory(directory)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return symbol_file, params_file


def to_gluon(params, ctx=None):
    """The textbook's gluon LeNet holding the from-scratch parameters: it predicts what ``lenet`` predicts.

    Conv weights have the same layout in both, (out, in, kh, kw). Dense weights do not: the from-scratch
    network computes ``dot(X, W)`` with ``W`` of shape (in, out), gluon's ``Dense`` computes ``X W^T`` with
    its weight stored as (units, in_units), so they are transposed here.

    Parameters
    ----------
    params : list or tuple of NDArray
        The eight parameters in ``LENET_SHAPES`` order, on any context, all of one float dtype, all finite.
        They are copied; the network does not share memory with them.
    ctx : Context or list of Context, optional
        Where the network's parameters live (one copy per context); ``mx.cpu()`` by default.

    Returns
    -------
    gluon.nn.HybridSequential
        ``Conv2D(20, 3, relu)``, ``AvgPool2D(2, 2)``, ``Conv2D(50, 5, relu)``, ``AvgPool2D(2, 2)``,
        ``Dense(128, relu)``, ``Dense(10)``, initialized and in the params' dtype, not hybridized
        (call ``hybridize()`` for a cached graph; the values are the same).

    Raises
    ------
    TypeError, ValueError
        For bad params, as ``export_lenet``; TypeError for a ctx that is not a Context or a list of them.

    >>> import mxnet as mx
    >>> from parallel.models import init_lenet_params, lenet
    >>> params = init_lenet_params(seed=0)
    >>> net = to_gluon(params)
    >>> X = mx.nd.ones((2, 1, 28, 28))
    >>> print(net(X).shape, (net(X) - lenet(X, params)).abs().max().asscalar() < 1e-6)
    (2, 10) True
    """
    arrays = check_lenet_params(params)
    ctx_list = _ctx_list(ctx)
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Conv2D(20, kernel_size=3, activation="relu", in_channels=1),
            gluon.nn.AvgPool2D(pool_size=2, strides=2),
            gluon.nn.Conv2D(50, kernel_size=5, activation="relu", in_channels=20),
            gluon.nn.AvgPool2D(pool_size=2, strides=2),
            gluon.nn.Dense(128, activation="relu", in_units=800),
            gluon.nn.Dense(10, in_units=128))
    net.initialize(mx.init.Zero(), ctx=ctx_list)   # every value is overwritten below
    net.cast(arrays[0].dtype.name)
    layers = [net[0], net[2], net[4], net[5]]
    for i, layer in enumerate(layers):
        W, b = arrays[2 * i], arrays[2 * i + 1]
        if isinstance(layer, gluon.nn.Dense):
            W = W.T   # (in, out) -> gluon's (units, in_units)
        layer.weight.set_data(mx.nd.array(np.ascontiguousarray(W), dtype=W.dtype))
        layer.bias.set_data(mx.nd.array(b, dtype=b.dtype))
    return net
