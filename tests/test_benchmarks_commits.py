"""benchmarks/commits.py: what an elastic job's commits in memory cost. Fast tier: a refused argument exits 2 with one
line and writes nothing, and the table in benchmarks/README.md is the one benchmarks/results/commits.json renders.
Slow tier: a quick run end to end."""
import json

import pytest

from conftest import ROOT, load_benchmark

pytestmark = pytest.mark.timeout(300)

bench = load_benchmark("commits")


def test_a_bad_repeats_exits_2_with_one_line_and_writes_nothing(capsys, tmp_path):
    assert bench.main(["--repeats", "0", "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == "error: --repeats must be >= 1, got 0\n"
    assert not (tmp_path / "out").exists()


def test_the_readme_table_is_the_one_the_results_file_renders():
    with open(f"{ROOT}/benchmarks/results/commits.json") as f:
        result = json.load(f)
    with open(f"{ROOT}/benchmarks/README.md") as f:
        readme = f.read()
    assert result["command"] in readme
    missing = [line for line in bench.render(result["rows"]) if line not in readme]
    assert not missing, f"benchmarks/README.md lacks these lines of commits.json's table: {missing}"


@pytest.mark.slow
def test_a_quick_run_commits_every_configuration(tmp_path, capsys):
    assert bench.main(["--quick", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "commits.json").read_text())["rows"]
    assert [(row["model"], row["commit_every"]) for row in rows] == [
        (model, every) for model in ("lenet", "resnet18") for every in bench.EVERYS]
    for row in rows:
        assert row["median_seconds"] > 0 and (row["commit_every"] is not None or row["ratio"] == 1.0)
        assert row["commit_bytes"] > (8e7 if row["model"] == "resnet18" else 1e6)   # parameters and momentum
    assert capsys.readouterr().out.startswith("| model | commit |")
