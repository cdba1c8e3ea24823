"""Hybrid attention across two OS processes (gloo CPU collectives), ring over the boundary."""

import os
import socket
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.multiprocess

WORKER = os.path.join(os.path.dirname(__file__), "workers", "hybrid_two_process.py")
TIMEOUT_S = 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_hybrid_across_two_processes():
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), env.get("PYTHONPATH", "")])
    procs = [subprocess.Popen([sys.executable, WORKER, str(port), str(i)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while any(p.poll() is None for p in procs):
            failed = [p for p in procs if p.poll() not in (None, 0)]
            if failed or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        outputs = [p.communicate()[0] for p in procs]
    codes = [p.returncode for p in procs]
    report = "\n".join(f"--- process {i} (exit {c}) ---\n{o[-3000:]}"
                       for i, (c, o) in enumerate(zip(codes, outputs)))
    if codes != [0, 0]:
        pytest.fail(f"two-process hybrid run failed or timed out after {TIMEOUT_S}s:\n{report}")
    for i, out in enumerate(outputs):
        assert f"process {i}: 16 local shards match the reference" in out, report
