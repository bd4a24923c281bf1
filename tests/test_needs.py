"""The tests that need root, sshd or Horovod (conftest.py): each run says how many of each ran and skipped, and
``PARALLEL_MUST_RUN`` (set by .ci/run for what its machine has) turns a skip of one of those into a failed run."""
import os
import sys
import textwrap

import pytest

from conftest import run_process

TESTS = os.path.dirname(os.path.abspath(__file__))

#: An inner session's conftest: this suite's hooks, loaded under another name.
INNER_CONFTEST = f"""
import importlib.util
spec = importlib.util.spec_from_file_location("suite_conftest", {os.path.join(TESTS, "conftest.py")!r})
suite = importlib.util.module_from_spec(spec)
spec.loader.exec_module(suite)
pytest_collection_modifyitems = suite.pytest_collection_modifyitems
pytest_runtest_logreport = suite.pytest_runtest_logreport
pytest_terminal_summary = suite.pytest_terminal_summary
pytest_sessionfinish = suite.pytest_sessionfinish
"""

INNER_TESTS = """
import pytest

@pytest.mark.needs_root
def test_needs_root_and_skips():
    pytest.skip("needs root: not here")

@pytest.mark.needs_sshd
def test_needs_sshd_and_runs():
    pass

@pytest.mark.needs_root
@pytest.mark.needs_horovod
def test_needs_both_and_skips_for_horovod():
    pytest.skip("needs horovod: not installed")

def test_needs_nothing():
    pass
"""


def _inner(tmp_path, must_run):
    (tmp_path / "conftest.py").write_text(INNER_CONFTEST)
    (tmp_path / "test_inner.py").write_text(textwrap.dedent(INNER_TESTS))
    env = {name: value for name, value in os.environ.items() if not name.startswith("PYTEST_XDIST")}
    env["PARALLEL_MUST_RUN"] = must_run   # and not an xdist worker's variables: the inner run is a session of its own
    return run_process([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                        "-W", "ignore::pytest.PytestUnknownMarkWarning", str(tmp_path)], timeout=300,
                       cwd=tmp_path, env=env)


@pytest.mark.slow
@pytest.mark.parametrize("must_run, status", [("", 0), ("sshd", 0), ("root", 1), ("horovod,sshd", 1)])
def test_a_run_reports_what_ran_and_fails_when_a_test_it_must_run_skipped(must_run, status, tmp_path):
    result = _inner(tmp_path, must_run)
    assert result.returncode == status, result.stdout[-3000:]
    assert ("tests that need root, sshd or Horovod: root: 0 ran, 1 skipped; sshd: 1 ran, 0 skipped; horovod: 0 "
            "ran, 1 skipped") in result.stdout, result.stdout[-3000:]
    errors = [line for line in result.stdout.splitlines() if line.startswith("error: ")]
    want = {"": [], "sshd": [], "root": ["test_needs_root_and_skips"],
            "horovod,sshd": ["test_needs_both_and_skips_for_horovod"]}[must_run]
    assert [line.split("::")[1].split()[0] for line in errors] == want, errors
