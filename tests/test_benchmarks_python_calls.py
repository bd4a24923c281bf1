"""benchmarks/python_calls.py: Python calls a step of the CLI's loop with nothing observed. Counts are the code's,
not the machine's speed: the quick run holds issue 47's bounds (a step that pays for a trace, a board or a check it
does not use again fails here), and the benchmarks' README quotes the recorded runs as their files hold them."""
import json
import os
import tempfile

from conftest import load_benchmark

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: Issue 47's bounds: at most 0.75 of the calls a step of 8b7eb79 (3,206 and 58,802), cut further to these.
BOUNDS = {"lenet-data": 2400, "vit-tensor2": 44100}


def test_a_quick_count_holds_issue_47_s_bounds(tmp_path, capsys, monkeypatch):
    bench = load_benchmark("python_calls")
    scratch = tmp_path / "scratch"   # where the quick run writes its data, and must remove it
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    assert bench.main(["--quick", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "python_calls.json").read_text())
    rows = {row["configuration"]: row for row in result["rows"]}
    assert sorted(rows) == sorted(BOUNDS)
    for name, row in rows.items():
        assert row["steps"] == 3 and "--no-progress" in row["argv"]   # 2 epochs of 4: steps 2-4 of the second
        assert 0 < row["calls_a_step"] <= BOUNDS[name], row
    assert list(scratch.iterdir()) == []
    assert "| lenet-data | --model lenet |" in capsys.readouterr().out


def test_the_counts_quoted_are_those_recorded():
    with open(os.path.join(ROOT, "benchmarks", "README.md")) as f:
        readme = f.read()
    for name in ("python_calls.json", os.path.join("before", "python_calls.json")):
        with open(os.path.join(ROOT, "benchmarks", "results", "issue47", name)) as f:
            result = json.load(f)
        assert result["command"].replace("$TMPDIR/", "") in readme.replace("$ ", ""), name   # the data beside
        for row in result["rows"]:
            assert f"{row['calls_a_step']:,.0f}" in readme, (name, row["configuration"])
