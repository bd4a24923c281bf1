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
    assert "job: uninterrupted" in capsys.readouterr().out
