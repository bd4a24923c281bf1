"""Error feedback in checkpoints: a run resumed with its compressor's residuals (and PowerSGD's Q matrices) is
bitwise the uninterrupted one; on another layout the residuals' sum is kept; the CLI refuses another compressor."""
import json
import os

import mxnet as mx
import numpy as np
import pytest

from parallel import checkpoint as ckpt
from parallel.comm.reducer import BucketComm, Reducer
from parallel.compress import place
from parallel import RunConfig
from parallel.fit import TrainingStopped, fit
from parallel.models import init_lenet_params
from parallel.strategies import make_strategy
from parallel.train import main
from conftest import easy_dataset, stop_before, write_idx_files

BATCH = 32
DATA = easy_dataset(num_train=200, num_test=50, seed=4)   # 7 batches an epoch
SPECS = ["fp16", "2bit", "topk:0.05", "powersgd:2"]


def _strategy(spec, k=2, params=None, warmup=0):
    return make_strategy("data", init_lenet_params(seed=5) if params is None else params,
                         [mx.cpu(i) for i in range(k)], batch_size=BATCH,
                         reducer=Reducer(compression=spec, warmup=warmup))


def _run(spec, k=2, epochs=2, **kwargs):
    strategy = _strategy(spec, k, kwargs.pop("params", None), kwargs.pop("warmup", 0))
    try:
        fit(DATA, strategy, 0.3, RunConfig(epochs=epochs, batch_size=BATCH, seed=5), **kwargs)
    except TrainingStopped:
        pass
    return strategy


def _stopped_checkpoint(spec, directory, after=10):
    """Stop a 2-context run before its ``after``-th batch (mid-epoch 2) and write the checkpoint."""
    _run(spec, stop=stop_before(after), on_checkpoint=ckpt.CheckpointWriter(directory, {}))
    return ckpt.load_checkpoint(directory)


def _params(strategy):
    return [p.asnumpy() for p in strategy.params()]


_UNINTERRUPTED = {}


@pytest.fixture
def uninterrupted(spec):
    """The parameters of ``spec``'s run never stopped, run once for the module (the first test of the spec)."""
    if spec not in _UNINTERRUPTED:
        _UNINTERRUPTED[spec] = _params(_run(spec))
    return _UNINTERRUPTED[spec]


@pytest.mark.parametrize("spec", [pytest.param(spec, marks=() if spec == "powersgd:2" else pytest.mark.slow)
                                  for spec in SPECS])   # a codec with Q matrices and error feedback: fast
def test_a_resumed_run_with_its_residuals_is_bitwise_the_uninterrupted_one(spec, uninterrupted, tmp_path):
    saved = _stopped_checkpoint(spec, tmp_path)
    names = sorted(saved.compression_state)
    assert {"w0/residual/c0", "w0/residual/c1"} <= set(names)
    assert any(name.startswith("w0/query/") for name in names) == spec.startswith("powersgd")
    resumed = _params(_run(spec, params=saved.params, resume=saved))
    for got, want in zip(resumed, uninterrupted):
        np.testing.assert_array_equal(got, want)
    # what the residuals carry matters: resumed without them, the run ends elsewhere
    forgetful = _params(_run(spec, params=saved.params, resume=saved._replace(compression_state={})))
    assert any((got != want).any() for got, want in zip(forgetful, uninterrupted))


def test_a_run_resumed_in_its_compression_warmup_compresses_where_the_uninterrupted_one_does(tmp_path):
    """Stopped after 9 of a 12-step warm-up (no residual yet: nothing was compressed), the resumed run counts the
    9 (``fit`` sets ``Reducer.steps``) and compresses from step 13, bitwise as the run never stopped; the count
    matters: a run that compresses from its own first step ends elsewhere."""
    uninterrupted = _params(_run("topk:0.05", warmup=12))
    _run("topk:0.05", warmup=12, stop=stop_before(10), on_checkpoint=ckpt.CheckpointWriter(tmp_path, {}))
    saved = ckpt.load_checkpoint(tmp_path)
    assert saved.state.batch == 2 and not saved.compression_state   # epoch 2's batch 2: step 9, still dense
    resumed = _params(_run("topk:0.05", warmup=12, params=saved.params, resume=saved))
    for got, want in zip(resumed, uninterrupted):
        np.testing.assert_array_equal(got, want)
    early = _params(_run("topk:0.05", warmup=9, params=saved.params, resume=saved))   # compresses from step 10
    assert any((got != want).any() for got, want in zip(early, uninterrupted))


@pytest.mark.parametrize("spec", ["topk:0.05", "powersgd:2"])
def test_another_layout_takes_the_sum_of_the_residuals_on_its_first_context(spec, tmp_path):
    saved = _stopped_checkpoint(spec, tmp_path)
    total = sum(saved.compression_state[f"w0/residual/c{k}"].asnumpy() for k in range(2))
    # resumed on three contexts and stopped before its first step: fit gives the compressor its share of the saved
    # residuals as it starts, and the checkpoint it writes on stopping gathers them back as this layout holds them
    snapshots = []
    _run(spec, k=3, params=saved.params, resume=saved, stop=lambda: True, on_checkpoint=snapshots.append)
    state = snapshots[0].compression_state
    assert sorted(name for name in state if "/residual/" in name) == ["w0/residual/c0"]
    np.testing.assert_allclose(state["w0/residual/c0"].asnumpy(), total, rtol=0, atol=0)
    queries = sorted(name for name in state if "/query/" in name)
    assert len(queries) == (3 * 4 if spec.startswith("powersgd") else 0)   # LeNet's 4 weight matrices, 3 contexts
    for name in queries:   # every context warm-starts from the saved first context's Q
        t = name.rsplit("/", 1)[1]
        np.testing.assert_array_equal(state[name].asnumpy(),
                                      saved.compression_state[f"w0/query/c0/{t}"].asnumpy())


@pytest.mark.parametrize("before", [(1, 2), (2, 2), (2, 1), (3, 2)])
@pytest.mark.parametrize("after", [(1, 1), (1, 2), (1, 3), (2, 1), (2, 2), (3, 3)])
def test_place_keeps_every_residual_on_any_layout(before, after):
    rng = np.random.RandomState(sum(before) * 7 + sum(after))
    (w, k), (w2, k2) = before, after
    saved = {}
    for r in range(w):
        for name in [f"residual/c{c}" for c in range(k) if k > 1] + (["residual/across"] if w > 1 else []):
            saved[f"w{r}/{name}"] = rng.standard_normal(5).astype(np.float32)
        saved[f"w{r}/query/c0/1"] = rng.standard_normal((3, 2)).astype(np.float32)
    placed = [place(saved, rank, w2, k2) for rank in range(w2)]
    residuals = [value for local, _ in placed for name, value in local.items() if name.startswith("residual/")]
    want = np.sum([v for name, v in saved.items() if "/residual/" in name], axis=0)
    if before == after:   # each worker its own arrays, nothing moved
        for rank, (local, note) in enumerate(placed):
            assert note is None
            assert local == {name.split("/", 1)[1]: v for name, v in saved.items() if name.startswith(f"w{rank}/")}
    elif after == (1, 1):   # nothing compresses: dropped, and said so
        assert residuals == [] and "dropped" in placed[0][1]
    else:
        np.testing.assert_allclose(np.sum(residuals, axis=0), want, rtol=1e-6, atol=1e-6)
        assert all(note is None for _, note in placed)
        for local, _ in placed:
            for name, value in local.items():
                if name.startswith("query/"):
                    np.testing.assert_array_equal(value, saved["w0/query/c0/1"])


def test_resuming_residuals_without_a_compressor_is_refused(tmp_path):
    saved = _stopped_checkpoint("topk:0.05", tmp_path)
    with pytest.raises(ValueError, match="compression_state: the checkpoint holds compression residuals"):
        _run(None, params=saved.params, resume=saved)


def test_a_wrong_state_for_the_compressor_is_a_value_error():
    strategy = _strategy("powersgd:2")
    grads = [params.grad for params in strategy.model]
    compressor = strategy.reducer.codec
    with pytest.raises(ValueError, match="compression_state: 'residual/c7' is not part of"):
        compressor.load_state({"residual/c7": np.zeros(grads[0].shape, np.float32)}, grads)
    with pytest.raises(ValueError, match="compression_state: residual/c0 has shape"):
        compressor.load_state({"residual/c0": np.zeros(3, np.float32)}, grads)
    compressor.load_state({"query/c0/0": np.zeros((5, 5), np.float32)}, grads)   # rank 5, where 2 is asked
    with pytest.raises(ValueError, match="compression_state: the Q of tensor 0 has shape"):
        compressor.reduce(grads, BucketComm("fused"), shapes=[p.shape for p in strategy.model[0]])
    with pytest.raises(ValueError, match="named w<rank>/<name>"):
        place({"residual/c0": np.zeros(3)}, 0, 1, 2)


def test_the_checkpoint_file_holds_them_and_is_checked(tmp_path):
    params = init_lenet_params(seed=0)
    state = ckpt.TrainingState(1, 3, 0.0, 0.0, 0.0, 7, [])
    feedback = {"w0/residual/c0": np.arange(4, dtype=np.float32), "w1/query/across/2": np.ones((2, 2), np.float32)}
    ckpt.save_checkpoint(tmp_path / "a", params, state, {}, compression_state=feedback)
    manifest = json.loads((tmp_path / "a" / ckpt.MANIFEST).read_text())
    loaded = ckpt.load_checkpoint(tmp_path / "a")
    assert sorted(loaded.compression_state) == sorted(feedback)
    for name, value in feedback.items():
        np.testing.assert_array_equal(loaded.compression_state[name].asnumpy(), value)
    ckpt.save_checkpoint(tmp_path / "a", params, state, {})   # the next one, without: the old file goes
    assert sorted(os.listdir(tmp_path / "a")) == [ckpt.MANIFEST, "params-000002.params"]
    assert ckpt.load_checkpoint(tmp_path / "a").compression_state == {}
    assert "compression_file" not in json.loads((tmp_path / "a" / ckpt.MANIFEST).read_text())
    ckpt.save_checkpoint(tmp_path / "b", params, state, {}, compression_state=feedback)
    with open(tmp_path / "b" / manifest["compression_file"], "r+b") as f:
        f.seek(-4, os.SEEK_END)
        f.write(b"\0\0\0\1")
    with pytest.raises(ckpt.CheckpointError, match="sha256 differs"):
        ckpt.load_checkpoint(tmp_path / "b")
    with pytest.raises(ValueError, match="must be w<rank>/<name>"):
        ckpt.save_checkpoint(tmp_path / "c", params, state, {}, compression_state={"residual/c0": np.zeros(2)})
    with pytest.raises(ValueError, match="not finite"):
        ckpt.save_checkpoint(tmp_path / "c", params, state, {}, compression_state={"w0/r": np.array([np.nan])})
    assert not os.path.exists(tmp_path / "c" / ckpt.MANIFEST)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_idx_files(tmp_path_factory.mktemp("idx"), easy_dataset(num_train=70, num_test=23, seed=6))


def test_the_cli_resumes_bitwise_and_refuses_another_compressor(tiny, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    args = ["--data-dir", str(tiny), "--batch-size", "13", "--lr", "0.1", "--seed", "3", "--no-progress",
            "--devices", "cpu:2", "--compression", "topk:0.05"]
    assert main(args + ["--epochs", "2", "--checkpoint-dir", "straight"]) == 0
    assert main(args + ["--epochs", "1", "--checkpoint-dir", "halves"]) == 0
    assert sorted(ckpt.load_checkpoint("halves").compression_state) == ["w0/residual/c0", "w0/residual/c1"]
    assert main(args[:-1] + ["topk:0.1", "--epochs", "2", "--checkpoint-dir", "halves", "--resume"]) == 2
    assert "trained with compression 'topk:0.05', this run asks for 'topk:0.1'" in capsys.readouterr().err
    assert main(args + ["--epochs", "2", "--checkpoint-dir", "halves", "--resume"]) == 0
    for got, want in zip(ckpt.load_checkpoint("halves").params, ckpt.load_checkpoint("straight").params):
        np.testing.assert_array_equal(got.asnumpy(), want.asnumpy())


def test_resuming_on_one_context_warns_in_one_line(tiny, tmp_path, capsys):
    """The residuals a one-context run drops are said as one "warning:" line, not a UserWarning and its source."""
    args = ["--data-dir", str(tiny), "--batch-size", "13", "--seed", "3", "--no-progress", "--compression",
            "topk:0.05", "--checkpoint-dir", str(tmp_path / "ckpt")]
    assert main(args + ["--devices", "cpu:2", "--epochs", "1"]) == 0
    capsys.readouterr()
    assert main(args + ["--devices", "cpu:1", "--epochs", "2", "--resume"]) == 0
    err = capsys.readouterr().err
    dropped = [line for line in err.splitlines() if "residuals were dropped" in line]
    assert len(dropped) == 1 and dropped[0].startswith("warning: the checkpoint's compression residuals"), err
    assert all(line.startswith("warning: ") for line in err.splitlines()), err
    assert "UserWarning" not in err and "warnings.warn" not in err and ".py:" not in err, err
