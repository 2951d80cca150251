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


def _launch(tmp_path: Path, launcher: list[str], worker_args: list[str], env: dict | None) -> tuple[dict, str]:
    out = tmp_path / f"result-{free_port()}.json"
    command = [*launcher, str(WORKER), "--out", str(out), *worker_args]
    run_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.run(command, capture_output=True, text=True, timeout=900, env=run_env, cwd=tmp_path)
    assert proc.returncode == 0, f"{' '.join(command)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(out.read_text()), proc.stdout


def launch(tmp_path: Path, launcher: list[str], *worker_args: str, env: dict | None = None) -> dict:
    """One worker sub-command on 2 processes: what rank 0 wrote."""
    return _launch(tmp_path, launcher, list(worker_args), env)[0]


def launch_batch(
    tmp_path: Path, launcher: list[str], jobs: dict[str, list[str]], env: dict | None = None
) -> tuple[dict, str]:
    """Several worker sub-commands in ONE launch (`{name: [sub-command, args...]}`, run in that order; each launch
    costs ~20 s of imports on 2 cores): `{name: that job's result}`, and what the processes printed."""
    jobs_file = tmp_path / f"jobs-{free_port()}.json"
    jobs_file.write_text(json.dumps(jobs))
    return _launch(tmp_path, launcher, ["batch", str(jobs_file)], env)


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
