"""benchmarks/rounding.py on a few steps: accumulating micro-batches is the whole batch's step in float64 (to its
rounding), so what float32 shows is rounding, not an error."""
import json

from conftest import load_benchmark


def test_accumulate_equals_the_whole_batch_in_float64(tmp_path):
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
