"""benchmarks/overlap.py: a short run of every part on LeNet writes every configuration with its step times and
buckets, each group's baseline at ratio 1 (no timing asserted)."""
import json

import pytest

from conftest import load_benchmark


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_short_run_measures_every_configuration(tmp_path, capsys):
    bench = load_benchmark("overlap")
    bench.main(["--parts", "process,sweep,job", "--models", "lenet", "--ks", "2", "--links", "plain",
                "--rounds", "1", "--steps", "1", "--timeout", "300", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "overlap.json").read_text())
    rows = result["rows"]
    assert [r["part"] for r in rows] == ["process"] * 5 + ["sweep"] * len(bench.SWEEP["lenet"]) + ["job"] * 3
    for r in rows:
        assert len(r["seconds"]) == 1 and r["median_ms"] > 0 and r["ratio"] > 0
    for part in ("process", "sweep", "job"):
        first = next(r for r in rows if r["part"] == part)
        assert first["ratio"] == 1.0 and first["bucket_mb"] is None and first["buckets"] == 1
    # LeNet's 0.5 MiB of gradients: one bucket of 25 MB, several of 0.1 MB, more of 0.004 MB
    buckets = {(r["part"], r["bucket_mb"]): r["buckets"] for r in rows}
    assert buckets[("process", 25)] == 1 and buckets[("job", 25)] == 1
    assert 1 < buckets[("process", 0.1)] == buckets[("job", 0.1)] < buckets[("sweep", 0.004)]
    defaults = rows[0]
    assert defaults["engine"] == bench.DEFAULTS and defaults["bulk"] == 15
    assert all(r["engine"] == bench.ENGINE for r in rows[1:])
    out = capsys.readouterr().out
    assert "### process" in out and "### sweep" in out and "### job" in out
