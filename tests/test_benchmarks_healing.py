"""The healing benchmark's smoke run: every part measures, the killed job restarts once and finishes."""
import json

import pytest

from conftest import load_benchmark


@pytest.mark.slow
def test_healing_quick_run_measures_the_cost_and_the_killed_job(tmp_path, capsys):
    healing = load_benchmark("healing")
    assert healing.main(["--quick", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "healing.json").read_text())
    assert {(row["model"], row["checkpoint_every"]) for row in result["cost"]} == {
        ("lenet", None), ("lenet", 1), ("resnet18", None), ("resnet18", 1)}
    assert all(row["median_seconds"] > 0 for row in result["cost"])
    job = result["job"]
    assert job["uninterrupted"]["restarts"] == 0 and job["killed"]["restarts"] == 1
    assert 0 < job["killed"]["resumed"] < job["killed"]["total"]
    captured = capsys.readouterr()
    assert "job: uninterrupted" in captured.out
    # a long benchmark shows progress: what it will run, first, then a line a timed epoch (it was silent for a
    # minute, a line a round)
    err = [line for line in captured.err.splitlines() if line.startswith("cost: ")]
    assert err[0].startswith("cost: 1 round(s) of 4 timed epochs, then the job part: 2 jobs of 3 epochs"), err
    assert sum(line.startswith("cost: round 1/1, ") for line in err) == 4, err
