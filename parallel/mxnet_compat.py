"""The one place the package reads MXNet's private API: each function here names the internal it reads and says why
no public API of MXNet 1.9.1 serves, so a new MXNet version is checked against this file alone.

Every module, benchmark and test that needs one of these internals calls the function here instead of touching a
``_name`` of MXNet. Nothing here imports MXNet until a function that needs it is called, so any module may import
this one before MXNet starts (``python -m parallel.train --help`` does not load it).

>>> import mxnet as mx
>>> nd_operator("_copy")(mx.nd.ones(2)).asnumpy()
array([1., 1.], dtype=float32)
"""
import sys

__all__ = ["structural_params", "mxnet_library", "nd_operator", "sparse_label", "trainer_params",
           "trainer_kvstore", "trainer_updates_on_kvstore", "trainer_is_distributed", "mark_gradient_fresh",
           "import_mxnet_without_scipy_stats", "host_array", "rows"]


def host_array(values, dtype):
    """``mx.nd.array(values, ctx=mx.cpu(), dtype=dtype)``, the same bytes, in about 40 Python calls where it takes
    about 215 (every batch of a run makes two).

    Reads ``NDArray._sync_copyfrom``: the synchronous copy from host memory that ``mx.nd.array`` ends with, after
    its general indexing path (``__setitem__``'s checks and slices); no public call copies a numpy array into a
    new NDArray without that path. ``mx.nd.from_numpy`` shares the memory instead and frees it through a Python
    callback that an engine thread would run, waiting for the interpreter's lock.

    >>> import numpy as np
    >>> host_array(np.arange(6).reshape(2, 3), "float32").asnumpy()
    array([[0., 1., 2.],
           [3., 4., 5.]], dtype=float32)
    """
    import mxnet as mx
    import numpy as np
    values = np.asarray(values, dtype=dtype, order="C")
    array = mx.nd.empty(values.shape, ctx=mx.cpu(), dtype=values.dtype)
    array._sync_copyfrom(values)
    return array


def rows(array, start, stop):
    """``array[start:stop]`` along the first axis, a view of the same memory, in about 20 Python calls where the
    indexing path takes about 46 (``split_and_load`` makes one a shard of every batch).

    Reads ``NDArray._slice``: the view that ``NDArray.__getitem__`` ends with for a basic slice of the first axis,
    after its general analysis of the key (steps, ellipses, new axes, negative bounds); ``start`` and ``stop`` here
    are already bounds ``0 <= start < stop <= len(array)``.

    >>> import mxnet as mx
    >>> rows(mx.nd.arange(6).reshape((3, 2)), 1, 3).asnumpy()
    array([[2., 3.],
           [4., 5.]], dtype=float32)
    """
    return array._slice(start, stop)


def structural_params(block):
    """A gluon block's parameters by their structural names (``"0.1.weight"``: child 0, its child 1, ``weight``).

    Reads ``Block._collect_params_with_prefix()``: the names ``save_parameters`` writes, the same in every instance
    of a network. gluon's public ``collect_params()`` keys them by ``Parameter.name``, which counts the instances
    made so far (``hybridsequential3_conv0_weight``), and no public call gives the structural ones.

    Parameters
    ----------
    block : mxnet.gluon.Block
        Initialized or not.

    Returns
    -------
    dict
        ``{structural name: Parameter}``, in the block's order.
    """
    return block._collect_params_with_prefix()


def mxnet_library():
    """libmxnet as ``ctypes`` loaded it (``mxnet.base._LIB``), to call MXNet's C API and the OpenMP runtime linked
    into it.

    MXNet exposes ``mxnet.base.check_call`` for the C API's return codes but not the library handle itself; the
    C functions the package needs (``MXEnginePushSyncND``, OpenMP's ``omp_get_max_threads``) have no Python
    binding.
    """
    import mxnet as mx
    return mx.base._LIB


def data_address(array):
    """The address of ``array``'s first element (``MXNDArrayGetData``): a view of a flat buffer starts inside the
    buffer, so two arrays share memory where their ranges overlap. None for an array whose memory MXNet has not
    allocated yet (before its first operation has run)."""
    import ctypes
    import mxnet as mx
    pointer = ctypes.c_void_p()
    mx.base.check_call(mxnet_library().MXNDArrayGetData(array.handle, ctypes.byref(pointer)))
    return pointer.value


def nd_operator(name):
    """The NDArray function of MXNet's operator called ``name``, as a symbol's JSON names it (``"Convolution"``,
    ``"_plus_scalar"``).

    Reads ``mxnet.ndarray._internal`` for the operators whose names begin with ``_``: MXNet registers those there
    only, and a graph built by gluon holds many of them (``_copy``, ``_mul_scalar``, ...); the public ``mx.nd``
    namespace has the others.

    Raises
    ------
    AttributeError
        When MXNet has no operator of that name.
    """
    import mxnet as mx
    function = getattr(mx.nd, name, None)
    return function if function is not None else getattr(mx.nd._internal, name)


def sparse_label(loss):
    """Whether a gluon ``SoftmaxCrossEntropyLoss`` takes class indices (``sparse_label=True``, its default) rather
    than a distribution over the classes.

    Reads ``SoftmaxCrossEntropyLoss._sparse_label``: the loss keeps its constructor's argument there and has no
    public accessor.
    """
    return bool(loss._sparse_label)


def trainer_params(trainer):
    """The parameters a ``gluon.Trainer`` updates, in its key order (sorted by name: key ``i`` is the ``i``-th).

    Reads ``Trainer._params``: the Trainer takes the parameters in its constructor and has no public accessor
    for the list it numbers its kvstore keys by.
    """
    return list(trainer._params)


def trainer_kvstore(trainer):
    """The kvstore a ``gluon.Trainer`` uses (``None`` before its first step, or without one).

    Reads ``Trainer._kvstore``: set lazily at the first step from the constructor's ``kvstore`` argument, with
    no public accessor.
    """
    return trainer._kvstore


def trainer_updates_on_kvstore(trainer):
    """Whether a ``gluon.Trainer`` runs the optimizer in its kvstore (after its first step).

    Reads ``Trainer._update_on_kvstore``: decided at the first step from the kvstore's capabilities, with no
    public accessor.
    """
    return bool(trainer._update_on_kvstore)


def trainer_is_distributed(trainer):
    """Whether a ``gluon.Trainer``'s kvstore spans several processes (after its first step).

    Reads ``Trainer._distributed``: decided at the first step from the kvstore's type, with no public accessor.
    """
    return bool(trainer._distributed)


def mark_gradient_fresh(array):
    """Mark the gradient of the NDArray ``array`` (a parameter's data) as written since the last update, as
    ``backward()`` does, so that ``gluon.Trainer.step`` updates that parameter. In place.

    Sets ``NDArray._fresh_grad`` (MXNet's ``MXNDArraySetGradState``): the only way to time ``Trainer.step`` alone,
    without a backward pass before each call, since no public call sets it.
    """
    array._fresh_grad = True


def import_mxnet_without_scipy_stats():
    """Import MXNet, as the CLI does, without the ``scipy.stats`` it imports at start-up; returns ``mxnet``.

    MXNet 1.9.1 imports ``scipy.stats`` wherever scipy is installed (``mxnet/contrib/quantization.py``: ``from
    scipy import stats``, for the entropy calibration of INT8 quantization, which no run of the package does):
    0.3 s of a core in each process, a seventh of MXNet's import, and no MXNet setting skips it. During the
    import ``scipy.stats`` is marked absent in ``sys.modules``, so MXNet takes its own path for a machine without
    scipy (``stats = None``: its entropy calibration then cannot run in this process); afterwards the mark is gone
    and ``import scipy.stats`` works as ever. If MXNet is already imported, nothing changes.
    """
    if "mxnet" not in sys.modules and "scipy.stats" not in sys.modules:
        sys.modules["scipy.stats"] = None   # what the import system reads as "no such module"
        try:
            import mxnet
        finally:
            if sys.modules.get("scipy.stats", False) is None:
                del sys.modules["scipy.stats"]
    import mxnet
    return mxnet
