"""Runs a command (argv[1:]) with KVSHADE_TARGET set to a freshly started kvshade-server;
exits with the command's status. Used by the C ABI test (tests/capi)."""
import os
import subprocess
import sys

from kvshade_testutil import Server

if __name__ == "__main__":
    with Server() as server:
        rc = subprocess.call(sys.argv[1:], env=dict(os.environ, KVSHADE_TARGET=server.target))
        if rc != 0:
            sys.stderr.write("server log:\n" + server.log())
    sys.exit(rc)
