"""Checkpoints: everything a run needs to continue exactly, written atomically, independent of the layout.

A checkpoint directory holds two to four files:

- ``params-NNNNNN.params``: the model's arrays in MXNet's own format (``mx.nd.load`` reads it), by name
  (``parallel.models.model_layout``): LeNet's eight, named as in ``parallel.models.LENET_PARAM_NAMES``; or
  ResNet-18's 76
  trainable arrays and the 34 running statistics of its BatchNorm layers (the ViT's 56 trainable arrays, and no
  others), under gluon's structural names
  (``"1.0.conv1.weight"``, ``"1.0.bn1.running_mean"``: what ``save_parameters`` writes). They are the model,
  whatever strategy trained it, so a checkpoint resumes on any number of contexts and under any strategy.
- ``optimizer-NNNNNN.params``, for an optimizer with state (momentum, Adam's moments): its state for every
  parameter, whole however it was sharded (``parallel.optim.gather_state``), under ``"<state>:<parameter>"``
  (``"momentum:conv1_weight"``, ``"mean:0.0.weight"``). It resumes under any layout and any ``zero``.
- ``compression-NNNNNN.params``, for a run that compresses its gradients: every worker's error feedback (what it
  has not sent yet: a residual per context and one across the workers, PowerSGD's ``Q`` matrices), by
  ``"w<rank>/..."`` name (``parallel.compress.feedback``); a resume on another layout adds the residuals up.
- ``checkpoint.json``: the format and its version, the model's name, the parameter file's name and sha256 (and
  the optimizer file's),
  the position (the epoch in progress and how many of its batches are done), the partial sums of that epoch,
  the seed of the generator that orders its data, the metrics history, and the run's configuration (with the
  optimizer's, ``Optimizer.config()``). The optimizer's step count is not stored: one step per batch, it is the
  position's. A manifest without a model name (written before ResNet-18 was added) holds LeNet; one of version 1
  (before optimizers had state) holds no optimizer state.

A new checkpoint first writes new parameter and optimizer files, then replaces ``checkpoint.json`` (the commit
point), then removes the previous parameter file; every write is atomic (temporary file, fsync, rename). A crash or a
full disk at any moment leaves the previous checkpoint complete and loadable.

The files are written one array at a time: each array is read, checked, copied to the host and written when its
turn comes (``parallel.export.save_arrays``). A strategy that holds its parameters in shards hands
``save_checkpoint`` a ``LazyArrays`` (item ``i`` gathered when read), so no more than one array is ever whole on
the host; a worker that does not write the checkpoint calls ``read_all`` to run the same gathers in the same order.

>>> import tempfile
>>> from parallel.models import init_lenet_params
>>> state = TrainingState(epoch=1, batch=3, loss_sum=6.9, correct=3.0, seconds=0.5, shuffle_seed=7, history=[])
>>> with tempfile.TemporaryDirectory() as d:
...     _ = save_checkpoint(d, init_lenet_params(seed=0), state, {"batch_size": 256, "lr": 0.2})
...     loaded = load_checkpoint(d)
>>> loaded.state == state, len(loaded.params), loaded.config["lr"]
(True, 8, 0.2)
"""
import contextlib
import hashlib
import io
import json
import os
import zipfile
from typing import List, NamedTuple

import mxnet as mx
import numpy as np

from .compress.feedback import split_name
from .export import LazyArrays, array_thunks, save_arrays, write_arrays
from .files import MANIFEST, atomic_write, fsync_directory
from .models import MODELS, model_info
from .models.layout import model_layout
from .validate import BadValue, check_choice, check_int, check_lr, check_number, check_seed

__all__ = ["FORMAT", "VERSION", "READABLE_VERSIONS", "MANIFEST", "CheckpointError", "CheckpointMismatch", "TrainingState",
           "Snapshot", "Checkpoint", "CheckpointWriter", "CheckpointWriteError", "LazyArrays", "save_checkpoint",
           "read_all", "load_checkpoint", "checkpoint_bytes", "load_checkpoint_bytes", "packer", "has_checkpoint",
           "check_compatible", "check_run_config", "dataset_fingerprint", "COMPATIBLE_FIELDS"]

FORMAT = "parallel-checkpoint"
#: Bumped whenever a field changes meaning; a checkpoint of another version is refused, never misread.
VERSION = 2
#: The versions this package reads: 1 has no optimizer state (its runs trained with plain SGD).
READABLE_VERSIONS = (1, 2)

#: Configuration fields that decide the computation: a resume that changes one is refused. The layout
#: (strategy, devices, allreduce, stages) may change, and the number of epochs may grow.
COMPATIBLE_FIELDS = ("model", "dataset", "batch_size", "lr", "seed", "optimizer", "compression")


class CheckpointError(ValueError):
    """A checkpoint is missing, unreadable, corrupt, foreign, of another format version, or does not fit the run.

    The message is one line naming the file or field and what to do.
    """


class CheckpointMismatch(BadValue, CheckpointError):
    """A checkpoint's configuration field differs from the run's (``check_compatible``): a ``BadValue`` naming the
    field as its argument, so that the CLI's advice names the flag (``--optimizer``, ``--lr``)."""


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (a full disk, a file size limit); what was there before stays intact."""


class TrainingState(NamedTuple):
    """Where a run stands between two batches: what ``fit`` needs, with the parameters, to continue exactly."""
    #: The epoch in progress, from 1; at an epoch boundary, the next epoch with ``batch`` 0.
    epoch: int
    #: Batches of ``epoch`` already trained.
    batch: int
    #: Summed loss, correct predictions and seconds of those batches (exact Python floats).
    loss_sum: float
    correct: float
    seconds: float
    #: Seed of the ``numpy.random.RandomState`` whose permutation orders ``epoch``'s examples.
    shuffle_seed: int
    #: One metrics dict per finished epoch.
    history: List[dict]


class Snapshot(NamedTuple):
    """A run between two batches, as ``fit`` hands it to ``on_checkpoint`` and takes it back as ``resume``: the
    position, the model's arrays, the optimizer's whole state, every worker's error feedback."""
    state: TrainingState
    #: The trainable arrays (a strategy's ``params()``), live: a list, or a ``LazyArrays`` whose items are gathered
    #: when read (``save_checkpoint`` reads each once).
    params: list
    #: The arrays that are not trained (a strategy's ``aux()``: BatchNorm's running statistics); ``[]`` for LeNet.
    #: A list or a ``LazyArrays``.
    aux: list
    #: ``{state name: [array per trainable array]}`` on the CPU (``parallel.optim.gather_state``); ``{}`` for SGD.
    #: Each value a list or a ``LazyArrays``.
    optimizer_state: dict
    #: Error feedback, ``{"w<rank>/<name>": array}`` (``parallel.compress.feedback``); ``{}`` without compression.
    compression_state: dict


class Checkpoint(NamedTuple):
    """A loaded checkpoint: the model's arrays on the CPU, the training state, the configuration, the manifest; it
    has a ``Snapshot``'s fields, so ``fit(..., resume=checkpoint)`` continues it."""
    #: The trainable arrays, in ``model_layout(model).names`` order (LeNet's eight in ``LENET_SHAPES`` order).
    params: list
    state: TrainingState
    config: dict
    path: str
    #: The arrays that are not trained (BatchNorm's running statistics), in ``model_layout(model).aux_names``
    #: order; empty for LeNet.
    aux: list = ()
    #: ``"lenet"``, ``"resnet18"`` or ``"vit"`` (``MODELS``).
    model: str = "lenet"
    #: The optimizer's state, ``{state name: [array per trainable array, in params order]}`` on the CPU; empty for
    #: a stateless optimizer (plain SGD) and for checkpoints of version 1.
    optimizer_state: dict = {}
    #: Error feedback, ``{"w<rank>/<name>": array}`` on the CPU (``parallel.compress.feedback``); empty for a run
    #: without compression.
    compression_state: dict = {}


def has_checkpoint(directory):
    """Whether ``directory`` holds a checkpoint (its manifest), complete or not."""
    return os.path.isfile(os.path.join(os.fspath(directory), MANIFEST))


def dataset_fingerprint(dataset):
    """sha256 of a ``Dataset``'s four arrays (shapes and bytes): the identity a resume checks.

    >>> from parallel.data import synthetic_dataset
    >>> a, b = synthetic_dataset(40, 10, seed=0), synthetic_dataset(40, 10, seed=1)
    >>> dataset_fingerprint(a) == dataset_fingerprint(synthetic_dataset(40, 10, seed=0)) != dataset_fingerprint(b)
    True
    """
    digest = hashlib.sha256()
    for array in dataset:
        array = np.ascontiguousarray(array)
        digest.update(f"{array.dtype.str}{array.shape}".encode())
        digest.update(array.data)
    return digest.hexdigest()


def _sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def save_checkpoint(directory, params, state, config, aux=(), model="lenet", optimizer_state=None,
                    compression_state=None):
    """Write a checkpoint into ``directory`` (created if needed), replacing the previous one atomically.

    The files are written one array at a time: each array is read, checked, copied to the host, written and
    dropped before the next is read, so with ``LazyArrays`` (item ``i`` computed when read: a sharded strategy's
    parameter gathered whole) no more than one array is whole on the host at once. The arrays are read in this
    order, each exactly once: ``params[0]``, ..., ``params[-1]``, then ``aux[0]``, ..., ``aux[-1]``, then, for
    each state name of ``optimizer_state`` in the dict's order, its arrays from first to last; then
    ``compression_state`` (which is never lazy). ``read_all`` reads a ``Snapshot``'s ``LazyArrays`` in the same
    order: what a worker that does not write calls, so that the gathers behind them match on every worker. When
    a check fails, the arrays after the failing one are not read.

    Parameters
    ----------
    directory : str or os.PathLike
    params : list or LazyArrays of NDArray
        The model's trainable arrays in ``model_layout(model).names`` order (LeNet's eight; ResNet-18's in
        ``block_state`` order, as ``get_params`` replicas and the strategies' ``params()`` give them), on any
        context (read once, which waits for the device).
    state : TrainingState
    config : dict
        The run's configuration, JSON-serialisable; ``check_compatible`` compares its ``COMPATIBLE_FIELDS``.
    aux : list or LazyArrays of NDArray
        The arrays that are not trained, in ``model_layout(model).aux_names`` order (a replica's ``aux``, a
        strategy's ``aux()``); none for LeNet.
    model : str
        One of ``MODELS``.
    optimizer_state : dict, optional
        The optimizer's state as ``parallel.optim.gather_state`` gives it: ``{state name: [array per trainable
        array, in params order]}`` (each value a list or a ``LazyArrays``); None or empty for a stateless
        optimizer.
    compression_state : dict, optional
        Error feedback as ``fit`` hands it to ``on_checkpoint``: ``{"w<rank>/<name>": array}``, finite; None or
        empty without compression.

    Returns
    -------
    str
        The manifest's path.

    Raises
    ------
    ValueError, TypeError
        For arrays that are not the model's or not finite (``check_arrays``; the counts are checked before
        anything is written, each array when its turn comes): the files being written are removed and the
        manifest is not replaced, so a diverged run never replaces the last good checkpoint.
    OSError
        When a write fails (a full disk, a file size limit): the previous checkpoint is left as it was.
    """
    directory = os.fspath(directory)
    contents = _contents(model, params, aux, optimizer_state, compression_state)
    created = not os.path.isdir(directory)
    os.makedirs(directory, exist_ok=True)
    manifest_path = os.path.join(directory, MANIFEST)
    previous = _previous_files(manifest_path)
    written = {}
    try:
        _write_files(directory, contents, written)
        manifest = _manifest(model, state, config, {kind: (name, _sha256(os.path.join(directory, name)))
                                                    for kind, name in written.items()})
        with atomic_write(manifest_path, "w") as f:   # the commit point
            json.dump(manifest, f, indent=2)
            f.write("\n")
    except BaseException:
        for name in written.values():
            _remove(os.path.join(directory, name))
        if created:   # a first checkpoint that failed leaves no empty directory
            with contextlib.suppress(OSError):
                os.rmdir(directory)
        raise
    stale = [name for name in previous if name not in written.values()]
    for name in stale:
        _remove(os.path.join(directory, name))
    if stale:
        fsync_directory(directory)
    return manifest_path


def checkpoint_bytes(params, state, config, aux=(), model="lenet", optimizer_state=None, compression_state=None):
    """The checkpoint ``save_checkpoint`` writes, as the bytes of one zip archive of its files (stored, not
    compressed): what an elastic job's worker packs from its commit (``packer``) when the launcher asks for it
    over the network (``parallel.handover``). ``load_checkpoint_bytes`` reads it; unzipped, it is a checkpoint directory that
    ``load_checkpoint`` reads. Takes ``save_checkpoint``'s arguments, reads each array once in the same order, and
    raises the same errors for arrays that are not the model's or not finite.

    >>> from parallel.models import init_lenet_params
    >>> state = TrainingState(epoch=2, batch=1, loss_sum=0.5, correct=3.0, seconds=0.1, shuffle_seed=7,
    ...                       history=[{"epoch": 1, "train_loss": 0.4, "train_acc": 0.9, "test_acc": 0.8,
    ...                                 "seconds": 1.0, "images_per_second": 10.0}])
    >>> loaded = load_checkpoint_bytes(checkpoint_bytes(init_lenet_params(seed=0), state, {"lr": 0.2}))
    >>> loaded.state == state, len(loaded.params), loaded.config
    (True, 8, {'lr': 0.2})
    """
    contents = _contents(model, params, aux, optimizer_state, compression_state)
    archive, digests = io.BytesIO(), {}
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_STORED) as files:
        for prefix, content in contents:
            if content:
                name, buffer = f"{prefix}-000001.params", io.BytesIO()
                write_arrays(buffer, content)
                data = buffer.getbuffer()
                digests[prefix] = (name, hashlib.sha256(data).hexdigest())
                files.writestr(name, data)
                del data, buffer
        files.writestr(MANIFEST, json.dumps(_manifest(model, state, config, digests), indent=2) + "\n")
    return archive.getvalue()


def packer(snapshot, config, model="lenet"):
    """What an elastic job's worker commits: host copies of a ``Snapshot``'s arrays, queued on MXNet's engine
    behind the step's updates and not waited for (a ``LazyArrays``'s items, a sharded model's, are gathered now,
    in order, as on every worker), and a function of no argument that packs them as ``checkpoint_bytes`` (with
    ``config`` and ``model``) when called, waiting for the copies then. The snapshot's arrays may change after.

    >>> import mxnet as mx
    >>> from parallel.models import init_lenet_params
    >>> params = init_lenet_params(seed=0)
    >>> pack = packer(Snapshot(TrainingState(1, 2, 0.5, 1.0, 0.1, 7, []), params, [], {}, {}), {"lr": 0.1})
    >>> params[0][:] = 0   # the training goes on; the commit keeps what it had
    >>> load_checkpoint_bytes(pack()).params[0].abs().sum().asscalar() > 0
    True
    """
    def copies(arrays):
        return [arrays[i].copyto(mx.cpu()) for i in range(len(arrays))]
    params, aux = copies(snapshot.params), copies(snapshot.aux)
    optimizer_state = {name: copies(arrays) for name, arrays in (snapshot.optimizer_state or {}).items()}
    feedback = {name: value.copyto(mx.cpu()) for name, value in (snapshot.compression_state or {}).items()}
    state = snapshot.state
    return lambda: checkpoint_bytes(params, state, config, aux=aux, model=model, optimizer_state=optimizer_state,
                                    compression_state=feedback)


def _contents(model, params, aux, optimizer_state, compression_state):
    """What a checkpoint's array files hold: ``(prefix, {name: thunk})`` for the model, the optimizer's state and
    the error feedback, the counts and names checked now."""
    return (("params", _model_thunks(model, params, aux)),
            ("optimizer", _optimizer_thunks(model, optimizer_state or {})),
            ("compression", _compression_thunks(compression_state or {})))


def _manifest(model, state, config, files):
    """The manifest of a checkpoint whose array files are ``files``: ``{prefix: (file name, sha256)}``."""
    manifest = {"format": FORMAT, "version": VERSION, "model": model, "params_file": files["params"][0],
                "params_sha256": files["params"][1],
                "optimizer_file": files["optimizer"][0] if "optimizer" in files else None,
                "optimizer_sha256": files["optimizer"][1] if "optimizer" in files else None,
                "state": state._asdict(), "config": config}
    if "compression" in files:   # absent otherwise: a checkpoint without compression reads as before
        manifest.update(compression_file=files["compression"][0], compression_sha256=files["compression"][1])
    return manifest


def _write_files(directory, contents, written):
    """Write each non-empty ``(prefix, {name: thunk})`` of ``contents`` as ``<prefix>-<generation>.params``, one
    array at a time, recording each file's name in ``written`` before it is written (so a failure removes it)."""
    generation = _next_generation(directory)
    for prefix, content in contents:
        if content:
            written[prefix] = f"{prefix}-{generation:06d}.params"
            save_arrays(os.path.join(directory, written[prefix]), content)


def read_all(snapshot):
    """Read, and drop, every item of the ``LazyArrays`` of ``snapshot`` in the order ``save_checkpoint`` reads them:
    ``params``, then ``aux``, then each list of ``optimizer_state`` in the dict's order; lists are skipped.

    What a worker that does not write the checkpoint calls when the writer calls ``save_checkpoint`` on the same
    snapshot, so that the collective gathers behind the items' ``get`` run in the same order on every worker.
    Each item is waited for (``wait_to_read``) before the next is read: one array at a time, as the writer.

    >>> import mxnet as mx
    >>> calls = []
    >>> lazy = LazyArrays(2, lambda i: calls.append(i) or mx.nd.zeros(1))
    >>> state = TrainingState(1, 0, 0.0, 0.0, 0.0, 0, [])
    >>> read_all(Snapshot(state, lazy, [], {"momentum": lazy}, {}))
    >>> calls
    [0, 1, 0, 1]
    """
    for arrays in (snapshot.params, snapshot.aux, *(snapshot.optimizer_state or {}).values()):
        if isinstance(arrays, LazyArrays):
            for i in range(len(arrays)):
                item = arrays[i]
                if isinstance(item, mx.nd.NDArray):
                    item.wait_to_read()
                del item


def _model_thunks(model, params, aux):
    """The model's arrays by name, each a function that checks it (finite, the model's shape) and returns it as
    numpy; the counts are checked now, before anything is written."""
    return model_info(model).behaviour.thunks(params, aux)


def _optimizer_thunks(model, optimizer_state):
    """The optimizer's state by ``"<state>:<parameter>"``, each a function that checks the array against the
    model's layout and returns it as numpy; the names and counts are checked now."""
    if not isinstance(optimizer_state, dict):
        raise TypeError(f"optimizer_state must be a dict of state name -> arrays, got {type(optimizer_state).__name__}")
    layout = model_layout(model)
    thunks = {}
    for name, values in optimizer_state.items():
        if not isinstance(name, str) or not name or ":" in name:
            raise ValueError(f"optimizer state name {name!r} must be a non-empty string without ':'")
        checks = array_thunks(values, layout.names, layout.shapes, f"the optimizer's {name} of")
        thunks.update((f"{name}:{param}", thunk) for param, thunk in zip(layout.names, checks))
    return thunks


def _compression_thunks(compression_state):
    """Error feedback by name, each a function that checks it (finite) and returns it as float32 numpy; the names
    (``w<rank>/...``) are checked now, before anything is written."""
    if not isinstance(compression_state, dict):
        raise TypeError(f"compression_state must be a dict of name -> array, got {type(compression_state).__name__}")
    for name in compression_state:
        if split_name(name) is None:
            raise ValueError(f"compression_state name {name!r} must be w<rank>/<name>, as fit gives it")
    return {name: (lambda name=name, value=value: _compression_array(name, value))
            for name, value in compression_state.items()}


def _compression_array(name, value):
    """One array of error feedback as float32 numpy, checked finite."""
    value = np.asarray(value.asnumpy() if isinstance(value, mx.nd.NDArray) else value, dtype=np.float32)
    if not np.isfinite(value).all():
        raise ValueError(f"compression_state {name} is not finite; the checkpoint was not written")
    return value


def _remove(path):
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _previous_files(manifest_path):
    """The parameter and optimizer files the current manifest names (to remove once a new one is committed)."""
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
        names = [manifest.get(f"{kind}_file") for kind in ("params", "optimizer", "compression")]
    except (OSError, ValueError, AttributeError):
        return []
    return [name for name in names if isinstance(name, str) and name and os.path.basename(name) == name]


def _next_generation(directory):
    """One more than any parameter or optimizer file in ``directory``, so a new file never overwrites a live one."""
    numbers = [int(stem[-6:]) for stem, ext in map(os.path.splitext, os.listdir(directory))
               if ext == ".params" and stem[:-6] in ("params-", "optimizer-", "compression-") and stem[-6:].isdigit()]
    return max(numbers, default=0) + 1


def load_checkpoint(directory, model=None):
    """Read and check the checkpoint in ``directory``.

    Parameters
    ----------
    directory : str or os.PathLike
    model : str, optional
        The model the run trains (one of ``MODELS``): a checkpoint of another model is refused.

    Returns
    -------
    Checkpoint
        The model's arrays as NDArrays on ``mx.cpu()`` (trainable, then the others), the state, the
        configuration, the manifest path, the model's name and the optimizer's state.

    Raises
    ------
    CheckpointError
        One line naming the file: no checkpoint, a truncated or corrupt manifest or parameter file, a file that
        is not a checkpoint of this package, another format version, a checkpoint of another model than
        ``model``, a parameter or optimizer file whose sha256 differs from the manifest's, or arrays that are not
        the model's.
    """
    directory = os.fspath(directory)
    if not os.path.isfile(os.path.join(directory, MANIFEST)):
        raise CheckpointError(f"{directory}: no checkpoint ({MANIFEST} is missing); start a new run there "
                              "instead of resuming, or give the directory that holds the checkpoint")
    return _load_from(_Directory(directory), model)


def load_checkpoint_bytes(data, model=None, label="the checkpoint in memory"):
    """Read and check a checkpoint ``checkpoint_bytes`` made, as ``load_checkpoint`` reads a directory.

    Parameters
    ----------
    data : bytes
    model : str, optional
        As ``load_checkpoint``'s.
    label : str
        What the messages call the archive (where it came from: ``"the state from 10.0.0.2:4711"``).

    Returns
    -------
    Checkpoint
        Its ``path`` is ``"<label>:checkpoint.json"``.

    Raises
    ------
    CheckpointError
        One line naming ``label``: not a zip archive, no manifest, or any error of ``load_checkpoint``.
    """
    try:
        files = _Archive(zipfile.ZipFile(io.BytesIO(data)), label)
    except (zipfile.BadZipFile, TypeError, ValueError) as e:
        raise CheckpointError(f"{label}: not a checkpoint archive ({e}); it was cut short or is not one") from None
    if not files.has(MANIFEST):
        raise CheckpointError(f"{label}: no checkpoint ({MANIFEST} is missing from the archive)")
    return _load_from(files, model)


class _Directory:
    """A checkpoint's files in a directory: ``load_checkpoint``'s."""

    def __init__(self, directory):
        self.directory = directory

    def path(self, name):
        return os.path.join(self.directory, name)

    def has(self, name):
        return os.path.isfile(self.path(name))

    def read(self, name):
        with open(self.path(name), "rb") as f:
            return f.read()


class _Archive:
    """A checkpoint's files in a zip archive in memory: ``load_checkpoint_bytes``'s."""

    def __init__(self, archive, label):
        self.archive, self.label = archive, label

    def path(self, name):
        return f"{self.label}:{name}"

    def has(self, name):
        return name in self.archive.namelist()

    def read(self, name):
        try:
            return self.archive.read(name)
        except (zipfile.BadZipFile, OSError, ValueError) as e:   # a CRC that differs: bytes altered on the way
            raise CheckpointError(f"{self.path(name)}: unreadable ({e}); the archive is corrupt") from None


def _load_from(files, model):
    """``load_checkpoint`` of the checkpoint whose manifest is in ``files`` (a ``_Directory`` or ``_Archive``)."""
    manifest_path = files.path(MANIFEST)
    manifest, saved_model = _read_manifest(files, model)
    try:
        state = _read_state(manifest["state"])
        config = manifest["config"]
        if not isinstance(config, dict):
            raise TypeError(f"config must be an object, got {config!r}")
    except (KeyError, TypeError, ValueError) as e:   # BadType, BadValue: the field and what it holds
        raise _malformed(manifest_path, e) from None
    try:
        params_file = _verified_file(files, manifest, "params")
        optimizer_file = _verified_file(files, manifest, "optimizer") if manifest.get("optimizer_file") else None
        compression_file = (_verified_file(files, manifest, "compression") if manifest.get("compression_file")
                            else None)
    except (KeyError, TypeError) as e:
        raise _malformed(manifest_path, e) from None
    params, aux = _read_arrays(params_file, saved_model)
    optimizer_state = {} if optimizer_file is None else _read_optimizer_arrays(optimizer_file, saved_model)
    compression_state = {} if compression_file is None else _read_compression_arrays(compression_file)
    return Checkpoint(params, state, config, manifest_path, aux, saved_model, optimizer_state, compression_state)


#: What a finished epoch's metrics hold (``fit``'s history): its number, then these finite numbers.
_METRICS = ("train_loss", "train_acc", "test_acc", "seconds", "images_per_second")


def _read_state(fields):
    """The manifest's ``state`` as a ``TrainingState``, every field checked: an int epoch >= 1 and batch >= 0,
    finite sums >= 0, a seed numpy takes, and one metrics dict per finished epoch. Raises ``TypeError`` or
    ``ValueError`` naming the field (``BadType``, ``BadValue``)."""
    if not isinstance(fields, dict) or sorted(fields) != sorted(TrainingState._fields):
        raise TypeError(f"state must hold {', '.join(TrainingState._fields)}, got {fields!r:.80}")
    epoch = check_int(fields["epoch"], "state.epoch", low=1)
    batch = check_int(fields["batch"], "state.batch", low=0)
    sums = [_check_sum(fields[name], f"state.{name}") for name in ("loss_sum", "correct", "seconds")]
    check_seed(fields["shuffle_seed"], "state.shuffle_seed")
    history = fields["history"]
    if not isinstance(history, list) or len(history) != epoch - 1:
        raise ValueError(f"state.history must list the {epoch - 1} epoch(s) finished before epoch {epoch}, got "
                         f"{history!r:.80}")
    for number, metrics in enumerate(history, 1):
        if not isinstance(metrics, dict) or metrics.get("epoch") != number or isinstance(metrics["epoch"], bool):
            raise ValueError(f"state.history[{number - 1}] must be the metrics of epoch {number}, got {metrics!r:.80}")
        for name in _METRICS:
            check_number(metrics.get(name), f"state.history[{number - 1}].{name}")
    return TrainingState(epoch, batch, *sums, fields["shuffle_seed"], history)


def _check_sum(value, name):
    """``value`` as a float: a sum of losses, predictions or seconds, finite and >= 0."""
    if check_number(value, name) < 0:
        raise BadValue(name, f"{{{name}}} must be >= 0, got {value!r}")
    return value


def check_run_config(checkpoint):
    """Raise ``CheckpointError`` (the checkpoint is corrupt) unless ``checkpoint.config`` holds, well formed, what
    every checkpoint of ``python -m parallel.train`` holds: the fields a resume compares (``check_compatible``
    skips a field the checkpoint lacks). ``"optimizer"`` came with version 2 (version 1 trained plain SGD at its
    ``"lr"``), ``"model"`` with ResNet-18 (the manifest's model stands for it), ``"compression"`` with compression
    (none before it); a checkpoint that lacks them is checked without them."""
    config = checkpoint.config
    try:
        for field in ("dataset", "batch_size", "lr", "seed"):
            if field not in config:
                raise KeyError(f"config.{field}")
        dataset = config["dataset"]
        if not (isinstance(dataset, dict) and isinstance(dataset.get("name"), str)
                and isinstance(dataset.get("fingerprint"), str)):
            raise TypeError(f"config.dataset must be a name and a fingerprint, got {dataset!r:.80}")
        check_int(config["batch_size"], "config.batch_size", low=1)
        check_lr(config["lr"], "config.lr")
        check_seed(config["seed"], "config.seed")
        if "optimizer" in config and not (isinstance(config["optimizer"], dict)
                                          and isinstance(config["optimizer"].get("name"), str)):
            raise TypeError(f"config.optimizer must be an optimizer's configuration, got {config['optimizer']!r:.80}")
        for field in ("model", "compression"):
            if field in config and not isinstance(config[field], str):
                raise TypeError(f"config.{field} must be a name, got {config[field]!r:.80}")
    except (KeyError, TypeError, ValueError) as e:
        raise _malformed(checkpoint.path, e) from None


def _malformed(manifest_path, error):
    """The ``CheckpointError`` of a manifest whose field is missing (``KeyError``) or malformed."""
    detail = f"no {error.args[0]}" if isinstance(error, KeyError) else error
    return CheckpointError(f"{manifest_path}: a field is missing or malformed ({detail}); the checkpoint cannot be "
                           "resumed")


def _verified_file(files, manifest, kind):
    """The manifest's ``<kind>_file`` as ``(its path, its bytes)``, checked: a plain name, present, with the
    manifest's sha256."""
    name, expected_sha = manifest[f"{kind}_file"], manifest[f"{kind}_sha256"]
    if not (isinstance(name, str) and name and os.path.basename(name) == name):
        raise TypeError(f"{kind}_file is not a file name")
    path = files.path(name)
    if not files.has(name):
        raise CheckpointError(f"{path}: missing, but {MANIFEST} names it; the checkpoint is incomplete")
    data = files.read(name)
    if hashlib.sha256(data).hexdigest() != expected_sha:
        raise CheckpointError(f"{path}: its sha256 differs from the one in {MANIFEST}; the file is "
                              "truncated, corrupt or from another checkpoint")
    return path, data


def _read_optimizer_arrays(file, model):
    """The optimizer's state from its file (``(path, bytes)``): ``{state name: [array per trainable array, in
    layout order]}``."""
    path, _ = file
    loaded = _load(file)
    layout = model_layout(model)
    names = sorted({key.split(":", 1)[0] for key in loaded}) if isinstance(loaded, dict) else []
    expected = {f"{name}:{param}" for name in names for param in layout.names}
    if not isinstance(loaded, dict) or set(loaded) != expected:
        raise CheckpointError(f"{path}: does not hold an optimizer state of every one of {model_info(model).title}'s "
                              f"{len(layout.names)} trainable arrays")
    for key in sorted(loaded):
        shape = layout.shapes[layout.names.index(key.split(":", 1)[1])]
        if loaded[key].shape != shape:
            raise CheckpointError(f"{path}: {key} has shape {loaded[key].shape}, the parameter's is {shape}")
    return {name: [loaded[f"{name}:{param}"] for param in layout.names] for name in names}


def _read_compression_arrays(file):
    """Error feedback from its file (``(path, bytes)``): ``{"w<rank>/<name>": array}``."""
    path, _ = file
    loaded = _load(file)
    if not isinstance(loaded, dict) or any(split_name(name) is None for name in loaded):
        raise CheckpointError(f"{path}: does not hold compression residuals named w<rank>/<name>")
    return loaded


def _load(file):
    """The arrays of an MXNet parameter file (``(path, bytes)``), each checked finite (a checkpoint never stores a
    NaN or an infinity: one here was altered after it was written, its digest with it)."""
    path, data = file
    try:
        loaded = mx.nd.load_frombuffer(data)
    except mx.base.MXNetError:
        raise CheckpointError(f"{path}: not an MXNet parameter file") from None
    for key, array in sorted(loaded.items()) if isinstance(loaded, dict) else enumerate(loaded):
        finite = np.isfinite(array.asnumpy())
        if not finite.all():
            raise CheckpointError(f"{path}: {key} holds {finite.size - finite.sum()} NaN or infinite "
                                  "values, which no checkpoint stores; the file was altered after it was written: "
                                  "resume from another checkpoint or start anew")
    return loaded


def _read_manifest(files, model):
    """The manifest of ``files`` as a dict and the name of the model it holds, checked: format, version, model."""
    manifest_path = files.path(MANIFEST)
    try:
        manifest = json.loads(files.read(MANIFEST))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{manifest_path}: unreadable or corrupt ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else 'no detail'}); the checkpoint cannot be "
                              "resumed") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{manifest_path}: not a checkpoint of this package (no \"format\": \"{FORMAT}\")")
    if manifest.get("version") not in READABLE_VERSIONS:
        raise CheckpointError(f"{manifest_path}: checkpoint format version {manifest.get('version')!r}, this "
                              f"package reads versions {', '.join(map(str, READABLE_VERSIONS))}; resume it with the "
                              "version that wrote it")
    saved_model = manifest.get("model", "lenet")   # manifests without a model name hold LeNet
    try:
        model_info(saved_model)
    except (TypeError, ValueError):
        raise CheckpointError(f"{manifest_path}: a checkpoint of model {saved_model!r}, which this package does not "
                              f"know (it trains {', '.join(MODELS)})") from None
    if model is not None and saved_model != model:
        raise CheckpointError(f"{manifest_path}: a checkpoint of {saved_model}, but this run trains {model}; resume "
                              f"it as a {saved_model} run, or start a new run in another directory")
    return manifest, saved_model


#: A model of at most this many arrays (LeNet's 8) is named array by array in the messages, a larger one counted.
_LISTED = 8


def _read_arrays(params_file, model):
    """The trainable arrays and the others of ``model`` from its parameter file (``(path, bytes)``), checked
    against its layout."""
    params_path, _ = params_file
    loaded = _load(params_file)
    layout = model_layout(model)
    title = model_info(model).title
    expected = layout.names + layout.aux_names
    if not isinstance(loaded, dict) or sorted(loaded) != sorted(expected):
        listed = len(expected) <= _LISTED
        if not isinstance(loaded, dict):
            found = "a list"
        elif listed:
            found = sorted(loaded)
        else:
            found = (f"{len(loaded)} arrays ({len(set(loaded) - set(expected))} unknown, "
                     f"{len(set(expected) - set(loaded))} missing, e.g. {sorted(set(expected) ^ set(loaded))[:2]})")
        raise CheckpointError(f"{params_path}: holds {found}, not {title}'s parameters "
                              f"{list(expected) if listed else f'({len(expected)} arrays)'}")
    for name, shape in zip(expected, layout.shapes + layout.aux_shapes):
        if loaded[name].shape != shape:
            raise CheckpointError(f"{params_path}: {name} has shape {loaded[name].shape}, {title}'s is {shape}")
    return [loaded[name] for name in layout.names], [loaded[name] for name in layout.aux_names]


def _describe(field, value):
    if field == "dataset" and isinstance(value, dict):
        return f"{value.get('name')} ({str(value.get('fingerprint'))[:12]})"
    if field == "optimizer" and isinstance(value, dict):   # {"name": "sgd", "lr": 0.2, "wd": 0.0}: sgd(lr=0.2)
        return f"{value.get('name')}(" + ", ".join(f"{k}={v!r}" for k, v in value.items()   # unset ones left out
                                                   if k != "name" and v not in (None, False, 0)) + ")"
    return repr(value)


def check_compatible(saved, current):
    """Raise ``CheckpointMismatch`` (a ``CheckpointError``) when ``current`` changes a field of ``COMPATIBLE_FIELDS``
    that ``saved`` has; another optimizer is named as such, before the lr that comes with it.

    >>> check_compatible({"lr": 0.2, "seed": 0}, {"lr": 0.2, "seed": 0, "strategy": "pipeline"})
    >>> check_compatible({"lr": 0.2}, {"lr": 0.1})
    Traceback (most recent call last):
        ...
    parallel.checkpoint.CheckpointMismatch: the checkpoint was trained with lr 0.2, this run asks for 0.1; resume with the same lr, or start a new run in another directory

    Datasets are compared by their fingerprint (``dataset_fingerprint``) alone: the same examples read from
    another directory are the same dataset; their names only serve the message.
    """
    # another optimizer's name first: a change of lr or of its other settings follows from it
    for field, key in [("optimizer", _name_of)] + [(field, _key) for field in COMPATIBLE_FIELDS]:
        if field in saved and key(field, saved[field]) != key(field, current.get(field)):
            raise CheckpointMismatch(field, f"the checkpoint was trained with {field} "
                                            f"{_describe(field, saved[field])}, this run asks for "
                                            f"{_describe(field, current.get(field))}; resume with the same "
                                            f"{{{field}}}, or start a new run in another directory")


def _key(field, value):
    """What decides whether two values of ``field`` are the same: a dataset's fingerprint, else the value."""
    return value.get("fingerprint") if field == "dataset" and isinstance(value, dict) else value


def _name_of(field, value):
    """What ``check_compatible`` compares before every field: the optimizer's name alone (``"sgd"``)."""
    return value.get("name") if isinstance(value, dict) else value


class CheckpointWriter:
    """``fit``'s ``on_checkpoint`` that writes every ``Snapshot`` into ``directory`` (``save_checkpoint``), with the
    run's configuration ``config`` (a dict; ``check_compatible`` compares it on resume) and ``model``'s layout.

    Raises ``CheckpointWriteError`` (one line naming the directory) when the disk refuses a write, or when
    ``lock`` (the directory's ``parallel.files.DirectoryLock``, if given) is no longer held: a later start of the
    job took the directory over, and this process, cut off from it, must not write over its checkpoints."""

    def __init__(self, directory, config, model="lenet", lock=None):
        self.directory, self.config, self.model, self.lock = os.fspath(directory), config, model, lock

    def __call__(self, snapshot):
        if self.lock is not None and not self.lock.held():
            raise CheckpointWriteError(f"{self.directory!r} was taken over by a later start of this job (this "
                                       "process was cut off from it); nothing written")
        try:
            save_checkpoint(self.directory, snapshot.params, snapshot.state, self.config, aux=snapshot.aux,
                            model=self.model, optimizer_state=snapshot.optimizer_state,
                            compression_state=snapshot.compression_state)
        except OSError as e:   # a full disk, a file size limit: what was there before stays intact
            kept = ("the previous checkpoint there is intact" if has_checkpoint(self.directory)
                    else "no checkpoint was written")
            raise CheckpointWriteError(f"cannot write the checkpoint in {self.directory!r} ({e.strerror or e}); "
                                       f"{kept}") from None
