"""Runs a command (argv[1:]) with KVSHADE_TARGET set to a freshly started kvshade-server;
exits with the command's status. Used by the C ABI test (tests/capi).

    run_with_server.py [--ucx TRANSPORTS] [--backend BACKEND] COMMAND...

--ucx starts the server with its UCX data plane on (`ucx.transports: TRANSPORTS`) and sets
KVSHADE_UCX_TRANSPORTS=TRANSPORTS for the command. --backend starts it on BACKEND (e.g.
cpu:0,cpu:1; docs/OPERATIONS.md "Devices") and sets KVSHADE_TEST_DEVICES to the number of
its devices for the command."""
import os
import subprocess
import sys
import tempfile

from kvshade_testutil import Server

if __name__ == "__main__":
    argv = sys.argv[1:]
    server_args, env = [], dict(os.environ)
    if argv[:1] == ["--ucx"]:
        transports, argv = argv[1], argv[2:]
        cfg = tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False)
        cfg.write('ucx:\n  enable: true\n  transports: "%s"\n' % transports)
        cfg.close()
        server_args = ["-c", cfg.name]
        env["KVSHADE_UCX_TRANSPORTS"] = transports
    backend = None
    if argv[:1] == ["--backend"]:
        backend, argv = argv[1], argv[2:]
        env["KVSHADE_TEST_DEVICES"] = str(len(backend.split(",")))
    try:
        with Server(*server_args, backend=backend) as server:
            env["KVSHADE_TARGET"] = server.target
            rc = subprocess.call(argv, env=env)
            if rc != 0:
                sys.stderr.write("server log:\n" + server.log())
    finally:
        if server_args:
            os.unlink(server_args[1])
    sys.exit(rc)
