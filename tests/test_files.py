import os

import pytest

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
