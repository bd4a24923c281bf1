"""benchmarks/hosts.py: the bytes each simulated host's link carries a step, against a ring's 2(W-1)/W."""
import json

import pytest

from conftest import load_benchmark

bench = load_benchmark("hosts")


@pytest.mark.parametrize("argv, message", [(["--hosts", "0"], "--hosts"), (["--steps", "0"], "--steps must be >= 1"),
                                           (["--extra", "0"], "--extra must be >= 1")])
def test_bad_arguments_exit_2(argv, message, capsys, tmp_path):
    try:
        status = bench.main(argv + ["--out", str(tmp_path)])
    except SystemExit as e:   # argparse's own refusal (--hosts)
        status = e.code
    assert status == 2 and message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_quick_run_counts_what_each_link_carries(make_cluster, tmp_path, capsys):
    """On 2 hosts, a parameter server moves what a ring does: each link carries the gradients once each way a
    step (2(W-1)/W = 1), plus TCP/IP's headers and ps-lite's messages, with one server or one a host."""
    make_cluster  # skips, with the reason, where simulated hosts cannot be made
    assert bench.main(["--quick", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "hosts.json").read_text())
    assert [(r["hosts"], r["servers"]) for r in result["records"]] == [(2, 2), (2, 1)]
    for record in result["records"]:
        for share in record["sent_share"] + record["received_share"]:
            assert 1.0 <= share < 1.15, record
    assert "| 2 | 1 | h2 |" in capsys.readouterr().out
