"""An elastic job's state in memory: ``checkpoint_bytes`` holds what a checkpoint directory holds and
``load_checkpoint_bytes`` reads it back (or refuses it, naming where it came from); a ``StateServer`` hands out
whole commits while they change, and a transfer cut short is an error, never a shorter state. The launcher's use
of both is in test_launch_restarts.py (the loop) and test_train_healing.py (jobs that grow and shrink)."""
import io
import socket
import threading
import zipfile

import numpy as np
import pytest

from parallel.checkpoint import (CheckpointError, TrainingState, checkpoint_bytes, load_checkpoint,
                                 load_checkpoint_bytes)
from parallel.handover import StateServer, fetch_state, parse_address
from parallel.models import init_lenet_params

pytestmark = pytest.mark.timeout(60)

STATE = TrainingState(epoch=1, batch=4, loss_sum=3.5, correct=2.0, seconds=0.25, shuffle_seed=11, history=[])


def _state_bytes(seed=0):
    params = init_lenet_params(seed=seed)
    momentum = [p * 0.5 for p in params]
    return params, momentum, checkpoint_bytes(params, STATE, {"lr": 0.1}, optimizer_state={"momentum": momentum})


def test_the_bytes_hold_the_checkpoint_a_directory_holds(tmp_path):
    params, momentum, data = _state_bytes()
    zipfile.ZipFile(io.BytesIO(data)).extractall(tmp_path)   # unzipped, a checkpoint directory
    for loaded in (load_checkpoint_bytes(data, model="lenet"), load_checkpoint(tmp_path, model="lenet")):
        assert loaded.state == STATE and loaded.config == {"lr": 0.1}
        for got, want in zip(loaded.params, params):
            np.testing.assert_array_equal(got.asnumpy(), want.asnumpy())
        for got, want in zip(loaded.optimizer_state["momentum"], momentum):
            np.testing.assert_array_equal(got.asnumpy(), want.asnumpy())


@pytest.mark.parametrize("damage, message", [
    (lambda data: data[:len(data) // 2], "not a checkpoint archive"),
    (lambda data: b"not a zip at all", "not a checkpoint archive"),
    # one byte of the parameters changed: the zip's CRC (or the manifest's sha256) tells
    (lambda data: data[:200] + bytes([data[200] ^ 1]) + data[201:], "corrupt|sha256"),
])
def test_damaged_bytes_are_refused_naming_where_they_came_from(damage, message):
    _, _, data = _state_bytes()
    with pytest.raises(CheckpointError, match=message) as raised:
        load_checkpoint_bytes(damage(data), label="the state from 10.0.0.2:4711")
    assert str(raised.value).startswith("the state from 10.0.0.2:4711")


def test_a_checkpoint_of_another_model_is_refused():
    _, _, data = _state_bytes()
    with pytest.raises(CheckpointError, match="a checkpoint of lenet, but this run trains resnet18"):
        load_checkpoint_bytes(data, model="resnet18")


def test_every_fetch_gets_one_whole_commit_while_they_change():
    """Commits made as functions (what a worker hands over: its state packed when first asked for), fetched by
    three clients while they change: every fetch gets one commit whole, packed by its own function."""
    server = StateServer("127.0.0.1")
    commits = {step: bytes([step]) * (1 << 18) * (1 + step % 3) for step in range(20)}
    got, errors = [], []

    def fetch():
        try:
            for _ in range(10):
                got.append(fetch_state("127.0.0.1", server.port))
        except OSError as e:
            errors.append(e)
    readers = [threading.Thread(target=fetch) for _ in range(3)]
    try:
        for reader in readers:
            reader.start()
        for step, data in commits.items():
            server.commit(step, lambda data=data: data)
        for reader in readers:
            reader.join(30)
    finally:
        server.close()
    assert not errors and len(got) == 30
    assert all(step == -1 and data == b"" or commits[step] == data for step, data in got)


def test_a_transfer_cut_short_is_an_error():
    """A sender that dies mid-way (its host lost): the fetch raises, it never returns part of a state."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def send_half():
        connection, _ = listener.accept()
        with connection:
            assert connection.recv(1) == b"L"   # the latest commit, please
            connection.sendall((5).to_bytes(8, "little") + (100).to_bytes(8, "little") + b"x" * 40)
    sender = threading.Thread(target=send_half)
    sender.start()
    try:
        with pytest.raises(ConnectionError, match="after 40 of 100 bytes"):
            fetch_state("127.0.0.1", port, timeout=10)
    finally:
        sender.join(10)
        listener.close()


@pytest.mark.parametrize("text", ["10.0.0.2", "10.0.0.2:", ":4711", "10.0.0.2:port", "10.0.0.2:0", "h:70000"])
def test_a_bad_state_address_is_refused_naming_the_variable(text):
    with pytest.raises(ValueError, match="PARALLEL_ELASTIC_STATE must be host:port"):
        parse_address(text)


def test_a_request_for_the_next_commit_waits_for_it():
    """What the launcher asks a worker for when a host joined: the commit after its request, so that the steps
    trained meanwhile are not lost; the latest one is sent at once."""
    server = StateServer("127.0.0.1")
    try:
        server.commit(3, b"three")
        got = []
        waiting = threading.Thread(target=lambda: got.append(fetch_state("127.0.0.1", server.port, next_commit=True)))
        waiting.start()
        assert fetch_state("127.0.0.1", server.port) == (3, b"three")
        waiting.join(0.5)
        assert waiting.is_alive() and got == []   # still waiting for a newer commit
        server.commit(4, lambda: b"four")
        waiting.join(10)
        assert got == [(4, b"four")]
    finally:
        server.close()
