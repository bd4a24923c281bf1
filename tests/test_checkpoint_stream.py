"""Checkpoints written one array at a time: ``save_arrays`` writes the bytes ``mx.nd.save`` writes, an array at a
time; a checkpoint of ``LazyArrays`` equals one of lists, holds at most one produced array at once, leaves the
previous checkpoint whole when an array is not finite; ``read_all`` reads what ``save_checkpoint`` reads, in order."""
import os
import weakref

import mxnet as mx
import numpy as np
import pytest

from parallel import export
from parallel.checkpoint import (LazyArrays, Snapshot, TrainingState, load_checkpoint, read_all, save_checkpoint)
from parallel.export import save_arrays
from parallel.models import init_lenet_params, model_layout

pytestmark = pytest.mark.timeout(120)

STATE = TrainingState(epoch=1, batch=3, loss_sum=6.9, correct=3.0, seconds=0.5, shuffle_seed=7, history=[])
CONFIG = {"batch_size": 32, "lr": 0.1}


def _random(shape, dtype="float32", seed=0):
    return np.random.RandomState(seed).uniform(-1, 1, size=shape).astype(dtype)


# ---- save_arrays: MXNet's file format, written in Python ------------------------------------------------------

DICTS = {
    "one float32": {"w": _random((3, 4))},
    "dtypes and shapes": {"conv": _random((2, 3, 4, 5), "float16"), "bias": _random((7,), "float64"),
                          "dense": _random((5, 3)), "empty": np.zeros((0, 3), np.float32)},
    "unicode names": {"arg:poids_é": _random((4,)), "名前/重み": _random((2, 2), "float16"), "": _random((1,))},
    "many": {f"layer{i}.weight": _random((i % 5 + 1, 3), ("float16", "float32", "float64")[i % 3], seed=i)
             for i in range(40)},
    "integers": {"u8": np.arange(5, dtype=np.uint8), "i8": -np.arange(3, dtype=np.int8),
                 "i32": np.arange(6, dtype=np.int32).reshape(2, 3), "i64": np.arange(4, dtype=np.int64)},
    "not C-ordered": {"t": np.asfortranarray(_random((3, 5))), "view": _random((6, 4))[::2, 1:]},
    "none": {},
}


def _mx_save(path, arrays):
    mx.nd.save(path, {name: mx.nd.array(a, ctx=mx.cpu(), dtype=a.dtype) for name, a in arrays.items()})


def _bytes(path):
    with open(path, "rb") as f:
        return f.read()


@pytest.mark.parametrize("case", DICTS)
def test_save_arrays_writes_the_bytes_mx_nd_save_writes(case, tmp_path):
    arrays = DICTS[case]
    save_arrays(tmp_path / "ours.params", arrays)
    _mx_save(str(tmp_path / "mxnet.params"), arrays)
    assert _bytes(tmp_path / "ours.params") == _bytes(tmp_path / "mxnet.params")
    loaded = mx.nd.load(str(tmp_path / "ours.params"))
    assert list(loaded) == list(arrays)
    for name, a in arrays.items():
        assert loaded[name].dtype == a.dtype
        np.testing.assert_array_equal(loaded[name].asnumpy(), a)


def test_a_scalar_and_numpy_shape_semantics_are_written_as_mxnet_writes_them(tmp_path):
    scalar = {"s": np.array(2.5, np.float32), "v": _random((3,))}
    save_arrays(tmp_path / "ours.params", scalar)
    _mx_save(str(tmp_path / "mxnet.params"), scalar)
    assert _bytes(tmp_path / "ours.params") == _bytes(tmp_path / "mxnet.params")
    with mx.util.np_shape(True):   # version 3 of the array format
        arrays = {"w": _random((2, 0, 3)), "b": _random((4,), "float16")}
        save_arrays(tmp_path / "ours3.params", arrays)
        _mx_save(str(tmp_path / "mxnet3.params"), arrays)
        assert _bytes(tmp_path / "ours3.params") == _bytes(tmp_path / "mxnet3.params")
        assert mx.nd.load(str(tmp_path / "ours3.params"))["b"].shape == (4,)


def test_each_function_is_called_once_when_its_entry_is_written(tmp_path, monkeypatch):
    events = []
    write = export.write_array

    def recorded_write(f, array, name, magic):
        events.append(("write", name))
        write(f, array, name, magic)

    monkeypatch.setattr(export, "write_array", recorded_write)

    def produce(name, a):
        def thunk():
            events.append(("call", name))
            return a
        return thunk

    values = {name: _random((i + 2, 3), seed=i) for i, name in enumerate("abcde")}
    arrays = {name: produce(name, a) if name in "ace" else a for name, a in values.items()}
    save_arrays(tmp_path / "x.params", arrays)
    assert events == [("call", "a"), ("write", "a"), ("write", "b"), ("call", "c"), ("write", "c"), ("write", "d"),
                      ("call", "e"), ("write", "e")]
    _mx_save(str(tmp_path / "mxnet.params"), values)
    assert _bytes(tmp_path / "x.params") == _bytes(tmp_path / "mxnet.params")


def test_a_failure_mid_file_leaves_the_previous_file_and_no_temporary(tmp_path):
    path = tmp_path / "x.params"
    save_arrays(path, {"old": _random((2,))})
    before = _bytes(path)

    def diverged():
        raise ValueError("not finite")

    with pytest.raises(ValueError, match="not finite"):
        save_arrays(path, {"a": _random((3,)), "b": diverged, "c": _random((3,))})
    with pytest.raises(TypeError, match="dtype bool cannot be saved"):
        save_arrays(path, {"a": _random((3,)), "flags": np.ones(3, bool)})
    assert _bytes(path) == before and os.listdir(tmp_path) == ["x.params"]


# ---- save_checkpoint from LazyArrays ----------------------------------------------------------------------------

class Tracked(mx.nd.NDArray):
    """An NDArray that a weak reference can watch (MXNet's own has no ``__weakref__`` slot)."""
    __slots__ = ("__weakref__",)


class Producer:
    """``get`` of a ``LazyArrays``: item ``i`` a new copy of ``arrays[i]`` (as a gather makes one), recording each
    call as ``(tag, i)`` and, at each call, how many arrays it produced before are still alive (anyone holds them)
    and how many were produced but not yet written (``written`` counts the file writer's arrays)."""

    def __init__(self, arrays, tag, record, written=None):
        self.arrays, self.tag, self.record, self.written = arrays, tag, record, written
        self.alive = weakref.WeakSet()
        self.max_alive = self.max_pending = 0

    def __call__(self, i):
        self.record.append((self.tag, i))
        self.max_alive = max(self.max_alive, len(self.alive))
        if self.written is not None:
            self.max_pending = max(self.max_pending, len(self.record) - 1 - len(self.written))
        copy = self.arrays[i].copy()
        produced = Tracked(copy.handle)   # the copy's array, now owned by the tracked handle
        copy.handle = None
        self.alive.add(produced)
        return produced

    def lazy(self):
        return LazyArrays(len(self.arrays), self)


def _lenet():
    params = init_lenet_params(seed=0)
    return params, [], {"mean": [p * 0.5 for p in params], "var": [p * p for p in params]}


@pytest.fixture(scope="module")
def resnet():
    layout = model_layout("resnet18")
    params = [mx.nd.array(_random(shape, seed=i)) for i, shape in enumerate(layout.shapes)]
    aux = [mx.nd.array(_random(shape, seed=1000 + i)) for i, shape in enumerate(layout.aux_shapes)]
    return params, aux, {}


def _files(directory):
    return {name: _bytes(os.path.join(directory, name)) for name in sorted(os.listdir(directory))}


@pytest.mark.parametrize("model", ["lenet", "resnet18"])
def test_a_checkpoint_of_lazy_arrays_equals_one_of_lists(model, resnet, tmp_path):
    params, aux, optimizer = _lenet() if model == "lenet" else resnet
    record = []
    lazy = {"params": Producer(params, "params", record).lazy(), "aux": Producer(aux, "aux", record).lazy(),
            "optimizer": {name: Producer(values, name, record).lazy() for name, values in optimizer.items()}}
    save_checkpoint(tmp_path / "lists", params, STATE, CONFIG, aux=aux, model=model, optimizer_state=optimizer)
    save_checkpoint(tmp_path / "lazy", lazy["params"], STATE, CONFIG, aux=lazy["aux"], model=model,
                    optimizer_state=lazy["optimizer"])
    assert _files(tmp_path / "lazy") == _files(tmp_path / "lists")
    assert len(record) == len(params) + len(aux) + sum(map(len, optimizer.values()))   # each read once
    got, want = load_checkpoint(tmp_path / "lazy", model), load_checkpoint(tmp_path / "lists", model)
    for arrays_got, arrays_want in [(got.params, want.params), (got.aux, want.aux)] + [
            (got.optimizer_state[name], want.optimizer_state[name]) for name in optimizer]:
        assert len(arrays_got) == len(arrays_want)
        for g, w in zip(arrays_got, arrays_want):
            assert g.dtype == w.dtype
            np.testing.assert_array_equal(g.asnumpy(), w.asnumpy())
    np.testing.assert_array_equal(got.params[-1].asnumpy(), params[-1].asnumpy())


def test_at_most_one_produced_array_is_alive_while_writing(tmp_path, monkeypatch):
    params, _, optimizer = _lenet()
    written, record = [], []
    write = export.write_array

    def counted_write(f, array, name, magic):
        write(f, array, name, magic)
        written.append(weakref.ref(array))   # the host copy, which must be dropped once written

    monkeypatch.setattr(export, "write_array", counted_write)
    producers = [Producer(params, "params", record, written)] + [Producer(values, name, record, written)
                                                                  for name, values in optimizer.items()]
    host_alive = []
    original_call = Producer.__call__

    def call_and_count_host_copies(self, i):
        host_alive.append(sum(ref() is not None for ref in written))
        return original_call(self, i)

    monkeypatch.setattr(Producer, "__call__", call_and_count_host_copies)
    save_checkpoint(tmp_path, producers[0].lazy(), STATE, CONFIG,
                    optimizer_state={p.tag: p.lazy() for p in producers[1:]})
    assert len(record) == len(written) == 24
    assert max(p.max_alive for p in producers) == 0      # none alive when the next is produced: at most one at once
    assert max(p.max_pending for p in producers) == 0    # each written before the next is produced
    assert max(host_alive) == 0                          # and its host copy dropped
    # the same counters see arrays that are all produced before they are written
    eager = Producer(params, "eager", [], written=[])
    arrays = [eager.lazy()[i] for i in range(8)]
    assert eager.max_alive == 7 and eager.max_pending == 7 and len(arrays) == 8


@pytest.mark.parametrize("where", ["params", "optimizer"])
def test_a_nan_mid_file_keeps_the_previous_checkpoint(where, tmp_path):
    params, _, optimizer = _lenet()
    save_checkpoint(tmp_path, params, STATE, CONFIG, optimizer_state=optimizer)
    before = _files(tmp_path)
    diverged = [p.copy() for p in params]
    diverged[4][0, 0] = float("nan")   # the 5th array, dense1_weight
    record = []
    lazy_params = Producer(diverged if where == "params" else params, "params", record).lazy()
    lazy_optimizer = {"mean": Producer(diverged if where == "optimizer" else params, "mean", record).lazy(),
                      "var": Producer(params, "var", record).lazy()}
    with pytest.raises(ValueError, match=r"params\[4\] \(dense1_weight\) holds 1 non-finite values"):
        save_checkpoint(tmp_path, lazy_params, STATE, {**CONFIG, "lr": 0.2}, optimizer_state=lazy_optimizer)
    assert _files(tmp_path) == before                    # no new file, no temporary, the manifest unchanged
    assert not [name for name in os.listdir(tmp_path) if name.endswith(".tmp")]
    expected = [("params", i) for i in range(5)] if where == "params" else (
        [("params", i) for i in range(8)] + [("mean", i) for i in range(5)])
    assert record == expected                            # nothing read after the failing array
    loaded = load_checkpoint(tmp_path)
    assert loaded.config["lr"] == 0.1
    for got, want in zip(loaded.params + loaded.optimizer_state["mean"], params + optimizer["mean"]):
        np.testing.assert_array_equal(got.asnumpy(), want.asnumpy())


def test_a_failed_first_checkpoint_leaves_no_directory(tmp_path):
    params = [p.copy() for p in init_lenet_params(seed=0)]
    params[7][0] = float("inf")
    with pytest.raises(ValueError, match=r"params\[7\] \(dense2_bias\)"):
        save_checkpoint(tmp_path / "run", LazyArrays(8, params.__getitem__), STATE, CONFIG)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("model", ["lenet", "resnet18"])
def test_read_all_reads_what_save_checkpoint_reads_in_its_order(model, resnet, tmp_path):
    params, aux, optimizer = _lenet() if model == "lenet" else resnet
    if model == "resnet18":
        optimizer = {"momentum": params}
    sequences = []
    for _ in range(2):
        record = []
        sequences.append(record)
        snapshot = Snapshot(STATE, Producer(params, "params", record).lazy(),
                            Producer(aux, "aux", record).lazy() if aux else [],
                            {name: Producer(values, name, record).lazy() for name, values in optimizer.items()}, {})
        if len(sequences) == 1:
            save_checkpoint(tmp_path, snapshot.params, STATE, CONFIG, aux=snapshot.aux, model=model,
                            optimizer_state=snapshot.optimizer_state)
        else:
            read_all(snapshot)
    assert sequences[0] == sequences[1]
    expected = ([("params", i) for i in range(len(params))] + [("aux", i) for i in range(len(aux))]
                + [(name, i) for name, values in optimizer.items() for i in range(len(values))])
    assert sequences[0] == expected


def test_lazy_arrays_is_a_sequence_read_when_indexed():
    calls = []
    lazy = LazyArrays(4, lambda i: calls.append(i) or mx.nd.full((1,), i))
    assert len(lazy) == 4 and calls == []
    assert lazy[-1].asscalar() == 3 and calls == [3]
    assert lazy[3] is not lazy[3]                         # computed every time it is read, never kept
    tail = lazy[1::2]
    assert isinstance(tail, LazyArrays) and len(tail) == 2 and calls == [3, 3, 3]
    assert [a.asscalar() for a in tail] == [1, 3]
    with pytest.raises(IndexError):
        lazy[4]
    with pytest.raises(TypeError, match="length must be an int"):
        LazyArrays(-1, lambda i: None)
