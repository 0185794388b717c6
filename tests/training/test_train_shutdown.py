"""A distributed ``relattn train`` exits: the DDP path, shut down twenty times in a row, never hangs.

The hang this guards against was intermittent (a rank freeing DistributedDataParallel's reducer after the process
group was destroyed, about one run in four), so one run proves little: ``ddp_shutdown_loop.py`` runs the training
entry point and its shutdown in rounds, each with its own deadline, in two processes started here. The real
``torchrun ... relattn train`` command runs in ``test_train.py::test_torchrun_two_processes``.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROUNDS = 20
HERE = Path(__file__).resolve().parent


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@pytest.mark.slow
def test_ddp_training_shuts_down_every_time(tmp_path):
    ports = ",".join(map(str, _free_ports(ROUNDS)))
    env = {**os.environ, "PYTHONPATH": str(HERE.parents[1] / "src"), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(HERE / "ddp_shutdown_loop.py"), str(rank), ports, str(tmp_path)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in (0, 1)]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=60 * ROUNDS)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for rank, (p, out) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == 0, f"rank {rank} exited {p.returncode}:\n{out[-4000:]}"
        assert f"rank {rank}: round {ROUNDS - 1} done" in out, out[-2000:]
    assert all((tmp_path / f"round{i}" / "metrics.json").is_file() for i in range(ROUNDS))
