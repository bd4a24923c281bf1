"""A job's scheduler or server: ps-lite's loop run through MXNet's C API, without importing MXNet's Python package.

``python -c "import mxnet"`` with ``DMLC_ROLE`` set to ``scheduler`` or ``server`` is how MXNet's ``tools/launch.py``
starts them: the last module the import loads (``mxnet.kvstore.kvstore_server``) creates a ``dist`` kvstore and
runs its server loop until the job ends. Before it gets there the import registers every operator as a Python
function and loads what MXNet imports when it is installed (scipy, scikit-learn, requests): about 2.5 s of one
core a process, which a scheduler and its servers never use, paid again at every start of a job while the workers
import MXNet on the same cores. This module does what that last module does, and only that: it loads libmxnet
(found as MXNet finds it, ``MXNET_LIBRARY_PATH`` first), creates the ``dist`` kvstore (``MXKVStoreCreate``) and
runs the loop (``MXKVStoreRunServer``) with the same controller: the one command a worker sends to the servers,
an optimizer (``kv.set_optimizer``, which ``gluon.Trainer`` sends when it updates on the kvstore), imports MXNet
then, as the controller of ``import mxnet`` would have it, and installs its updater. The summing itself is MXNet's
C++ server either way. The launcher runs it as ``python -m parallel.launch.server`` with ps-lite's ``DMLC_*``
variables set (``parallel.launch.processes.SERVER_COMMAND``).
"""
import ctypes
import importlib.util
import logging
import os
import pickle
import sys

_CONTROLLER = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)


def library_path():
    """Where MXNet's ``import`` would load libmxnet from: ``mxnet/libinfo.py``'s ``find_lib_path`` (which reads
    ``MXNET_LIBRARY_PATH`` and ``LD_LIBRARY_PATH``), loaded as a file of its own so that MXNet's package is not
    imported. Raises RuntimeError, as MXNet's import does, when there is none."""
    spec = importlib.util.find_spec("mxnet")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("MXNet is not installed: pip install 'mxnet==1.9.1'")
    path = os.path.join(spec.submodule_search_locations[0], "libinfo.py")
    libinfo = importlib.util.spec_from_file_location("_parallel_mxnet_libinfo", path)
    module = importlib.util.module_from_spec(libinfo)
    libinfo.loader.exec_module(module)
    return module.find_lib_path()[0]


class Server:
    """ps-lite's scheduler or server loop of this process (``DMLC_ROLE``), on libmxnet loaded with ``ctypes``."""

    def __init__(self):
        self.lib = ctypes.CDLL(library_path(), ctypes.RTLD_LOCAL)
        self.lib.MXGetLastError.restype = ctypes.c_char_p
        self.handle = ctypes.c_void_p()
        self.kvstore = None   # MXNet's KVStore around the handle, once an optimizer arrives
        self._logging = False

    def _check(self, status):
        if status != 0:
            raise RuntimeError(self.lib.MXGetLastError().decode(errors="replace"))

    def run(self):
        """Create the ``dist`` kvstore and run its loop until the scheduler ends the job."""
        self._check(self.lib.MXKVStoreCreate(b"dist", ctypes.byref(self.handle)))
        self._controller = _CONTROLLER(self.command)   # referenced while the loop runs
        self._check(self.lib.MXKVStoreRunServer(self.handle, self._controller, None))

    def command(self, cmd_id, body, _):
        """MXNet's server controller (``KVStoreServer._controller``): command 0 is a pickled optimizer."""
        if not self._logging:   # as MXNet's controller does, at the first command (the rank is known by then)
            logging.basicConfig(level=logging.DEBUG, format=f"%(asctime)-15s Server[{self.rank()}] %(message)s")
            self._logging = True
        if cmd_id != 0:
            print(f"server {self.rank()}, unknown command ({cmd_id}, {body})")
            return
        self.mxnet_kvstore().set_optimizer(pickle.loads(body))

    def rank(self):
        rank = ctypes.c_int()
        self._check(self.lib.MXKVStoreGetRank(self.handle, ctypes.byref(rank)))
        return rank.value

    def mxnet_kvstore(self):
        """MXNet's ``KVStore`` around this process's handle, importing MXNet the first time. MXNet's import ends
        by running a server when ``DMLC_ROLE`` names one: it is imported as a worker's would be, then the role is
        put back, so that ``set_optimizer`` installs the updater here rather than sending it on."""
        if self.kvstore is None:
            role = os.environ["DMLC_ROLE"]
            os.environ["DMLC_ROLE"] = "worker"
            try:
                import mxnet as mx
            finally:
                os.environ["DMLC_ROLE"] = role
            self.kvstore = mx.kv.KVStore(self.handle)
        return self.kvstore

    def shutdown(self):
        """What MXNet's import registers at exit (``MXNotifyShutdown``): its engine stops before the process ends."""
        if self.kvstore is None:   # else MXNet's own exit handler does it
            self._check(self.lib.MXNotifyShutdown())


def main():
    if os.environ.get("DMLC_ROLE") not in ("scheduler", "server"):
        print("error: DMLC_ROLE must be scheduler or server (the launcher sets it)", file=sys.stderr)
        return 2
    server = Server()
    try:
        server.run()
    finally:
        server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
