"""Pipeline schedules (``parallel.strategies.schedules``, ``--schedule``, ``--virtual-stages``): GPipe and 1F1B idle
(P-1)/(M+P-1) of the slots, GPipe holds every micro-batch's activations and 1F1B at most P - d on device d,
interleaving shrinks the bubble about V times; the pipeline issues exactly the schedule's order, holds what the
schedule says, and every schedule trains GPipe's model (that each trains the one-context model is
``tests/test_layouts.py``'s cells "pipeline, GPipe", "pipeline, 1F1B" and "interleaved 1F1B")."""
import json

import mxnet as mx
import numpy as np
import pytest
from hypothesis import given, strategies as st

from parallel import init_lenet_params
from parallel.models import init_model
from parallel.optim import SGD, Adam
from parallel.strategies import Pipeline, Stages, make_strategy, pipeline_schedule
from parallel.train import main
from conftest import contexts, easy_dataset, make_batches, write_idx_files


def _ops(schedule):
    return [op for _, op in schedule.order]


@pytest.mark.property
@given(p=st.integers(1, 6), m=st.integers(1, 12), name=st.sampled_from(["gpipe", "1f1b"]))
def test_every_schedule_runs_each_op_once_after_what_it_needs(p, m, name):
    """Each micro-batch's forward and backward through every stage exactly once, a forward after the stage before
    ran it, a backward after the stage after and its own forward; the bubble is (P-1)/(M+P-1); GPipe holds M
    micro-batches on every device, 1F1B at most P - d on device d (and M at most)."""
    schedule = pipeline_schedule(name, p, m)
    ops = _ops(schedule)
    assert sorted(ops) == sorted((kind, c, i) for kind in "FB" for c in range(p) for i in range(m))
    when = {tuple(op): t for t, slot in enumerate(schedule.slots) for op in slot if op is not None}
    for kind, c, i in ops:
        if kind == "F" and c:
            assert when[("F", c - 1, i)] < when[("F", c, i)]
        if kind == "B":
            assert when[("F", c, i)] < when[("B", c, i)]
            if c < p - 1:
                assert when[("B", c + 1, i)] < when[("B", c, i)]
    assert schedule.bubble == pytest.approx((p - 1) / (m + p - 1))
    if name == "gpipe":
        assert schedule.stashed_peak == [m] * p
    else:
        assert schedule.stashed_peak == [min(p - d, m) for d in range(p)]
    assert [d for d, op in schedule.order] == [op.chunk for op in ops]   # chunk c on device c


def test_four_stages_eight_micro_batches():
    """The issue's numbers: GPipe stashes 8 micro-batches and 1F1B at most 4; both bubbles are 3/11."""
    gpipe, one = pipeline_schedule("gpipe", 4, 8), pipeline_schedule("1f1b", 4, 8)
    assert gpipe.stashed_peak == [8, 8, 8, 8] and max(one.stashed_peak) == 4
    assert gpipe.bubble == one.bubble == pytest.approx(3 / 11)


@pytest.mark.parametrize("p, m, v", [(2, 4, 2), (4, 8, 2), (4, 8, 4), (3, 6, 2)])
def test_interleaving_divides_the_bubble_by_the_virtual_stages(p, m, v):
    """Interleaved 1F1B on V chunks a device: every chunk's ops once, in dependency order. A device idles as many
    slots as in 1F1B, 2 (P-1), but a slot is a chunk's work, 1/V of a stage's: the bubble's time is divided by V,
    and its fraction is (P-1)/(VM+P-1)."""
    schedule = pipeline_schedule("1f1b", p, m, v)
    ops = _ops(schedule)
    assert sorted(ops) == sorted((kind, c, i) for kind in "FB" for c in range(p * v) for i in range(m))
    assert all(d == op.chunk % p for d, op in schedule.order)
    plain = pipeline_schedule("1f1b", p, m)

    def idle(plan):
        return plan.bubble * len(plan.slots)   # idle slots a device, on average
    assert idle(schedule) == pytest.approx(idle(plain)) == pytest.approx(2 * (p - 1))
    assert schedule.bubble == pytest.approx((p - 1) / (v * m + p - 1))


@pytest.mark.parametrize("args, error, says", [
    (("pipedream", 2, 4), ValueError, "schedule must be one of gpipe, 1f1b"),
    (("gpipe", 2, 4, 2), ValueError, "virtual_stages=2 interleaves 1F1B; use schedule 1f1b"),
    (("1f1b", 4, 6, 2), ValueError, "micro_batches=6 must be a multiple of the 4 stages"),
    (("1f1b", 2, 0), ValueError, "micro_batches must be >= 1"),
])
def test_pipeline_schedule_refuses(args, error, says):
    with pytest.raises(error, match=says):
        pipeline_schedule(*args)


@pytest.mark.parametrize("schedule, virtual, k", [("gpipe", 1, 2), ("1f1b", 1, 2), ("1f1b", 1, 4), ("1f1b", 2, 2)])
def test_the_pipeline_issues_the_schedules_order_and_holds_what_it_says(schedule, virtual, k, monkeypatch):
    """The ops the pipeline issues are the schedule's, in its order; the micro-batches it holds at once per device
    (counted on what it keeps) are the schedule's stashed peak."""
    model = Pipeline(init_lenet_params(seed=0), contexts(k), stages=k if virtual == 1 else k, micro_batches=4,
                     schedule=schedule, virtual=virtual)
    from parallel.strategies import hybrid
    issued = []
    original = hybrid.issue

    def recording(plan, *args):
        issued.extend(plan.order)
        return original(plan, *args)
    monkeypatch.setattr(hybrid, "issue", recording)
    X, y = make_batches([8], seed=1)[0]
    model.train_step(X, y, 0.1)
    plan = model.plan()
    assert issued == plan.order
    assert model.last_stash == plan.stashed_peak


@pytest.mark.parametrize("model_name, k, virtual", [("lenet", 2, 2), pytest.param("vit", 3, 2, marks=pytest.mark.slow)])
def test_every_schedule_trains_the_same_model(model_name, k, virtual):
    """1F1B (and interleaved 1F1B) is GPipe's step in another order: each chunk still adds its micro-batches'
    gradients in micro-batch order, so on the same chunks the models agree to 1e-6 of each array's scale (bitwise
    here): 1F1B on K stages against GPipe on K, interleaved 1F1B on K devices of V chunks against GPipe on K x V."""
    def run(schedule, stages, v, devices):
        layout = Stages(count=stages, micro_batches=2 * k, schedule=schedule, virtual=v)
        strategy = make_strategy("pipeline", init_model(model_name, 0), contexts(devices), layout)
        optimizer = Adam(0.01)
        for X, y in make_batches([12, 12, 5], seed=2):
            strategy.train_step(X, y, optimizer=optimizer)
        return [p.asnumpy() for p in strategy.params()]
    for got, want in ((run("1f1b", k, 1, k), run("gpipe", k, 1, k)),
                      (run("1f1b", k, virtual, k), run("gpipe", k * virtual, 1, k * virtual))):
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6 * np.abs(w).max())


def test_the_cli_records_the_schedule_in_the_metrics(tmp_path, capsys):
    data_dir = write_idx_files(tmp_path, easy_dataset(num_train=64, num_test=16, seed=3))
    metrics = {}
    for schedule in ("gpipe", "1f1b"):
        path = tmp_path / f"{schedule}.json"
        assert main(["--data-dir", str(data_dir), "--epochs", "1", "--batch-size", "16", "--no-progress",
                     "--devices", "cpu:4", "--strategy", "pipeline", "--stages", "4", "--micro-batches", "8",
                     "--schedule", schedule, "--metrics-json", str(path)]) == 0
        metrics[schedule] = json.loads(path.read_text())
    assert "schedule 1f1b" in capsys.readouterr().out
    assert metrics["gpipe"][0]["pipeline"] == {"schedule": "gpipe", "micro_batches": 8, "virtual_stages": 1,
                                               "stashed_peak": [8, 8, 8, 8], "bubble": 3 / 11}
    assert metrics["1f1b"][0]["pipeline"]["stashed_peak"] == [4, 3, 2, 1]
    assert metrics["1f1b"][0]["train_loss"] == pytest.approx(metrics["gpipe"][0]["train_loss"], rel=1e-6)


def test_the_cli_interleaves(tmp_path):
    data_dir = write_idx_files(tmp_path, easy_dataset(num_train=64, num_test=16, seed=3))
    path = tmp_path / "m.json"
    assert main(["--data-dir", str(data_dir), "--epochs", "1", "--batch-size", "16", "--no-progress",
                 "--devices", "cpu:2", "--strategy", "pipeline", "--micro-batches", "4", "--schedule", "1f1b",
                 "--virtual-stages", "2", "--metrics-json", str(path)]) == 0
    pipeline = json.loads(path.read_text())[0]["pipeline"]
    assert pipeline["schedule"] == "interleaved-1f1b" and pipeline["virtual_stages"] == 2
    assert pipeline["bubble"] == pytest.approx(1 / 9)   # (P-1)/(VM+P-1): 1F1B's is (P-1)/(M+P-1) = 1/5
    # each chunk's stash is 1/V of a micro-batch through the device's layers: five and three chunks at the peak
    chunks = [0, 0]
    held = [0, 0]
    for ops in pipeline_schedule("1f1b", 2, 4, 2).slots:
        for d, op in enumerate(ops):
            if op is not None:
                held[d] += 1 if op.kind == "F" else -1
                chunks[d] = max(chunks[d], held[d])
    assert chunks == [5, 3] and pipeline["stashed_peak"] == [n / 2 for n in chunks] == [2.5, 1.5]


def test_the_docs_give_the_unit_of_the_stash_the_metrics_record():
    """docs/strategies.md counted the interleaved stash 'in whole micro-batches' while --metrics-json records
    [2.5, 1.5]: the page states the unit (a chunk's stash counts 1/V) and the value the JSON records."""
    from pathlib import Path
    text = " ".join((Path(__file__).parents[1] / "docs" / "strategies.md").read_text().split())
    assert "counted in whole micro-batches" not in text
    assert "each chunk's stash counts 1/V" in text and "records `[2.5, 1.5]`" in text


@pytest.mark.parametrize("extra, says", [
    (["--schedule", "1f1b"], "--schedule orders the micro-batches a pipeline is fed; the data --strategy feeds it "
                             "one: use the pipeline or hybrid --strategy"),
    (["--strategy", "model", "--virtual-stages", "2", "--schedule", "1f1b"],   # not "--micro-batches 1 must be a
     "--schedule orders the micro-batches a pipeline is fed; the model --strategy feeds it one"),   # multiple of 2"
    (["--strategy", "hybrid", "--schedule", "1f1b"], "--micro-batches 1 leaves nothing to order"),
    (["--strategy", "pipeline", "--virtual-stages", "2"], "--virtual-stages 2 interleaves 1F1B; use --schedule 1f1b"),
    (["--strategy", "pipeline", "--schedule", "1f1b", "--virtual-stages", "2", "--micro-batches", "3"],
     "--micro-batches 3 must be a multiple of 2"),
    (["--strategy", "pipeline", "--schedule", "1f1b", "--virtual-stages", "3"], "LeNet's 4 layers"),
    (["--strategy", "pipeline", "--schedule", "zigzag"], "invalid choice: 'zigzag'"),
])
def test_cli_refuses_schedules_that_do_not_apply(extra, says, tmp_path, capsys):
    data_dir = write_idx_files(tmp_path, easy_dataset(num_train=32, num_test=8, seed=3))
    assert main(["--data-dir", str(data_dir), "--epochs", "1", "--batch-size", "8", "--no-progress",
                 "--devices", "cpu:2", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and says in err and len(err.splitlines()) == 1, err
