"""Smoke test of benchmarks/versions.py: it times two layouts under the base commit (a temporary worktree, removed
afterwards) and this tree, and writes its JSON (no timings asserted)."""
import json
import subprocess

import pytest

from conftest import ROOT, load_benchmark


@pytest.mark.slow
def test_quick_run_times_both_versions_and_removes_its_worktree(tmp_path, capsys):
    known = subprocess.run(["git", "cat-file", "-e", "cfc071f^{commit}"], cwd=ROOT, capture_output=True)
    if known.returncode != 0:
        pytest.skip("the base commit is not in this clone's history")
    bench = load_benchmark("versions")
    before = subprocess.run(["git", "worktree", "list"], cwd=ROOT, capture_output=True, text=True).stdout
    assert bench.main(["--quick", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "versions.json").read_text())
    assert [row["layout"] for row in result["layouts"]] == bench.QUICK
    for row in result["layouts"]:
        assert row["base_ms"] > 0 and row["this_ms"] > 0 and row["ratio"] > 0
        assert [len(samples) for samples in row["samples"].values()] == [1, 1]
    assert "this / base" in capsys.readouterr().out
    assert subprocess.run(["git", "worktree", "list"], cwd=ROOT, capture_output=True, text=True).stdout == before
