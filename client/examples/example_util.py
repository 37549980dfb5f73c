"""What the examples share: starting a throwaway kvshade-server (--spawn) and half-split
RoPE of numpy arrays. Not part of the kvshade package; the examples import it from their
own folder."""
import os
import subprocess
import sys
import tempfile
import time

import numpy as np


def spawn(server, ucx=None, prefix="kvshade-example-"):
    """Starts `server` (the kvshade-server binary) on 127.0.0.1:<free port>, CPU backend,
    with the UCX data plane over `ucx` (UCX_TLS) when given; returns (process, target)."""
    d = tempfile.mkdtemp(prefix=prefix)
    port_file = os.path.join(d, "port")
    cmd = [server, "--listen", "127.0.0.1:0", "--port-file", port_file, "--backend", "cpu"]
    if ucx:
        cfg = os.path.join(d, "ucx.yaml")
        with open(cfg, "w") as f:
            f.write('ucx:\n  enable: true\n  transports: "%s"\n' % ucx)
        cmd += ["-c", cfg]
    # Passive OpenMP waiting: spinning barriers slow the CPU backend on shared cores.
    env = dict(os.environ, OMP_WAIT_POLICY="passive")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    end = time.monotonic() + 30
    while not os.path.exists(port_file):
        if proc.poll() is not None or time.monotonic() > end:
            proc.kill()
            sys.exit("kvshade-server did not start")
        time.sleep(0.01)
    with open(port_file) as f:
        return proc, "127.0.0.1:" + f.read().strip()


def rope(x, positions, theta=10000.0):
    """Half-split RoPE of x [..., n, heads, d] at positions [n] (post-RoPE queries)."""
    half = x.shape[-1] // 2
    inv = theta ** (-np.arange(half) * 2.0 / x.shape[-1])
    ang = positions[:, None] * inv[None]
    cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).astype(np.float32)
