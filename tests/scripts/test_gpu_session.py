"""scripts/gpu/session.sh, the one-command GPU session, on a machine without a GPU: it refuses unknown steps,
always runs setup and info first, keeps going after a failed or timed-out step, skips steps once the call's budget
is spent, and records every verdict in $OUT/steps.tsv. (Installing real wheels and running the suites on a GPU
are what it is for; docs/gpu.md says how it was rehearsed with DEVICE=cpu.)"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SESSION = ROOT / "scripts" / "gpu" / "session.sh"

pytestmark = pytest.mark.skipif(
    shutil.which("bash") is None or shutil.which("timeout") is None, reason="needs bash and coreutils' timeout"
)


def session(tmp_path: Path, *steps: str, **env: str) -> tuple[subprocess.CompletedProcess, list[list[str]]]:
    wheels = tmp_path / "no-wheels"
    wheels.mkdir(exist_ok=True)
    variables = {
        **os.environ,
        "OUT": str(tmp_path / "out"),
        "SITE": str(tmp_path / "site"),
        "WHEEL_DIR": str(wheels),
        "PYTHON": sys.executable,
        **env,
    }
    done = subprocess.run(
        ["bash", str(SESSION), *steps], env=variables, capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    summary = tmp_path / "out" / "steps.tsv"
    verdicts = [line.split("\t") for line in summary.read_text().splitlines()] if summary.exists() else []
    return done, verdicts


def test_unknown_steps_are_refused_with_the_allowed_ones(tmp_path):
    done, verdicts = session(tmp_path, "tests", "benchmark")
    assert done.returncode == 2
    allowed = (
        "setup info headline kernels tests cputests quick train compiled decode static loops tuning catalogue profile"
    )
    assert f"unknown step 'benchmark'; allowed: {allowed}" in done.stderr
    assert verdicts == []


def test_dry_run_lists_setup_and_info_first_then_the_steps_once(tmp_path):
    done, verdicts = session(tmp_path, "--dry-run", "headline", "train", "tests", "train")
    assert done.returncode == 0, done.stdout + done.stderr
    assert [v[:2] for v in verdicts] == [[s, "dry-run"] for s in ("setup", "info", "headline", "train", "tests")]
    assert "cuda-headline" in done.stdout and "cuda-train" in done.stdout and "pytest" in done.stdout


def test_a_failed_step_does_not_stop_the_next_and_the_call_fails(tmp_path):
    """No wheels: setup fails and says what to do; info still runs (and fails here: no GPU)."""
    done, verdicts = session(tmp_path)
    assert done.returncode == 1
    assert [v[:2] for v in verdicts] == [["setup", "failed (exit 1)"], ["info", "failed (exit 1)"]]
    log = (tmp_path / "out" / "session.log").read_text()
    assert "no wheels in" in log and "fetch_wheels.sh" in log
    assert "torch" in log and "no CUDA device visible" in log  # environment.py ran


def test_steps_stop_at_their_limit_and_are_skipped_when_the_budget_is_spent(tmp_path):
    done, verdicts = session(tmp_path, STEP_LIMIT="1")
    assert ["info", "timed out"] == verdicts[1][:2]  # importing torch and transformers takes more than a second
    done, verdicts = session(tmp_path, "tests", SESSION_BUDGET="25")
    assert done.returncode == 1
    assert [v[:2] for v in verdicts] == [[s, "skipped"] for s in ("setup", "info", "tests")]


def test_the_profile_step_profiles_the_workloads_named(tmp_path):
    """PROFILE_WORKLOADS narrows the profile step (a call with little device time left); `echo` stands in for Python
    so that the step's command line is what the log shows."""
    done, verdicts = session(tmp_path, "profile", PYTHON="echo", PROFILE_WORKLOADS="train-moe decode-1")
    assert ["profile", "ok"] == verdicts[-1][:2], done.stdout + done.stderr
    log = (tmp_path / "out" / "session.log").read_text()
    assert "archlab.scripts.profile_cuda --device cuda --output" in log
    assert "profile.md --workload train-moe --workload decode-1" in log


FAKE_PYTHON = """#!/usr/bin/env bash
# a stand-in for Python: pytest's collection lists five GPU tests; a GPU run of tests waits (10 s at most) until
# three have started, so runs one after another would say ALONE
if [[ " $* " == *" --collect-only "* ]]; then
    for i in 1 2 3 4 5; do echo "tests/test_x.py::test_$i"; done
    exit 0
fi
if [[ " $* " == *" -m gpu "* ]]; then
    touch "$BARRIER/$$"
    for _ in $(seq 100); do (($(ls "$BARRIER" | wc -l) >= 3)) && break; sleep 0.1; done
    (($(ls "$BARRIER" | wc -l) >= 3)) || echo ALONE
fi
echo "RUN $*"
"""


def test_the_gpu_tests_run_in_several_processes_at_once(tmp_path):
    """The `tests` step deals the collected GPU tests round-robin to GPU_TEST_WORKERS pytest processes that run
    together, then runs the kernel test files' other tests (they run the kernels on the GPU); the files' fast CPU
    tests are `cputests`, run once; each pytest runs without pytest-xdist's workers; each worker's output ends up in
    session.log."""
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    (tmp_path / "barrier").mkdir()
    done, verdicts = session(
        tmp_path, "tests", "cputests", PYTHON=str(fake), GPU_TEST_WORKERS="3", BARRIER=str(tmp_path / "barrier")
    )
    assert [["tests", "ok"], ["cputests", "ok"]] == [v[:2] for v in verdicts[-2:]], done.stdout + done.stderr
    log = (tmp_path / "out" / "session.log").read_text()
    assert "5 GPU tests in 3 processes" in log and "ALONE" not in log
    runs = [line for line in log.splitlines() if line.startswith("RUN -m pytest -v")]
    dealt = sorted(tuple(int(word[-1]) for word in run.split() if "::test_" in word) for run in runs)
    assert dealt == [(1, 4), (2, 5), (3,)]
    others = [line for line in log.splitlines() if line.startswith("RUN") and "not gpu and not slow" in line]
    assert len(others) == 2 and "test_triton_gemv.py" in others[0] and "test_benchmarking.py" not in others[0], others
    assert "tests/training/test_benchmarking.py" in others[1], others  # cputests: every file that checks for CUDA
    # each pytest in one process: no pytest-xdist workers (tests/conftest.py's default) beside the step's own
    assert all(" -p no:xdist " in line for line in runs + others), runs + others


def test_gpu_test_workers_stopped_at_the_step_limit_leave_their_output(tmp_path):
    """A `tests` step stopped at its limit stops its GPU test processes and still writes what they printed (also
    when timeout's second TERM, to the process group, comes while the logs are printed: a loaded machine lost them)."""
    fake = tmp_path / "python"
    stalled = 'echo "STARTED $*"; [[ " $* " == *" -m gpu "* ]] && sleep 60 && echo NEVER'
    fake.write_text(FAKE_PYTHON.replace('echo "RUN $*"', stalled))
    fake.chmod(0o755)
    (tmp_path / "barrier").mkdir()
    done, verdicts = session(tmp_path, "tests", PYTHON=str(fake), STEP_LIMIT="8", BARRIER=str(tmp_path / "barrier"))
    assert ["tests", "timed out"] == verdicts[-1][:2], done.stdout + done.stderr
    log = (tmp_path / "out" / "session.log").read_text()
    assert sum(line.startswith("STARTED -m pytest -v") for line in log.splitlines()) == 4 and "NEVER" not in log, log[
        -3000:
    ]
    if shutil.which("pgrep"):
        left = subprocess.run(["pgrep", "-f", str(fake)], capture_output=True, text=True)
        assert left.stdout == "", "a GPU test process outlived its step"


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
def test_shell_scripts_pass_shellcheck():
    scripts = sorted(str(p) for p in (ROOT / "scripts" / "gpu").glob("*.sh"))
    done = subprocess.run(["shellcheck", *scripts], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout
