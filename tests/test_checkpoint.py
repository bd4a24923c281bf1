"""Checkpoints and exact resume through the API: bitwise on the same layout, rtol 1e-5 across layouts."""
import hashlib
import json
import os
import types

import mxnet as mx
import numpy as np
import pytest

from parallel import checkpoint as ckpt
from parallel.models import LENET_PARAM_NAMES
from parallel.models import init_lenet_params
from parallel.checkpoint import Snapshot, TrainingState
from parallel.config import RunConfig
from parallel.comm import get_params
from parallel.data.batches import epoch_seed
from parallel.fit import NonFiniteLossError, TrainingStopped, fit
from parallel.models import init_model
from parallel.strategies import Stages, make_strategy
from parallel.optim import SGD, Adam, AdamW, Cosine, Step
from conftest import assert_same_parameters, easy_dataset, fast_only, lenet_strategy, pairwise, stop_before

BATCH = 32
DATA = easy_dataset(num_train=200, num_test=50, seed=4)   # 7 batches per epoch, the last one of 8
PER_EPOCH = 7
EPOCHS = 2

LAYOUTS = {   # (strategy, devices, options)
    **{f"data-{a}": ("data", 2, {"algorithm": a}) for a in ("naive", "fused", "ring", "tree")},
    "model": ("model", 2, {"stages": Stages(boundaries=[2])}),
    "pipeline": ("pipeline", 2, {"stages": Stages(micro_batches=3)}),
    **{f"hybrid-{a}": ("hybrid", 4, {"stages": 2, "algorithm": a}) for a in ("naive", "fused", "ring", "tree")},
}


def _strategy(layout, params):
    name, k, options = LAYOUTS[layout]
    options = dict(options)
    algorithm = options.pop("algorithm", "fused")
    return make_strategy(name, params, [mx.cpu(i) for i in range(k)], batch_size=BATCH, reducer=algorithm,
                         **options)


def _run(layout, params=None, resume=None, stop=None, on_checkpoint=None, epochs=EPOCHS, lr=0.3, optimizer=None,
         accumulate=1):
    strategy = _strategy(layout, init_lenet_params(seed=5) if params is None else params)
    history, _ = fit(DATA, strategy, lr if optimizer is None else optimizer,
                     RunConfig(epochs=epochs, batch_size=BATCH, seed=5, accumulate=accumulate),
                     stop=stop, on_checkpoint=on_checkpoint, resume=resume)
    return [p.asnumpy() for p in strategy.params()], history


def _saver(tmp_path, saves=None):
    """An on_checkpoint that writes every checkpoint (with the optimizer's state) to ``tmp_path``."""
    write = ckpt.CheckpointWriter(tmp_path, {"batch_size": BATCH, "lr": 0.3, "seed": 5})

    def save(snapshot):
        if saves is not None:
            saves.append(snapshot.state)
        write(snapshot)
    return save


def _without_timings(history):
    return [{k: v for k, v in m.items() if k not in ("seconds", "images_per_second")} for m in history]


class _Uninterrupted(dict):
    """Each layout's uninterrupted run, trained the first time a test asks for it (a fast run asks for few)."""

    def __missing__(self, layout):
        self[layout] = _run(layout)
        return self[layout]


@pytest.fixture(scope="module")
def uninterrupted():
    return _Uninterrupted()


# Stop before: the first batch, a batch mid-epoch, the last batch of epoch 1, the first batch of epoch 2
# (just after the epoch-1 checkpoint), and the last batch of the run.
STOPS = {"first batch": 1, "mid-epoch": 4, "last batch": PER_EPOCH, "epoch boundary": PER_EPOCH + 1,
         "last batch of the run": 2 * PER_EPOCH}


def _fast_stop(i):
    """The stop point the fast tier tries the ``i``-th case at: the cases take the stop points in turn, so every
    case and every stop point is in the fast tier once; the slow tier runs the rest of the product."""
    return list(STOPS)[i % len(STOPS)]


#: The layouts the fast tier interrupts, one stop point each (in turn): each strategy, and the fused, ring and naive
#: sums (the tree's is in test_resume_with_optimizer_state_is_bitwise's); the slow tier runs every layout at every
#: stop point.
_FAST_INTERRUPTED = ("data-fused", "model", "pipeline", "hybrid-ring", "data-naive")


@pytest.mark.parametrize("layout, where", [
    pytest.param(layout, where, marks=() if layout in _FAST_INTERRUPTED and
                 where == _fast_stop(_FAST_INTERRUPTED.index(layout)) else pytest.mark.slow)
    for layout in LAYOUTS for where in STOPS])
def test_interrupted_and_resumed_equals_uninterrupted_bitwise(layout, where, uninterrupted, tmp_path):
    """Stopped at a batch boundary, checkpointed to disk, loaded and resumed on the same layout: the
    parameters are bitwise those of the run never stopped, and the history holds every epoch once, equal."""
    saves = []
    with pytest.raises(TrainingStopped) as stopped:
        _run(layout, stop=stop_before(STOPS[where]), on_checkpoint=_saver(tmp_path, saves))
    position = stopped.value.state
    call = STOPS[where] - 1
    assert (position.epoch, position.batch) == (1 + call // PER_EPOCH, call % PER_EPOCH)
    assert saves[-1] == position
    loaded = ckpt.load_checkpoint(tmp_path)
    assert loaded.state == position
    params, history = _run(layout, params=loaded.params, resume=loaded)
    want_params, want_history = uninterrupted[layout]
    for got, want in zip(params, want_params):
        np.testing.assert_array_equal(got, want)
    assert _without_timings(history) == _without_timings(want_history)


def _optimizer(name, zero):
    return {"momentum": lambda: SGD(0.1, momentum=0.9, wd=1e-4, zero=zero),
            "nesterov": lambda: SGD(0.1, momentum=0.9, nesterov=True, clip_norm=1.0, zero=zero,
                                    schedule=Cosine(EPOCHS * PER_EPOCH, warmup_steps=3)),
            "adam": lambda: Adam(0.003, wd=1e-4, zero=zero, schedule=Step([5, 10], 0.5)),
            "adamw": lambda: AdamW(0.003, zero=zero, clip_norm=0.5)}[name]()


#: (optimizer, zero, accumulate, layout, stop point): every pair of values of two of these meets in a case (a
#: covering array, ``conftest.pairwise``: 22 cases where the product has 720; an optimizer's state, its sharding,
#: the accumulation, the layout's sum and the stop point interact two at a time); a few cases holding every value
#: but the stop point's in the fast tier (test_interrupted_and_resumed_equals_uninterrupted_bitwise stops at each).
@pytest.mark.parametrize("name, zero, accumulate, layout, where", pairwise(
    ["momentum", "nesterov", "adam", "adamw"], [0, 1, 2], [1, 2, 3], ["data-fused", "data-ring", "hybrid-tree",
                                                                      "pipeline"], list(STOPS), fast_axes=4))
def test_resume_with_optimizer_state_is_bitwise(name, zero, accumulate, layout, where, tmp_path):
    """The optimizer's state and the schedule's position survive a stop anywhere: bitwise the run never stopped."""
    want, want_history = _run(layout, optimizer=_optimizer(name, zero), accumulate=accumulate)
    with pytest.raises(TrainingStopped):
        _run(layout, stop=stop_before(STOPS[where]), on_checkpoint=_saver(tmp_path), optimizer=_optimizer(name, zero),
             accumulate=accumulate)
    loaded = ckpt.load_checkpoint(tmp_path)
    assert bool(loaded.optimizer_state) == (name != "sgd")
    params, history = _run(layout, params=loaded.params, resume=loaded, optimizer=_optimizer(name, zero),
                           accumulate=accumulate)
    for got, expected in zip(params, want):
        np.testing.assert_array_equal(got, expected)
    assert _without_timings(history) == _without_timings(want_history)


@pytest.mark.slow   # seconds the fast tier's 150 s budget cannot spare (docs/testing.md)
def test_zero_2_on_two_contexts_resumes_with_zero_0_on_one_and_zero_1_on_three(tmp_path):
    """The state is saved whole, by parameter: another number of contexts and another sharding continue it."""
    adam = lambda zero: Adam(0.003, zero=zero)   # noqa: E731
    with pytest.raises(TrainingStopped):
        _run("data-ring", stop=stop_before(5), on_checkpoint=_saver(tmp_path), optimizer=adam(2))
    loaded = ckpt.load_checkpoint(tmp_path)
    assert sorted(loaded.optimizer_state) == ["mean", "var"]
    want = _run("data-ring", optimizer=adam(2))[0]
    for k, zero in ((1, 0), (3, 1)):
        strategy = make_strategy("data", loaded.params, [mx.cpu(i) for i in range(k)], reducer="ring")
        fit(DATA, strategy, adam(zero), RunConfig(epochs=EPOCHS, batch_size=BATCH, seed=5), resume=loaded)
        assert_same_parameters([p.asnumpy() for p in strategy.params()], want, "float32")
    strategy = make_strategy("data", loaded.params, [mx.cpu(0)])   # without the state: another model
    fit(DATA, strategy, adam(0), RunConfig(epochs=EPOCHS, batch_size=BATCH, seed=5),
        resume=loaded._replace(optimizer_state={}))
    assert not np.allclose(strategy.params()[0].asnumpy(), want[0], rtol=1e-3)


@pytest.mark.parametrize("source, target", fast_only([("data-fused", "pipeline"), ("data-fused", "hybrid-ring"),
                                                       ("pipeline", "data-tree")], fast={1}))
def test_a_checkpoint_resumes_on_another_layout(source, target, tmp_path):
    """Resumed under another strategy or number of contexts: equal to rtol 1e-5 of each array's scale.

    At lr 0.1: at lr 0.3 the runs reach the unstable escape from LeNet's initial plateau, which amplifies
    float32 rounding until even two uninterrupted layouts differ by ~6e-3 on the conv biases after 14 steps.
    """
    with pytest.raises(TrainingStopped):
        _run(source, stop=stop_before(4), lr=0.1, on_checkpoint=ckpt.CheckpointWriter(tmp_path, {}))
    loaded = ckpt.load_checkpoint(tmp_path)
    params, history = _run(target, params=loaded.params, resume=loaded, lr=0.1)
    assert_same_parameters(params, _run(source, lr=0.1)[0], "float32")
    assert len(history) == EPOCHS


def test_data_on_2_contexts_resumes_on_4():
    saved = []
    config = RunConfig(epochs=EPOCHS, batch_size=BATCH, seed=5)
    with pytest.raises(TrainingStopped):
        fit(DATA, lenet_strategy([mx.cpu(0), mx.cpu(1)], seed=5), 0.1, config, stop=stop_before(9),
            on_checkpoint=lambda snapshot: saved.append(snapshot._replace(params=[p.copy() for p in snapshot.params])))
    _, on_two = fit(DATA, lenet_strategy([mx.cpu(0), mx.cpu(1)], seed=5), 0.1, config)
    _, on_four = fit(DATA, make_strategy("data", saved[-1].params, [mx.cpu(i) for i in range(4)]), 0.1, config,
                     resume=saved[-1])
    assert_same_parameters([p.asnumpy() for p in on_four[0]], [p.asnumpy() for p in on_two[0]], "float32")


def test_checkpoint_after_every_epoch_and_growing_epochs(tmp_path, uninterrupted):
    states = []

    def save(snapshot):
        states.append((snapshot.state.epoch, snapshot.state.batch))
        ckpt.CheckpointWriter(tmp_path, {})(snapshot)

    _run("data-fused", on_checkpoint=save, epochs=1)
    assert states == [(2, 0)]
    loaded = ckpt.load_checkpoint(tmp_path)
    params, history = _run("data-fused", params=loaded.params, resume=loaded, epochs=2)   # train further
    for got, want in zip(params, uninterrupted["data-fused"][0]):
        np.testing.assert_array_equal(got, want)
    assert [m["epoch"] for m in history] == [1, 2]


def test_files_on_disk(tmp_path):
    """checkpoint.json names the parameter file; mx.nd.load reads it with LeNet's names; one file per
    checkpoint: the previous parameter file goes once the new manifest is in place."""
    state = TrainingState(1, 3, 1.5, 2.0, 0.25, epoch_seed(0, 1), [])
    ckpt.save_checkpoint(tmp_path, init_lenet_params(seed=1), state, {"lr": 0.1})
    ckpt.save_checkpoint(tmp_path, init_lenet_params(seed=2), state._replace(batch=4), {"lr": 0.1})
    manifest = json.loads((tmp_path / ckpt.MANIFEST).read_text())
    assert manifest["format"] == ckpt.FORMAT and manifest["version"] == ckpt.VERSION
    assert sorted(os.listdir(tmp_path)) == sorted([ckpt.MANIFEST, manifest["params_file"]])
    arrays = mx.nd.load(str(tmp_path / manifest["params_file"]))
    assert sorted(arrays) == sorted(LENET_PARAM_NAMES)
    for name, want in zip(LENET_PARAM_NAMES, init_lenet_params(seed=2)):
        np.testing.assert_array_equal(arrays[name].asnumpy(), want.asnumpy())
    assert manifest["state"]["batch"] == 4 and manifest["config"] == {"lr": 0.1}


def test_non_finite_parameters_never_replace_a_good_checkpoint(tmp_path):
    state = TrainingState(2, 0, 0.0, 0.0, 0.0, epoch_seed(0, 2), [{"epoch": 1}])
    ckpt.save_checkpoint(tmp_path, init_lenet_params(seed=1), state, {})
    before = {name: (tmp_path / name).read_bytes() for name in os.listdir(tmp_path)}
    bad = init_lenet_params(seed=1)
    bad[4][0, 0] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        ckpt.save_checkpoint(tmp_path, bad, state._replace(epoch=3), {})
    assert {name: (tmp_path / name).read_bytes() for name in os.listdir(tmp_path)} == before


def test_a_diverging_run_writes_no_checkpoint(tmp_path):
    saves = []
    with pytest.raises(NonFiniteLossError):
        fit(DATA, lenet_strategy([mx.cpu(0)], seed=1), 1e10, RunConfig(epochs=1, batch_size=BATCH, seed=1),
            on_checkpoint=saves.append)
    assert saves == []


@pytest.mark.parametrize("damage, message", [
    ("no manifest", "no checkpoint"),
    ("truncated manifest", "unreadable or corrupt"),
    ("foreign manifest", "not a checkpoint of this package"),
    ("other version", "format version 99"),
    ("missing params", "missing, but checkpoint.json names it"),
    ("truncated params", "sha256 differs"),
    ("field missing", "a field is missing or malformed"),
    ("NaN, digest updated", r"conv1_bias holds 1 NaN or infinite values, which no checkpoint stores"),
])
def test_damaged_checkpoints_are_refused_with_one_line(tmp_path, damage, message):
    state = TrainingState(1, 2, 0.5, 1.0, 0.1, epoch_seed(0, 1), [])
    ckpt.save_checkpoint(tmp_path, init_lenet_params(), state, {})
    manifest_path = tmp_path / ckpt.MANIFEST
    manifest = json.loads(manifest_path.read_text())
    params_path = tmp_path / manifest["params_file"]
    if damage == "no manifest":
        manifest_path.unlink()
    elif damage == "truncated manifest":
        manifest_path.write_text(manifest_path.read_text()[:40])
    elif damage == "foreign manifest":
        manifest_path.write_text(json.dumps({"name": "something else"}))
    elif damage == "other version":
        manifest_path.write_text(json.dumps({**manifest, "version": 99}))
    elif damage == "missing params":
        params_path.unlink()
    elif damage == "truncated params":
        params_path.write_bytes(params_path.read_bytes()[:1000])
    elif damage.startswith("NaN"):   # a NaN written in, and the manifest's digest made to match it
        arrays = mx.nd.load(str(params_path))
        arrays["conv1_bias"][2] = float("nan")
        mx.nd.save(str(params_path), arrays)
        manifest["params_sha256"] = hashlib.sha256(params_path.read_bytes()).hexdigest()
        manifest_path.write_text(json.dumps(manifest))
    else:
        del manifest["state"]
        manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(ckpt.CheckpointError, match=message) as error:
        ckpt.load_checkpoint(tmp_path)
    assert len(str(error.value).splitlines()) == 1


def test_resume_refuses_a_start_from_another_order():
    state = TrainingState(1, 2, 0.0, 0.0, 0.0, epoch_seed(6, 1), [])
    config = RunConfig(epochs=1, batch_size=BATCH, seed=5)
    with pytest.raises(ValueError, match="the data order would change") as raised:
        fit(DATA, lenet_strategy([mx.cpu(0)]), 0.3, config, resume=Snapshot(state, [], [], {}, {}))
    assert raised.value.argument == "resume"
    with pytest.raises(ValueError, match="an epoch here has 7 batches"):
        fit(DATA, lenet_strategy([mx.cpu(0)]), 0.3, config,
            resume=Snapshot(state._replace(batch=9, shuffle_seed=epoch_seed(5, 1)), [], [], {}, {}))


def test_resume_takes_a_snapshot_or_a_checkpoint_and_nothing_else():
    """``resume``'s kinds are declared: another object with a ``state`` is refused, naming the argument."""
    state = TrainingState(1, 0, 0.0, 0.0, 0.0, epoch_seed(5, 1), [])
    config = RunConfig(epochs=1, batch_size=BATCH, seed=5)
    with pytest.raises(TypeError, match="must be a parallel.checkpoint.Snapshot") as raised:
        fit(DATA, lenet_strategy([mx.cpu(0)]), 0.3, config, resume=types.SimpleNamespace(state=state))
    assert raised.value.argument == "resume"


def test_a_checkpoint_written_before_resnet18_loads_as_lenet(tmp_path):
    """Manifests without a model name (the first format) hold LeNet: they load, and only as LeNet."""
    state = TrainingState(1, 2, 0.5, 1.0, 0.1, epoch_seed(0, 1), [])
    ckpt.save_checkpoint(tmp_path, init_lenet_params(seed=1), state, {"lr": 0.1})
    manifest_path = tmp_path / ckpt.MANIFEST
    manifest = json.loads(manifest_path.read_text())
    assert manifest.pop("model") == "lenet"
    manifest_path.write_text(json.dumps(manifest))
    loaded = ckpt.load_checkpoint(tmp_path, model="lenet")
    assert (loaded.model, len(loaded.params), list(loaded.aux), loaded.state) == ("lenet", 8, [], state)
    with pytest.raises(ckpt.CheckpointError, match="a checkpoint of lenet, but this run trains resnet18"):
        ckpt.load_checkpoint(tmp_path, model="resnet18")


@pytest.mark.slow   # seconds the fast tier's 150 s budget cannot spare (docs/testing.md)
def test_resnet18_checkpoint_round_trip_with_running_statistics(tmp_path):
    replica = get_params(init_model("resnet18", seed=3), mx.cpu())
    replica.aux[1][:] = 0.5   # running statistics that differ from their initial values
    first = {"epoch": 1, "train_loss": 2.3, "train_acc": 0.1, "test_acc": 0.1, "seconds": 9.0, "images_per_second": 7.0}
    state = TrainingState(2, 0, 0.0, 0.0, 0.0, epoch_seed(0, 2), [first])
    ckpt.save_checkpoint(tmp_path, list(replica), state, {}, aux=replica.aux, model="resnet18")
    loaded = ckpt.load_checkpoint(tmp_path)
    assert loaded.model == "resnet18" and (len(loaded.params), len(loaded.aux)) == (76, 34)
    for got, want in zip(loaded.params + loaded.aux, list(replica) + replica.aux):
        np.testing.assert_array_equal(got.asnumpy(), want.asnumpy())
    with pytest.raises(ValueError, match="ResNet-18's running statistics 34 arrays are expected, got 33"):
        ckpt.save_checkpoint(tmp_path, list(replica), state, {}, aux=replica.aux[:-1], model="resnet18")
