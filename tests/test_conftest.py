"""conftest.py's default of one pytest-xdist worker process per core: a run without `-n` starts the workers, each
with its share of the cores as torch's threads (and as OMP_NUM_THREADS, for the processes its tests start); `-n 0`
and `-p no:xdist` (scripts/gpu/session.sh) run in one process. Checked by running pytest on a probe module beside a
copy of conftest.py, in fresh interpreters."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from helpers import run_pythons_at_once

PROBE = """
import json, os
from pathlib import Path

import pytest
import torch


@pytest.fixture
def _short_cache_spans():  # conftest's archlab fixtures, left out: no archlab import to wait for
    pass


@pytest.fixture
def _short_source_steps():
    pass


@pytest.mark.parametrize("index", range(4))
def test_probe(index):
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    record = dict(
        worker=worker,
        workers=os.environ.get("PYTEST_XDIST_WORKER_COUNT"),
        threads=torch.get_num_threads(),
        omp=os.environ.get("OMP_NUM_THREADS"),
    )
    (Path(os.environ["PROBE_OUT"]) / f"{worker}-{index}.json").write_text(json.dumps(record))
"""

# collected first: loaded onto the two workers as they come, its tests would be split between them
GROUPED = """
import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.xdist_group("together")


@pytest.mark.parametrize("index", range(4))
def test_grouped(index):
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    (Path(os.environ["PROBE_OUT"]) / f"grouped-{index}").write_text(worker)
"""


def _records(folder: Path) -> list[dict]:
    return [json.loads(path.read_text()) for path in sorted(folder.glob("*.json"))]


def _grouped_workers(folder: Path) -> set[str]:
    return {path.read_text() for path in folder.glob("grouped-*")}


@pytest.mark.slow  # three pytest runs at once in fresh interpreters, each process importing torch
def test_workers_by_default_one_process_with_n0_or_without_xdist(tmp_path):
    pytest.importorskip("xdist")
    project = tmp_path / "project"
    project.mkdir()
    for name in ("conftest.py", "cuda_paths.py"):  # and the plugin conftest.py loads
        shutil.copy(Path(__file__).with_name(name), project / name)
    (project / "test_probe.py").write_text(PROBE)
    (project / "test_a_group.py").write_text(GROUPED)
    # the run's environment, less this run's own pytest and xdist variables and thread count
    base = {
        key: value for key, value in os.environ.items() if not key.startswith("PYTEST") and key != "OMP_NUM_THREADS"
    }
    runs = []
    for name, flags in {"default": [], "n0": ["-n", "0"], "no_xdist": ["-p", "no:xdist"]}.items():
        out = tmp_path / name
        out.mkdir()
        argv = ["-q", "-p", "no:cacheprovider", *flags, str(project)]
        # xdist's own variable: two workers on any machine, as on CI's 2 cores
        env = {**base, "PROBE_OUT": str(out), "PYTEST_XDIST_AUTO_NUM_WORKERS": "2"}
        runs.append((f"import sys, pytest; sys.exit(pytest.main({argv!r}))", env))
    for run in run_pythons_at_once(runs, cwd=project):
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    share = max(1, cores // 2)
    default = _records(tmp_path / "default")
    assert len(default) == 4 and {r["worker"] for r in default} <= {"gw0", "gw1"}, default
    assert all(r["workers"] == "2" and r["threads"] == share and r["omp"] == str(share) for r in default), default
    assert len(_grouped_workers(tmp_path / "default")) == 1, "the xdist_group's tests ran on two workers"
    for name in ("n0", "no_xdist"):
        records = _records(tmp_path / name)
        assert len(records) == 4 and all(r["worker"] == "main" and r["workers"] is None for r in records), records
        assert _grouped_workers(tmp_path / name) == {"main"}
