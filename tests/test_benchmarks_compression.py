"""The compression benchmark's smoke run: both parts measure every compressor, the job part MXNet's own 2-bit too."""
import json

import pytest

from conftest import load_benchmark


@pytest.mark.slow
def test_compression_quick_run_measures_every_compressor(tmp_path, capsys):
    """Every compressor in the process part; the job part with the package's 2-bit and MXNet's (each compressor
    trains in a job in tests/test_compress.py: the job part runs the same jobs, so its smoke run needs two)."""
    compression = load_benchmark("compression")
    assert compression.main(["--quick", "--part", "process", "--out", str(tmp_path)]) == 0
    assert compression.main(["--quick", "--part", "job", "--specs", "2bit,mxnet-2bit", "--out", str(tmp_path)]) == 0
    process = json.loads((tmp_path / "compression_process.json").read_text())["process"]["rows"]
    job = json.loads((tmp_path / "compression_job_2bit-mxnet-2bit.json").read_text())["job"]["rows"]
    assert set(process) == set(compression.SPECS) and set(job) == {"none", "2bit", "mxnet-2bit"}
    for rows, specs in ((process, ("2bit", "topk:0.01", "powersgd:4")), (job, ("2bit", "mxnet-2bit"))):
        assert all(row["seconds_per_epoch"] > 0 for row in rows.values())
        assert all(rows[spec]["bytes_per_step"] * 8 <= rows["none"]["bytes_per_step"] for spec in specs)
    out = capsys.readouterr().out
    assert "| process | bytes/step |" in out and "| job | bytes/step |" in out


@pytest.mark.slow
def test_compression_quick_run_trains_resnet18_too(tmp_path):
    compression = load_benchmark("compression")
    # the compressors whose bytes it checks (every one runs on LeNet above)
    assert compression.main(["--quick", "--model", "resnet18", "--part", "process", "--specs",
                             "2bit,topk:0.01,powersgd:4", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "compression_resnet18_process_2bit-topk_0.01-powersgd_4.json").read_text())
    assert result["model"] == "resnet18" and set(result["process"]["rows"]) == {"none", "2bit", "topk:0.01",
                                                                               "powersgd:4"}
    rows = result["process"]["rows"]
    assert rows["none"]["bytes_per_step"] > 40e6   # ResNet-18's 11.2 M float32 gradients, out and back
    assert all(rows[spec]["bytes_per_step"] * 8 <= rows["none"]["bytes_per_step"]
               for spec in ("2bit", "topk:0.01", "powersgd:4"))


@pytest.mark.slow   # seconds the fast tier's 150 s budget cannot spare (docs/testing.md)
def test_compression_runs_the_specs_it_is_given(tmp_path, capsys):
    compression = load_benchmark("compression")
    assert compression.main(["--quick", "--part", "process", "--specs", "powersgd:8,fp16", "--out",
                             str(tmp_path)]) == 0
    result = json.loads((tmp_path / "compression_process_powersgd_8-fp16.json").read_text())
    assert result["process"]["order"] and set(result["process"]["rows"]) == {"none", "powersgd:8", "fp16"}
    with pytest.raises(SystemExit) as stopped:
        compression.main(["--quick", "--specs", "topk:2"])
    assert stopped.value.code == 2 and "--specs topk:RATIO needs 0 < RATIO <= 1" in capsys.readouterr().err
