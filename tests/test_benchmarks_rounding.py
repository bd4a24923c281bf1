"""benchmarks/rounding.py on a few steps: accumulating micro-batches is the whole batch's step in float64 (to its
rounding), so what float32 shows is rounding, not an error."""
import json

import pytest

from conftest import load_benchmark


@pytest.mark.slow   # a benchmark's smoke run, as its others are; the claim is the fast tier's (see the docstring)
def test_accumulate_equals_the_whole_batch_in_float64(tmp_path):
    """The fast tier proves accumulation the whole batch's step: test_optim.py's
    test_accumulated_micro_batches_are_the_whole_batch_at_once, and the matrix's accumulating cells in float64
    (test_layouts.py); this is the script's run."""
    bench = load_benchmark("rounding")
    out = tmp_path / "rounding.json"
    bench.main(["--steps", "2", "--num-train", "256", "--out", str(out)])
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert {(r["optimizer"], r["dtype"], r["step"]) for r in rows} == {
        (o, d, s) for o in ("sgd", "momentum") for d in ("float32", "float64") for s in (1, 2)}
    for row in rows:   # float64 sums round at 1e-16 of their terms' magnitudes; float32 at 6e-8
        bound = 1e-11 if row["dtype"] == "float64" else 1e-3
        assert row["difference"] < bound, row


@pytest.mark.slow
def test_zero_3_against_one_context_is_rounding(tmp_path):
    """--compare sharded: ZeRO-3 on K contexts against one context without sharding, float64 at its rounding (so
    float32's difference is rounding too), momentum in float32 within 1e-5 of an array's scale."""
    bench = load_benchmark("rounding")
    out = tmp_path / "rounding.json"
    bench.main(["--compare", "sharded", "--sharded-devices", "2,3", "--steps", "2", "--num-train", "256",
                "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert {(r["optimizer"], r["dtype"], r["devices"], r["step"]) for r in rows} == {
        (o, d, k, s) for o in ("momentum", "adam") for d in ("float32", "float64") for k in (2, 3) for s in (1, 2)}
    for row in rows:
        bound = 1e-11 if row["dtype"] == "float64" else 1e-5 if row["optimizer"] == "momentum" else 1e-3
        assert 0 <= row["difference"] < bound, row


@pytest.mark.slow
def test_tensor_parallel_against_one_context_is_rounding(tmp_path):
    """--compare tensor: the ViT with --tensor 2 and 4 (and 2 groups of 2) against one context, float64 at its
    rounding, momentum in float32 within 1e-5 of an array's scale (AdamW's difference is reported)."""
    bench = load_benchmark("rounding")
    out = tmp_path / "rounding.json"
    bench.main(["--compare", "tensor", "--steps", "2", "--num-train", "128", "--batch-size", "16",
                "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    layouts = {"--tensor 2 on 2 contexts", "--tensor 4 on 4 contexts", "--tensor 2 on 4 contexts"}
    assert {(r["optimizer"], r["dtype"], r["layout"], r["step"]) for r in rows} == {
        (o, d, lay, s) for o in ("momentum", "adamw") for d in ("float32", "float64") for lay in layouts
        for s in (1, 2)}
    for row in rows:
        bound = 1e-11 if row["dtype"] == "float64" else 1e-5 if row["optimizer"] == "momentum" else 1e-2
        assert 0 <= row["difference"] < bound, row
