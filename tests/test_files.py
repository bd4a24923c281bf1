import os
import re

import pytest

from conftest import run_process

from parallel.files import atomic_write, check_writable


def test_atomic_write_replaces_whole_file_or_nothing(tmp_path):
    target = tmp_path / "out.json"
    with atomic_write(target) as f:
        f.write("first")
    assert target.read_text() == "first"
    with pytest.raises(RuntimeError):
        with atomic_write(target) as f:
            f.write("half of the sec")
            raise RuntimeError("interrupted")
    assert target.read_text() == "first"            # the old version survives
    assert os.listdir(tmp_path) == ["out.json"]       # and no temporary file is left


def test_new_files_get_the_umask_mode_and_existing_files_keep_theirs(tmp_path):
    old = os.umask(0o022)
    try:
        with atomic_write(tmp_path / "new.png", "wb") as f:
            f.write(b"x")
        assert (tmp_path / "new.png").stat().st_mode & 0o777 == 0o644   # not mkstemp's 0600
        kept = tmp_path / "kept.txt"
        kept.write_text("a")
        kept.chmod(0o640)
        with atomic_write(kept) as f:
            f.write("b")
        assert kept.stat().st_mode & 0o777 == 0o640 and kept.read_text() == "b"
    finally:
        os.umask(old)


def test_check_writable(tmp_path):
    check_writable(tmp_path / "fine.json")
    assert os.listdir(tmp_path) == []
    with pytest.raises(ValueError, match="is a directory"):
        check_writable(tmp_path)
    with pytest.raises(ValueError, match="does not exist"):
        check_writable(tmp_path / "missing" / "x.json", "--plot")


def test_atomic_write_never_changes_the_umask(tmp_path, monkeypatch):
    # Setting the umask to read it races with other threads creating files: the kernel applies it instead.
    def forbidden(mask):
        raise AssertionError("atomic_write called os.umask(%o)" % mask)

    monkeypatch.setattr(os, "umask", forbidden)
    with atomic_write(tmp_path / "a.txt") as f:
        f.write("x")
    assert (tmp_path / "a.txt").read_text() == "x"


def test_temp_file_is_created_beside_the_target_with_the_umask_mode(tmp_path):
    old = os.umask(0o027)
    try:
        with atomic_write(tmp_path / "out.json") as f:
            f.write("{}")
            (tmp,) = os.listdir(tmp_path)
            assert tmp.startswith(".out.json.") and tmp.endswith(".tmp") and len(tmp) > len(".out.json..tmp")
            assert (tmp_path / tmp).stat().st_mode & 0o777 == 0o640   # 0o666 less the umask, from the start
    finally:
        os.umask(old)
    assert os.listdir(tmp_path) == ["out.json"]


def test_temp_name_clash_is_retried(tmp_path, monkeypatch):
    import secrets
    names = iter(["taken", "taken", "free"])
    monkeypatch.setattr(secrets, "token_hex", lambda nbytes=None: next(names))
    (tmp_path / ".out.txt.taken.tmp").write_text("someone else's")
    with atomic_write(tmp_path / "out.txt") as f:
        f.write("mine")
    assert (tmp_path / "out.txt").read_text() == "mine"
    assert (tmp_path / ".out.txt.taken.tmp").read_text() == "someone else's"
    assert sorted(os.listdir(tmp_path)) == [".out.txt.taken.tmp", "out.txt"]


def test_a_symbolic_link_is_written_through_to_its_target(tmp_path):
    target = tmp_path / "real.json"
    target.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    with atomic_write(link) as f:
        f.write("new")
    assert link.is_symlink() and target.read_text() == "new"    # the link stays a link, its target is new
    dangling = tmp_path / "dangling.json"
    dangling.symlink_to(tmp_path / "created.json")
    with atomic_write(dangling) as f:
        f.write("made")
    assert dangling.is_symlink() and (tmp_path / "created.json").read_text() == "made"
    assert sorted(os.listdir(tmp_path)) == ["created.json", "dangling.json", "link.json", "real.json"]


@pytest.mark.parametrize("make, kind", [
    (lambda d: "/dev/full", "a character device"),
    (lambda d: (os.mkfifo(d / "fifo"), str(d / "fifo"))[1], "a FIFO (named pipe)"),
    (lambda d: ((d / "to-dev").symlink_to("/dev/null"), str(d / "to-dev"))[1], "a character device"),
])
def test_what_is_not_a_regular_file_is_refused_and_left_alone(tmp_path, make, kind):
    """As root, --metrics-json /dev/full once replaced the device node with a JSON file."""
    path = make(tmp_path)
    before = os.stat(path)
    with pytest.raises(ValueError, match=re.escape(f"is {kind}, not a regular file")):
        check_writable(path, "metrics_json")
    with pytest.raises(ValueError, match="not a regular file"):
        with atomic_write(path) as f:
            f.write("x")
    after = os.stat(path)
    assert (after.st_mode, after.st_ino, after.st_rdev) == (before.st_mode, before.st_ino, before.st_rdev)


def test_remove_temporaries_leaves_no_temporary_file(tmp_path):
    from parallel.files import remove_temporaries
    (tmp_path / "out.json").write_text("old")
    with pytest.raises(SystemExit):
        with atomic_write(tmp_path / "out.json") as f:
            f.write("half")
            assert len(os.listdir(tmp_path)) == 2
            remove_temporaries()                   # what an immediate exit does
            assert os.listdir(tmp_path) == ["out.json"]
            raise SystemExit
    assert (tmp_path / "out.json").read_text() == "old"


def test_a_directory_lock_refuses_a_second_holder_until_released(tmp_path):
    import sys
    import textwrap
    from parallel.files import DirectoryLock, DirectoryLocked
    with DirectoryLock(tmp_path) as lock:
        code = textwrap.dedent(f"""
            from parallel.files import DirectoryLock, DirectoryLocked
            try:
                DirectoryLock({str(tmp_path)!r}).acquire()
                print("acquired")
            except DirectoryLocked as e:
                print(e)
            """)
        other = run_process([sys.executable, "-c", code], timeout=60)
        assert f"is in use by process {os.getpid()} on " in other.stdout, other.stderr
        with pytest.raises(DirectoryLocked):
            DirectoryLock(tmp_path).acquire()
        assert lock.path.endswith(".lock")
    again = run_process([sys.executable, "-c", code], timeout=60)
    assert again.stdout.strip() == "acquired", again.stderr


def test_a_later_start_of_the_same_job_takes_the_lock_over_and_the_earlier_holder_writes_nothing(tmp_path):
    """A process cut off on a partitioned host still holds --checkpoint-dir when the launcher starts the job again
    elsewhere: the new start (same job token, a later restart) takes it over; anyone else is still refused."""
    from parallel.checkpoint import CheckpointWriteError, CheckpointWriter
    from parallel.files import DirectoryLock, DirectoryLocked
    earlier = DirectoryLock(tmp_path, job="abc", restart=0).acquire()
    for job, restart in (("abc", 0), ("xyz", 5), (None, 1)):
        with pytest.raises(DirectoryLocked, match="is in use by process"):
            DirectoryLock(tmp_path, job=job, restart=restart).acquire()
    assert earlier.held()
    later = DirectoryLock(tmp_path, job="abc", restart=1).acquire()
    assert later.held() and not earlier.held()
    with pytest.raises(CheckpointWriteError, match="was taken over by a later start of this job"):
        CheckpointWriter(tmp_path, {}, lock=earlier)(None)
    earlier.release()   # leaves the later start's lock file alone
    assert later.held()
    with pytest.raises(DirectoryLocked):
        DirectoryLock(tmp_path, job="abc", restart=1).acquire()
    later.release()
    assert not os.path.exists(tmp_path / ".lock") and not later.held()
