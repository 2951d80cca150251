"""Launching `distributed_worker.py` on 2 CPU processes (gloo) and reading back what rank 0 wrote."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

WORKER = Path(__file__).with_name("distributed_worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(tmp_path: Path, launcher: list[str], *worker_args: str, env: dict | None = None) -> dict:
    out = tmp_path / f"result-{free_port()}.json"
    command = [*launcher, str(WORKER), *worker_args, "--out", str(out)]
    run_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600, env=run_env, cwd=tmp_path)
    assert proc.returncode == 0, f"{' '.join(command)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(out.read_text())


def torchrun() -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
    ]
