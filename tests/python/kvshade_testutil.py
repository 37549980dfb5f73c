"""Shared helpers of the Python tests: run a REAL kvshade-server on a loopback port and make
the in-tree package importable.

Environment (set by tests/python/CMakeLists.txt): KVSHADE_SERVER (the server binary),
KVSHADE_LIB (libkvshade.so), KVSHADE_PYTHONPATH (client/python).
"""
import os
import shutil
import subprocess
import sys
import tempfile
import time
import unittest

sys.path.insert(0, os.environ.get(
    "KVSHADE_PYTHONPATH",
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "client", "python")))


# The seed when KVSHADE_TEST_SEED is not set: fixed, so that the thresholds CI checks meet the
# same inputs on every run (scripts/seed-sweep.sh runs them over many seeds).
DEFAULT_SEED = 20261201


def seed():
    """KVSHADE_TEST_SEED or DEFAULT_SEED, logged so a failure can be replayed."""
    s = int(os.environ.get("KVSHADE_TEST_SEED") or DEFAULT_SEED)
    print("KVSHADE_TEST_SEED=%d" % s, file=sys.stderr)
    return s


class WithServer(unittest.TestCase):
    """A kvshade-server (its --backend: server_backend, None = the tests' default) and a client
    shared by the class's tests; a subclass sets up what it needs, then calls this one."""

    server_backend = None

    @classmethod
    def setUpClass(cls):
        import kvshade
        cls.server = Server(backend=cls.server_backend)
        cls.client = kvshade.Client(cls.server.target, timeout=60)
        cls.client.wait_ready(20)

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        assert cls.server.stop() == 0


class Server:
    """kvshade-server on 127.0.0.1:<free port> (--listen :0 + --port-file), stopped on exit."""

    def __init__(self, *args, ready_s=30.0, backend=None):
        binary = os.environ.get("KVSHADE_SERVER")
        if not binary:
            raise RuntimeError("KVSHADE_SERVER must name the kvshade-server binary")
        self.dir = tempfile.mkdtemp(prefix="kvshade-py-")
        port_file = os.path.join(self.dir, "port")
        self.log_path = os.path.join(self.dir, "server.log")
        # Passive OpenMP waiting: tests share 2 cores; spinning barriers slow the CPU backend.
        env = dict(os.environ, OMP_WAIT_POLICY="passive")
        # KVSHADE_TEST_BACKEND: the daemon's kernel backend (cpu here; cuda on a GPU machine),
        # unless the test names one (backend=).
        backend = backend or os.environ.get("KVSHADE_TEST_BACKEND", "cpu")
        cmd = [binary, "--listen", "127.0.0.1:0", "--port-file", port_file, "--backend", backend] + list(args)
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        end = time.monotonic() + ready_s
        while not os.path.exists(port_file):
            if self.proc.poll() is not None:
                raise RuntimeError("kvshade-server exited during start-up:\n" + self.log())
            if time.monotonic() > end:
                self.stop()
                raise RuntimeError("kvshade-server wrote no port file within %.0fs:\n%s" % (ready_s, self.log()))
            time.sleep(0.01)
        with open(port_file) as f:
            self.port = int(f.read().strip())
        self.target = "127.0.0.1:%d" % self.port

    def log(self):
        with open(self.log_path, "rb") as f:
            return f.read().decode("utf-8", "replace")

    def stop(self):
        """SIGTERM (graceful drain); returns the exit code."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        shutil.rmtree(self.dir, ignore_errors=True)
        return self.proc.returncode

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
