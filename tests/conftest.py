import mxnet as mx
import numpy as np
import pytest


def contexts(k):
    """K distinct CPU contexts: each gets its own worker thread in MXNet's engine."""
    return [mx.cpu(i) for i in range(k)]


@pytest.fixture
def rng():
    return np.random.RandomState(1234)


def easy_dataset(num_train=2000, num_test=300, seed=0):
    """A small, clearly separable MNIST-format set: each class is a bright block in its own place.

    LeNet with the textbook's N(0, 0.01) init sits at chance for ~150-250 SGD steps whatever the data;
    on this set it then learns within a few dozen steps, so a short CLI run shows accuracy rising.
    """
    from parallel.data import Dataset

    def draw(n, rng):
        labels = (np.arange(n) % 10).astype(np.uint8)
        rng.shuffle(labels)
        images = rng.randint(0, 60, (n, 28, 28))
        for c in range(10):
            row, col = divmod(c, 4)
            images[labels == c, row * 9 + 1:row * 9 + 9, col * 7:col * 7 + 7] += 180
        return np.clip(images, 0, 255).astype(np.uint8), labels

    rng = np.random.RandomState(seed)
    return Dataset(*draw(num_train, rng), *draw(num_test, rng))


def _closed_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(autouse=True)
def no_network_downloads(monkeypatch):
    """Tests never touch the network: any download goes to a closed loopback port and fails at once,
    in this process and in subprocesses (through the environment variable)."""
    mirror = f"http://127.0.0.1:{_closed_port()}/"
    monkeypatch.setenv("PARALLEL_FASHION_MNIST_MIRRORS", mirror)
    monkeypatch.setattr("parallel.data.FASHION_MNIST_MIRRORS", [mirror])
    monkeypatch.setenv("MXNET_HOME", "/nonexistent-mxnet-home-for-tests")
