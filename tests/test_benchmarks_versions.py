"""Smoke test of benchmarks/versions.py: it times two layouts under the base commit (a temporary worktree, removed
afterwards) and this tree, and writes its JSON (no timings asserted)."""
import json
import os
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


def test_the_readme_quotes_issue_46_s_run_as_its_results_file_holds_it():
    """benchmarks/README.md's table of every layout through issue 46's composed step is the committed run's."""
    with open(os.path.join(ROOT, "benchmarks", "results", "issue46", "versions.json")) as f:
        result = json.load(f)
    with open(os.path.join(ROOT, "benchmarks", "README.md")) as f:
        readme = f.read()
    assert f"    $ OMP_NUM_THREADS={result['settings']['OMP_NUM_THREADS']} {result['command']}" in readme
    for row in result["layouts"]:
        base, this = row["samples"]["base"], row["samples"]["this"]
        assert (f"| {row['layout']} | {row['base_ms']:.1f} ms | {row['this_ms']:.1f} ms | {row['ratio']:.2f}x | "
                f"{min(base):.0f}-{max(base):.0f} | {min(this):.0f}-{max(this):.0f} |") in readme, row["layout"]
