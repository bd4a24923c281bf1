import doctest
import functools
import gzip
import hashlib
import http.server
import os
import re
import shutil
import socket
import struct
import sys
import threading

import mxnet as mx
import numpy as np
import pytest

import parallel.data as data
from parallel.data import fashion_mnist
from conftest import run_process

#: A wrong type is a TypeError and never a ValueError, and the other way round.
OTHER = {TypeError: ValueError, ValueError: TypeError}
from parallel.data import (FILES, DataError, default_data_dir, download_fashion_mnist, identify_dataset,
                           iterate_batches, load_fashion_mnist, load_idx_dataset, num_batches, read_idx,
                           synthetic_dataset, write_idx)

GZ_NAMES = [name + ".gz" for name in FILES.values()]


def idx_bytes(magic, dims, payload):
    """An IDX file built by hand, independently of write_idx."""
    return struct.pack(">I", magic) + struct.pack(">%dI" % len(dims), *dims) + bytes(payload)


def write_bytes(path, content):
    with open(path, "wb") as f:
        f.write(content)
    return str(path)


def small_dataset(n_train=6, n_test=4, size=28, seed=0):
    rng = np.random.RandomState(seed)
    return data.Dataset(rng.randint(0, 256, (n_train, size, size)).astype(np.uint8),
                        (np.arange(n_train) % 10).astype(np.uint8),
                        rng.randint(0, 256, (n_test, size, size)).astype(np.uint8),
                        (np.arange(n_test) % 10).astype(np.uint8))


def write_dataset(directory, dataset, gz=False):
    for role, name in FILES.items():
        write_idx(os.path.join(directory, name + (".gz" if gz else "")), getattr(dataset, role))


def no_temp_files(directory):
    return [f for f in os.listdir(directory) if f.startswith(".") or f.endswith((".part", ".tmp"))] == []


# --- read_idx / write_idx --------------------------------------------------------------------

def test_read_hand_built_images_and_labels(tmp_path):
    pixels = np.arange(2 * 3 * 4, dtype=np.uint8)
    images = read_idx(write_bytes(tmp_path / "im", idx_bytes(0x803, (2, 3, 4), pixels)))
    labels = read_idx(write_bytes(tmp_path / "lb", idx_bytes(0x801, (5,), [9, 0, 3, 3, 1])))
    assert images.dtype == np.uint8 and images.shape == (2, 3, 4)
    np.testing.assert_array_equal(images, pixels.reshape(2, 3, 4))
    assert labels.tolist() == [9, 0, 3, 3, 1]
    assert images.flags.writeable


def test_writer_matches_hand_built_bytes(tmp_path):
    array = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    write_idx(tmp_path / "a", array)
    assert (tmp_path / "a").read_bytes() == idx_bytes(0x803, (2, 3, 4), array.ravel())
    write_idx(tmp_path / "b", np.array([7, 1], dtype=np.uint8))
    assert (tmp_path / "b").read_bytes() == idx_bytes(0x801, (2,), [7, 1])


@pytest.mark.parametrize("name", ["x-idx3-ubyte", "x-idx3-ubyte.gz"])
def test_round_trip_raw_and_gz(tmp_path, name):
    array = np.random.RandomState(0).randint(0, 256, (7, 28, 28)).astype(np.uint8)
    path = write_idx(tmp_path / name, array)
    assert ((tmp_path / name).read_bytes()[:2] == b"\x1f\x8b") == name.endswith(".gz")
    np.testing.assert_array_equal(read_idx(path), array)
    assert no_temp_files(tmp_path)


def test_gzip_detected_by_magic_not_name(tmp_path):
    content = idx_bytes(0x801, (3,), [4, 5, 6])
    path = write_bytes(tmp_path / "labels-without-extension", gzip.compress(content))
    assert read_idx(path).tolist() == [4, 5, 6]
    # ... and a raw file named .gz is read as raw.
    assert read_idx(write_bytes(tmp_path / "raw.gz", content)).tolist() == [4, 5, 6]


@pytest.mark.parametrize("content, match", [
    (idx_bytes(0x802, (2, 2), [0] * 4), "bad magic number 0x00000802"),
    (idx_bytes(0x01000803, (1, 1, 1), [0]), "bad magic number 0x01000803"),
    (b"PK\x03\x04" + bytes(20), "bad magic number"),
    (idx_bytes(0x903, (1, 1, 1), [0] * 4), "data type 0x09"),
    (idx_bytes(0xD01, (2,), [0] * 8), "data type 0x0d"),
    (idx_bytes(0x803, (2, 2, 2), [0] * 7), "truncated.*need 8 payload bytes but the file has 7"),
    (idx_bytes(0x801, (3,), [1, 2, 3, 4]), "trailing bytes.*need 3 payload bytes but the file has 4"),
    (struct.pack(">II", 0x803, 5), "header truncated"),
    (b"\x00\x00", "too short"),
], ids=["ndim2", "nonzero-magic", "zip", "dtype09", "dtype0d", "truncated", "trailing", "short-header", "tiny"])
def test_malformed_files(tmp_path, content, match):
    path = write_bytes(tmp_path / "bad", content)
    with pytest.raises(DataError, match=match) as info:
        read_idx(path)
    assert str(tmp_path / "bad") in str(info.value) and "\n" not in str(info.value)
    # The same problems are found inside a gzip stream.
    gz = write_bytes(tmp_path / "bad.gz", gzip.compress(content))
    with pytest.raises(DataError, match=match):
        read_idx(gz)


@pytest.mark.parametrize("content", [
    b"\x1f\x8b" + b"garbage" * 10,                                      # not deflate at all
    gzip.compress(idx_bytes(0x801, (300,), range(256)) * 3)[:-30],      # cut short
    gzip.compress(idx_bytes(0x801, (3,), [1, 2, 3]))[:-4] + b"\0\0\0\0",  # wrong length trailer
], ids=["garbage", "cut-short", "bad-trailer"])
def test_corrupt_gzip_is_a_data_error(tmp_path, content):
    path = write_bytes(tmp_path / "x.gz", content)
    with pytest.raises(DataError, match="corrupt gzip stream.*download it again") as info:
        read_idx(path)
    assert "\n" not in str(info.value)


def test_empty_missing_and_directory(tmp_path):
    with pytest.raises(DataError, match="file is empty"):
        read_idx(write_bytes(tmp_path / "empty", b""))
    with pytest.raises(DataError, match="gzip stream is empty"):
        read_idx(write_bytes(tmp_path / "empty.gz", gzip.compress(b"")))
    with pytest.raises(DataError, match="no such file") as info:
        read_idx(tmp_path / "nope")
    assert str(tmp_path / "nope") in str(info.value)
    with pytest.raises(DataError, match="is a directory"):
        read_idx(tmp_path)


def test_write_idx_rejects_bad_arrays(tmp_path):
    with pytest.raises(TypeError, match="uint8"):
        write_idx(tmp_path / "f", np.zeros((2, 2, 2), dtype=np.float32))
    with pytest.raises(TypeError, match="uint8"):
        write_idx(tmp_path / "f", [1, 2])
    with pytest.raises(ValueError, match=r"shape \(2, 2\)"):
        write_idx(tmp_path / "f", np.zeros((2, 2), dtype=np.uint8))
    assert os.listdir(tmp_path) == []


def test_write_idx_replaces_atomically(tmp_path):
    path = tmp_path / "labels"
    write_idx(path, np.array([1, 2], dtype=np.uint8))
    write_idx(path, np.array([3], dtype=np.uint8))
    assert read_idx(path).tolist() == [3]
    assert os.listdir(tmp_path) == ["labels"]


# --- load_idx_dataset --------------------------------------------------------------------------

@pytest.mark.parametrize("gz", [False, True])
def test_load_idx_dataset(tmp_path, gz):
    ds = small_dataset()
    write_dataset(tmp_path, ds, gz=gz)
    loaded = load_idx_dataset(tmp_path)
    assert isinstance(loaded, data.Dataset)
    for a, b in zip(loaded, ds):
        assert a.dtype == np.uint8
        np.testing.assert_array_equal(a, b)


def test_raw_preferred_over_gz_and_mixed_ok(tmp_path):
    ds, other = small_dataset(seed=0), small_dataset(seed=1)
    write_dataset(tmp_path, other, gz=True)
    write_idx(tmp_path / FILES["train_images"], ds.train_images)  # raw beside its .gz
    loaded = load_idx_dataset(tmp_path)
    np.testing.assert_array_equal(loaded.train_images, ds.train_images)
    np.testing.assert_array_equal(loaded.test_images, other.test_images)


def test_missing_files_are_listed(tmp_path):
    write_idx(tmp_path / (FILES["train_images"] + ".gz"), small_dataset().train_images)
    with pytest.raises(DataError) as info:
        load_idx_dataset(tmp_path)
    message = str(info.value)
    assert str(tmp_path) in message and "or use the synthetic dataset" in message
    assert "--" not in message   # the library names its own terms, not the CLI's flags
    for role in ("train_labels", "test_images", "test_labels"):
        assert FILES[role] in message
    assert FILES["train_images"] not in message


@pytest.mark.parametrize("change, match", [
    (lambda d: d._replace(train_labels=d.train_labels[:-1]), "has 6 images but .* has 5 labels"),
    (lambda d: d._replace(test_images=d.test_images[:-1]), "has 3 images but .* has 4 labels"),
    (lambda d: d._replace(test_images=d.test_images[:, :27, :27]),
     "28x28 images but .*t10k-images-idx3-ubyte has 27x27"),
    (lambda d: small_dataset(size=32), "images are 32x32 but the models take 28x28 images"),
    (lambda d: d._replace(test_labels=np.array([0, 1, 10, 2], np.uint8)), "t10k-labels.*label 10 is out of range"),
    (lambda d: d._replace(train_labels=np.full(6, 255, np.uint8)), "label 255 is out of range.*10 classes"),
    (lambda d: d._replace(train_labels=d.train_images), "train-labels-idx1-ubyte should be 1-d labels"),
    (lambda d: d._replace(test_images=d.test_labels), "t10k-images-idx3-ubyte should be 3-d images"),
    (lambda d: small_dataset(n_train=0), "holds no examples"),
])
def test_inconsistent_datasets(tmp_path, change, match):
    write_dataset(tmp_path, change(small_dataset()))
    with pytest.raises(DataError, match=match) as info:
        load_idx_dataset(tmp_path)
    assert "\n" not in str(info.value)


# --- download ------------------------------------------------------------------------------------

class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture
def serve():
    """serve(directory) -> base URL of a loopback HTTP server for that directory."""
    servers = []

    def start(directory):
        handler = functools.partial(QuietHandler, directory=str(directory))
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        servers.append(server)
        return "http://127.0.0.1:%d/" % server.server_address[1]

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.fixture
def mirror_dir(tmp_path, monkeypatch):
    """A directory holding a small valid gzipped dataset, with FASHION_MNIST_SHA1 patched to match."""
    src = tmp_path / "mirror"
    src.mkdir()
    write_dataset(src, small_dataset(), gz=True)
    sha1 = {name: hashlib.sha1((src / name).read_bytes()).hexdigest() for name in GZ_NAMES}
    monkeypatch.setattr(fashion_mnist, "FASHION_MNIST_SHA1", sha1)
    return src


def closed_port_url():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return "http://127.0.0.1:%d/" % port


def test_download_from_loopback(tmp_path, mirror_dir, serve):
    dest = tmp_path / "a" / "b"  # created on the way
    got = download_fashion_mnist(dest, mirrors=[serve(mirror_dir)], progress=False)
    assert sorted(os.path.basename(p) for p in got) == sorted(GZ_NAMES)
    assert sorted(os.listdir(dest)) == sorted(GZ_NAMES)
    for name in GZ_NAMES:
        assert (dest / name).read_bytes() == (mirror_dir / name).read_bytes()
    np.testing.assert_array_equal(load_idx_dataset(dest).train_images, small_dataset().train_images)
    # Valid files are kept: a second call fetches nothing, even from a dead mirror.
    assert download_fashion_mnist(dest, mirrors=[closed_port_url()], progress=False) == []


def test_sha1_mismatch_falls_back_to_next_mirror(tmp_path, mirror_dir, serve):
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    write_dataset(wrong, small_dataset(seed=5), gz=True)  # same names, other bytes
    dest = tmp_path / "dest"
    download_fashion_mnist(dest, mirrors=[serve(wrong), serve(mirror_dir)], progress=False)
    for name in GZ_NAMES:
        assert (dest / name).read_bytes() == (mirror_dir / name).read_bytes()
    assert no_temp_files(dest)


def test_gz_with_another_sha1_is_kept_and_blocks_the_download(tmp_path, mirror_dir, serve):
    dest = tmp_path / "dest"
    dest.mkdir()
    write_bytes(dest / GZ_NAMES[0], b"stale")
    with pytest.raises(DataError, match="not downloading") as info:
        download_fashion_mnist(dest, mirrors=[serve(mirror_dir)], progress=False)
    assert GZ_NAMES[0] in str(info.value)
    assert os.listdir(dest) == [GZ_NAMES[0]] and (dest / GZ_NAMES[0]).read_bytes() == b"stale"


def test_unreachable_mirror_fails_fast_and_leaves_nothing(tmp_path, mirror_dir):
    dest = tmp_path / "dest"
    with pytest.raises(DataError) as info:
        download_fashion_mnist(dest, mirrors=[closed_port_url(), closed_port_url()], progress=False)
    message = str(info.value)
    assert "\n" not in message and str(dest) in message and "or use the synthetic dataset" in message
    assert "--" not in message
    assert "Connection refused" in message or "connect" in message.lower()
    for name in GZ_NAMES:
        assert name in message
    assert not dest.exists()  # the directory it created is removed again


def test_mirror_missing_some_files(tmp_path, mirror_dir, serve):
    os.remove(mirror_dir / GZ_NAMES[2])  # the mirror has no t10k-images: HTTP 404
    dest = tmp_path / "dest"
    with pytest.raises(DataError, match="HTTP 404") as info:
        download_fashion_mnist(dest, mirrors=[serve(mirror_dir)], progress=False)
    message = str(info.value)
    assert GZ_NAMES[2] in message and GZ_NAMES[3] in message and GZ_NAMES[0] not in message
    assert sorted(os.listdir(dest)) == sorted(GZ_NAMES[:2])  # the good ones are kept, no temp files


def test_sha1_mismatch_everywhere_leaves_nothing(tmp_path, mirror_dir, serve, monkeypatch):
    monkeypatch.setitem(fashion_mnist.FASHION_MNIST_SHA1, GZ_NAMES[0], "0" * 40)
    dest = tmp_path / "dest"
    with pytest.raises(DataError, match="sha1 mismatch"):
        download_fashion_mnist(dest, mirrors=[serve(mirror_dir)], progress=False)
    assert not dest.exists()


def test_uncreatable_data_dir(tmp_path):
    blocker = write_bytes(tmp_path / "file", b"x")
    with pytest.raises(DataError, match="cannot create the data directory.*or use the synthetic dataset$") as info:
        download_fashion_mnist(os.path.join(blocker, "sub"), mirrors=[closed_port_url()], progress=False)
    assert "--" not in str(info.value)


def test_default_data_dir_follows_mxnet_home(tmp_path, monkeypatch):
    monkeypatch.setenv("MXNET_HOME", str(tmp_path))
    assert default_data_dir() == os.path.join(str(tmp_path), "datasets", "fashion-mnist")


def test_load_fashion_mnist_without_download(tmp_path, monkeypatch):
    monkeypatch.setenv("MXNET_HOME", str(tmp_path))
    monkeypatch.setattr(fashion_mnist, "FASHION_MNIST_MIRRORS", [closed_port_url()])
    with pytest.raises(DataError, match="missing") as info:
        load_fashion_mnist(download=False)
    assert default_data_dir() in str(info.value) and FILES["test_labels"] in str(info.value)
    assert not os.path.exists(default_data_dir())  # nothing was attempted


def test_load_fashion_mnist_downloads_missing(tmp_path, mirror_dir, serve, monkeypatch):
    # the environment variable chooses the mirror (the autouse fixture points it at a closed port)
    monkeypatch.setenv("PARALLEL_FASHION_MNIST_MIRRORS", " , " + serve(mirror_dir))
    dest = tmp_path / "dest"
    dest.mkdir()
    shutil.copy(mirror_dir / GZ_NAMES[0], dest)  # a genuine .gz is kept, the other three are fetched
    loaded = load_fashion_mnist(dest, progress=False)
    np.testing.assert_array_equal(loaded.test_labels, small_dataset().test_labels)
    assert sorted(os.listdir(dest)) == sorted(GZ_NAMES)
    assert identify_dataset(dest) == "fashion-mnist"


def missing_in(message):
    """The file names a DataError message lists as missing."""
    found = re.search(r"(?:missing|could not download) (.*?) (?:\(raw or \.gz\)|into )", message)
    assert found, message
    return sorted(name[:-3] if name.endswith(".gz") else name for name in found.group(1).split(", "))


def test_errors_name_exactly_the_missing_files(tmp_path, mirror_dir):
    # One raw and one .gz present: only the other two are missing, whichever way the set is loaded.
    dest = tmp_path / "dest"
    dest.mkdir()
    ds = small_dataset()
    write_idx(dest / FILES["train_images"], ds.train_images)
    write_idx(dest / (FILES["test_labels"] + ".gz"), ds.test_labels)
    want = sorted([FILES["train_labels"], FILES["test_images"]])
    for load in (load_idx_dataset, lambda d: load_fashion_mnist(d, download=True, progress=False),
                 lambda d: load_fashion_mnist(d, download=False)):
        with pytest.raises(DataError) as info:
            load(dest)
        assert missing_in(str(info.value)) == want and "\n" not in str(info.value)
    # Genuine Fashion-MNIST .gz files present and the download fails: the rest are named, no more.
    other = tmp_path / "other"
    other.mkdir()
    for name in GZ_NAMES[1:3]:
        shutil.copy(mirror_dir / name, other)
    with pytest.raises(DataError, match="could not download") as info:
        load_fashion_mnist(other, progress=False)
    assert missing_in(str(info.value)) == sorted([FILES["train_images"], FILES["test_labels"]])
    assert sorted(os.listdir(other)) == sorted(GZ_NAMES[1:3])


@pytest.mark.parametrize("foreign", ["raw", "other-gz", "raw-beside-genuine-gz"])
def test_no_download_into_another_dataset(tmp_path, mirror_dir, serve, foreign):
    # e.g. MNIST or KMNIST: the same file names, other content. The mirror works, and is not used.
    dest = tmp_path / "dest"
    dest.mkdir()
    other = small_dataset(seed=9)
    shutil.copy(mirror_dir / GZ_NAMES[3], dest)  # one genuine Fashion-MNIST file
    if foreign == "raw":
        write_idx(dest / FILES["train_images"], other.train_images)
        bad = [FILES["train_images"]]
    elif foreign == "other-gz":
        write_idx(dest / GZ_NAMES[0], other.train_images)
        write_idx(dest / GZ_NAMES[2], other.test_images)
        bad = [GZ_NAMES[0], GZ_NAMES[2]]
    else:
        shutil.copy(mirror_dir / GZ_NAMES[0], dest)
        write_idx(dest / FILES["train_images"], other.train_images)  # what load_idx_dataset would read
        bad = [FILES["train_images"]]
    before = sorted(os.listdir(dest))
    with pytest.raises(DataError) as info:
        load_fashion_mnist(dest, progress=False)
    message = str(info.value)
    assert "\n" not in message and message.startswith(str(dest) + ": missing ")
    assert "not Fashion-MNIST" in message and "empty directory" in message
    assert "put the missing files there" in message and "the default directory, data_dir=None" in message
    assert "--" not in message
    assert missing_in(message) == sorted(n for n in FILES.values() if n not in before and n + ".gz" not in before)
    held = message.split("(raw or .gz), and ", 1)[1]
    assert all(name in held for name in bad) and GZ_NAMES[3] not in message
    assert sorted(os.listdir(dest)) == before  # nothing downloaded, nothing touched
    assert identify_dataset(dest) is None


def test_all_files_present_loads_without_download(tmp_path, mirror_dir, serve):
    # A complete other dataset loads as it is; download_fashion_mnist itself refuses to overwrite it.
    dest = tmp_path / "dest"
    dest.mkdir()
    write_dataset(dest, small_dataset(seed=4))
    np.testing.assert_array_equal(load_fashion_mnist(dest, progress=False).train_images,
                                  small_dataset(seed=4).train_images)
    with pytest.raises(DataError, match="not downloading Fashion-MNIST over another dataset") as info:
        download_fashion_mnist(dest, mirrors=[serve(mirror_dir)], progress=False)
    assert "missing" not in str(info.value) and FILES["test_labels"] in str(info.value)
    assert "data_dir=None" in str(info.value) and "--" not in str(info.value)
    assert sorted(os.listdir(dest)) == sorted(FILES.values())


def test_identify_dataset(tmp_path, mirror_dir, monkeypatch):
    assert identify_dataset(mirror_dir) == "fashion-mnist"
    assert identify_dataset(tmp_path / "nope") is None
    assert identify_dataset(tmp_path) is None  # holds only the mirror directory
    dest = tmp_path / "dest"
    shutil.copytree(mirror_dir, dest)
    os.remove(dest / GZ_NAMES[2])
    assert identify_dataset(dest) is None  # one missing
    write_idx(dest / GZ_NAMES[2], small_dataset(seed=3).test_images)
    assert identify_dataset(dest) is None  # one with another sha1
    shutil.copy(mirror_dir / GZ_NAMES[2], dest)
    assert identify_dataset(dest) == "fashion-mnist"
    write_idx(dest / FILES["test_labels"], small_dataset().test_labels)
    assert identify_dataset(dest) is None  # a raw file cannot be identified (and is what would be read)
    # The default directory, as load_fashion_mnist uses it.
    monkeypatch.setenv("MXNET_HOME", str(tmp_path / "home"))
    shutil.copytree(mirror_dir, default_data_dir())
    assert identify_dataset() == "fashion-mnist"


def test_failed_download_removes_only_the_empty_directories_it_created(tmp_path):
    existing = tmp_path / "existing"
    existing.mkdir()
    dest = existing / "a" / "b" / "c"
    with pytest.raises(DataError, match="could not download"):
        download_fashion_mnist(dest, mirrors=[closed_port_url()], progress=False)
    assert os.listdir(existing) == []  # a, a/b, a/b/c are gone; existing stays
    # A directory that existed before stays, even empty.
    dest.mkdir(parents=True)
    with pytest.raises(DataError):
        download_fashion_mnist(dest, mirrors=[closed_port_url()], progress=False)
    assert dest.is_dir()
    # Only the levels this call created are removed: here c, not the a/b that were already there.
    os.rmdir(dest)
    with pytest.raises(DataError):
        download_fashion_mnist(dest, mirrors=[closed_port_url()], progress=False)
    assert not dest.exists() and (existing / "a" / "b").is_dir()


def test_failed_download_keeps_directories_that_are_no_longer_empty(tmp_path, mirror_dir, serve):
    os.remove(mirror_dir / GZ_NAMES[3])
    dest = tmp_path / "x" / "y"
    with pytest.raises(DataError, match="HTTP 404"):
        download_fashion_mnist(dest, mirrors=[serve(mirror_dir)], progress=False)
    assert sorted(os.listdir(dest)) == sorted(GZ_NAMES[:3])


def test_default_mirrors_are_read_at_call_time(tmp_path, mirror_dir, serve, monkeypatch):
    # What the autouse no_network_downloads fixture relies on: the module global, patched where the code reads it.
    monkeypatch.delenv("PARALLEL_FASHION_MNIST_MIRRORS")
    monkeypatch.setattr(fashion_mnist, "FASHION_MNIST_MIRRORS", [serve(mirror_dir)])
    got = download_fashion_mnist(tmp_path / "dest", progress=False)
    assert sorted(os.path.basename(p) for p in got) == sorted(GZ_NAMES)


def test_module_docstring_examples_run():
    result = doctest.testmod(data, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 5 and result.failed == 0


def test_import_loads_neither_mxnet_nor_the_submodules():
    code = ("import sys, parallel.data as d; "
            "print(d.DATASETS, sorted(m for m in sys.modules if m.split('.')[0] in ('mxnet', 'numpy') "
            "or m.startswith('parallel.data.')))")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = run_process([sys.executable, "-c", code], cwd=root, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "('fashion-mnist', 'synthetic') []"


def test_every_public_name_is_re_exported():
    """Every submodule's ``__all__`` is the package's (with ``DATASETS``, its own), each name the submodule's."""
    import importlib
    import pkgutil
    submodules = sorted(info.name for info in pkgutil.iter_modules(data.__path__))
    assert submodules == ["batches", "fashion_mnist", "folder", "idx", "load", "synthetic"]
    exported = ["DATASETS"]
    for module in submodules:
        submodule = importlib.import_module("parallel.data." + module)
        exported += submodule.__all__
        for name in submodule.__all__:   # (the autouse no_network_downloads fixture patched the submodule's mirrors)
            assert getattr(data, name) is getattr(submodule, name) or name == "FASHION_MNIST_MIRRORS"
    assert sorted(data.__all__) == sorted(exported)
    assert set(data.__all__) <= set(dir(data))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        data.nope


# --- load_data -----------------------------------------------------------------------------------------

def test_load_data_by_name(tmp_path, monkeypatch):
    from parallel.data import DATASETS, load, load_data
    assert DATASETS == ("fashion-mnist", "synthetic")
    write_dataset(tmp_path, small_dataset(seed=2), gz=True)
    np.testing.assert_array_equal(load_data("fashion-mnist", tmp_path, progress=False).train_images,
                                  small_dataset(seed=2).train_images)
    monkeypatch.setattr(load, "synthetic_dataset", lambda seed: ("synthetic", seed))   # the full size takes a second
    assert load_data("synthetic", seed=4) == ("synthetic", 4)
    with pytest.raises(ValueError, match="name must be one of fashion-mnist, synthetic; got 'cifar'"):
        load_data("cifar")
    with pytest.raises(TypeError, match="name must be a string"):
        load_data(None)


# --- synthetic data --------------------------------------------------------------------------------

def test_synthetic_shapes_dtypes_balance():
    ds = synthetic_dataset(1003, 250, seed=3)
    assert ds.train_images.shape == (1003, 28, 28) and ds.test_images.shape == (250, 28, 28)
    assert ds.train_labels.shape == (1003,) and ds.test_labels.shape == (250,)
    assert all(a.dtype == np.uint8 for a in ds)
    for labels in (ds.train_labels, ds.test_labels):
        counts = np.bincount(labels, minlength=10)
        assert len(counts) == 10 and counts.max() - counts.min() <= 1
    assert 20 < ds.train_images.mean() < 200 and ds.train_images.std() > 30


def test_synthetic_deterministic_per_seed():
    a, b, c = synthetic_dataset(300, 50, seed=7), synthetic_dataset(300, 50, seed=7), synthetic_dataset(300, 50)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    assert not np.array_equal(a.train_images, c.train_images)
    # The test set does not depend on the size of the training set.
    np.testing.assert_array_equal(synthetic_dataset(10, 50, seed=7).test_images, a.test_images)


def test_synthetic_is_learnable_but_not_trivial():
    # Nearest class mean as a cheap stand-in for a trained model.
    ds = synthetic_dataset(3000, 1000, seed=0)
    means = np.stack([ds.train_images[ds.train_labels == c].reshape(-1, 784).mean(0) for c in range(10)])
    x = ds.test_images.reshape(-1, 784).astype(np.float32)
    dist = (x ** 2).sum(1)[:, None] - 2 * x @ means.T.astype(np.float32) + (means ** 2).sum(1)[None, :]
    accuracy = (dist.argmin(1) == ds.test_labels).mean()
    assert 0.5 <= accuracy < 0.97


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(num_train=0), ValueError, "num_train must be >= 1, got 0"),
    (dict(num_test=-1), ValueError, "num_test must be >= 1, got -1"),
    (dict(seed=-1), ValueError, "seed must be >= 0, got -1"),
    (dict(num_train=2.0), TypeError, "num_train must be an int, got 2.0"),
    (dict(num_train=1.5), TypeError, "num_train must be an int, got 1.5"),
    (dict(num_test=True), TypeError, "num_test must be an int, got True"),
    (dict(seed="0"), TypeError, "seed must be an int, got '0'"),
    (dict(seed=None), TypeError, "seed must be an int, got None"),
])
def test_synthetic_bad_arguments(kwargs, error, message):
    # A wrong type is a TypeError, a wrong value a ValueError; the message starts with the argument's name.
    with pytest.raises(error) as info:
        synthetic_dataset(**kwargs)
    assert isinstance(info.value, error) and not isinstance(info.value, OTHER[error]) and str(info.value) == message


def test_synthetic_takes_numpy_ints():
    a, b = synthetic_dataset(np.int64(20), np.uint8(10), seed=np.int32(3)), synthetic_dataset(20, 10, seed=3)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


# --- batches ----------------------------------------------------------------------------------------

def indexed(n):
    """Images whose pixels all equal the example's index, and labels index % 10."""
    images = np.broadcast_to(np.arange(n, dtype=np.uint8)[:, None, None], (n, 28, 28)).copy()
    return images, (np.arange(n) % 10).astype(np.uint8)


@pytest.mark.parametrize("shuffle", [False, True])
def test_batches_cover_every_example_once(shuffle):
    images, labels = indexed(23)
    batches = list(iterate_batches(images, labels, 5, shuffle=shuffle, seed=1))
    assert [X.shape[0] for X, _ in batches] == [5, 5, 5, 5, 3] and num_batches(23, 5) == 5
    order = np.concatenate([np.rint(X.asnumpy()[:, 0, 0, 0] * 255) for X, _ in batches]).astype(int)
    assert sorted(order) == list(range(23))
    assert (order != np.arange(23)).any() == shuffle
    ys = np.concatenate([y.asnumpy() for _, y in batches])
    np.testing.assert_array_equal(ys, order % 10)


def test_batch_shapes_dtypes_scaling():
    images = np.zeros((3, 28, 28), np.uint8)
    images[0, 0, 0], images[1, 5, 7] = 255, 51
    (X, y), = iterate_batches(images, np.array([9, 0, 4], np.uint8), 256)
    assert X.shape == (3, 1, 28, 28) and y.shape == (3,)
    assert X.dtype == np.float32 and y.dtype == np.float32
    assert X.context == mx.cpu() and y.context == mx.cpu()
    x = X.asnumpy()
    assert x[0, 0, 0, 0] == 1.0 and x[1, 0, 5, 7] == pytest.approx(0.2) and x.min() == 0.0
    assert y.asnumpy().tolist() == [9, 0, 4]


def test_shuffle_is_seeded():
    images, labels = indexed(40)

    def order(seed):
        return np.concatenate([y.asnumpy() for _, y in iterate_batches(images, labels, 7, True, seed)])

    np.testing.assert_array_equal(order(3), order(3))
    assert not np.array_equal(order(3), order(4))
    expected = labels[np.random.RandomState(3).permutation(40)]
    np.testing.assert_array_equal(order(3), expected)


@pytest.mark.parametrize("bad, error, message", [
    (0, ValueError, "batch_size must be >= 1, got 0"),
    (-2, ValueError, "batch_size must be >= 1, got -2"),
    (2.0, TypeError, "batch_size must be an int, got 2.0"),
    (2.5, TypeError, "batch_size must be an int, got 2.5"),
    (True, TypeError, "batch_size must be an int, got True"),
    ("4", TypeError, "batch_size must be an int, got '4'"),
    (None, TypeError, "batch_size must be an int, got None"),
])
def test_bad_batch_size(bad, error, message):
    images, labels = indexed(4)
    for call in (lambda: iterate_batches(images, labels, bad),   # raised at the call, not at the first next()
                 lambda: num_batches(4, bad)):
        with pytest.raises(error) as info:
            call()
        assert isinstance(info.value, error) and not isinstance(info.value, OTHER[error]) and str(info.value) == message


@pytest.mark.parametrize("bad, error, message", [
    (-1, ValueError, "start must be >= 0, got -1"),
    (1.0, TypeError, "start must be an int, got 1.0"),
    (None, TypeError, "start must be an int, got None"),
])
def test_bad_start(bad, error, message):
    images, labels = indexed(4)
    with pytest.raises(error) as info:
        iterate_batches(images, labels, 2, start=bad)
    assert isinstance(info.value, error) and not isinstance(info.value, OTHER[error]) and str(info.value) == message


def test_start_skips_batches():
    images, labels = indexed(10)
    whole = [y.asnumpy().tolist() for _, y in iterate_batches(images, labels, 3, shuffle=True, seed=5)]
    rest = [y.asnumpy().tolist() for _, y in iterate_batches(images, labels, 3, shuffle=True, seed=5,
                                                             start=np.int64(2))]
    assert rest == whole[2:] and list(iterate_batches(images, labels, 3, start=4)) == []


def test_mismatched_images_and_labels():
    images, labels = indexed(4)
    with pytest.raises(ValueError, match=r"\(4, 28, 28\) and \(3,\)"):
        iterate_batches(images, labels[:3], 2)
    with pytest.raises(ValueError, match="height, width"):
        iterate_batches(images[0], labels, 2)


def test_num_batches():
    assert [num_batches(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    assert num_batches(np.int64(9), np.int32(4)) == 3
    with pytest.raises(ValueError, match="^n must be >= 0, got -1$"):
        num_batches(-1, 4)
    with pytest.raises(TypeError, match=r"^n must be an int, got 9\.0$"):
        num_batches(9.0, 4)


@pytest.mark.parametrize("bad, error", [(-1, ValueError), (2 ** 32, ValueError), (1.0, TypeError),
                                        (None, TypeError), (True, TypeError)])
def test_epoch_seed_bad_seed(bad, error):
    with pytest.raises(error, match="^seed must be"):
        data.epoch_seed(bad, 1)
