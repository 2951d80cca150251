"""The CUDA-only fast paths opened to the CPU (`ARCHLAB_TEST_CUDA_PATHS_ON_CPU=1`, CI's pass after the suite), and
which tests that pass runs. A pytest plugin, loaded by conftest.py.

The paths: the compiled element-wise kernels (RoPE, gated activations), the LM loss's compiled gradient, and q/k/v and
gate/up read as one product in `generate`. On the CPU they are closed, so the suite tests the formulas; opened, every
test that goes through one checks it against its reference, as a GPU runs it.

Most tests never go through one: the kernels run under autograd or on ≥ 2^24 elements, the loss's gradient with
labels and gradients, the fused projections in `generate`. So every run with the paths closed notes, for each test,
whether it came to a point where an opened path would have run instead (`CompiledKernel.applies` and
`fused_projections.fuses_on` with the CPU listed), and keeps the notes in pytest's cache, under a hash of the code
(every Python file of the project, pyproject.toml, the versions of torch, transformers and triton). Up to that
point a test runs the same code opened or closed; a test that never came to one runs exactly the same code.

The opened pass then runs, of the tests it collects:
- each test noted as coming to an opened path, and each test using a fixture of wider scope (module, class,
  session) that came to one while it was set up (its value may differ opened);
- each test that no closed run of the same code has seen pass (a new test, one that failed, other code: unknown).
It leaves out the rest, and says how many in its header. `ARCHLAB_TEST_CUDA_PATHS_ON_CPU=all` runs every test."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

CACHE_KEY = "archlab/cuda-paths-on-cpu"
REACHED, FIXTURE = "archlab_cuda_path", "archlab_cuda_path_fixture"  # the user properties a worker's reports carry
_SKIPPED_FOLDERS = {"build", "dist", "node_modules", "__pycache__", "venv"}


def mode() -> str:
    """`ARCHLAB_TEST_CUDA_PATHS_ON_CPU`: "1" opens the paths for the tests that go through one, "all" for every test;
    anything else leaves them closed."""
    return os.environ.get("ARCHLAB_TEST_CUDA_PATHS_ON_CPU", "")


class _Opened:
    """In a run with the paths opened: each module's device list with the CPU in it, put back as it was at the end."""

    LISTS = (
        ("compiled_kernels", "FUSED_KERNEL_DEVICES"),
        ("losses", "FUSED_GRADIENT_DEVICES"),
        ("fused_projections", "FUSED_PROJECTION_DEVICES"),
    )

    def __init__(self) -> None:
        import importlib

        self.modules = [importlib.import_module(f"archlab.modeling.{name}") for name, _ in self.LISTS]
        self.before = [getattr(module, name) for module, (_, name) in zip(self.modules, self.LISTS)]
        for module, (_, name) in zip(self.modules, self.LISTS):
            setattr(module, name, ("cuda", "cpu"))

    def pytest_unconfigure(self) -> None:
        for module, (_, name), before in zip(self.modules, self.LISTS, self.before):
            setattr(module, name, before)


def code_hash(root: Path) -> str:
    """A hash of the code the suite runs: every Python file under `root` (hidden and build folders left out),
    pyproject.toml, and the versions of the libraries the paths compile with."""
    from importlib.metadata import PackageNotFoundError, version

    digest = hashlib.sha256()
    files = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [name for name in subfolders if not name.startswith(".") and name not in _SKIPPED_FOLDERS]
        files.extend(Path(folder, name) for name in names if name.endswith(".py") or name == "pyproject.toml")
    for path in sorted(files):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    for library in ("torch", "transformers", "triton"):
        try:
            digest.update(f"{library} {version(library)}\0".encode())
        except PackageNotFoundError:
            pass
    return digest.hexdigest()


class _Recorder:
    """In a run with the paths closed: notes, on the running test's reports, that it came to an opened path — or, when
    a fixture of wider scope was being set up, that fixture's name."""

    def __init__(self) -> None:
        self.item: pytest.Item | None = None
        self.fixtures: list = []  # the fixture definitions being set up, outermost first
        self.module: pytest.Module | None = None  # the test module being imported
        self.modules_that_came: set[str] = set()  # test modules that came to a path as they were imported
        self.came_elsewhere = False  # a path came to before collection (conftest.py), outside any module or test

    def note(self) -> None:
        if self.item is None:
            if self.module is not None:
                self.modules_that_came.add(self.module.nodeid)
            else:
                self.came_elsewhere = True
            return
        wider = {d.argname for d in self.fixtures if d.scope != "function"}
        properties = self.item.user_properties
        for entry in [(REACHED, True), *((FIXTURE, name) for name in sorted(wider))]:
            if entry not in properties:
                properties.append(entry)

    def install(self) -> None:
        """Wraps the two decisions: each answers as before, and notes where the CPU listed would answer yes."""
        from archlab.modeling import compiled_kernels, fused_projections

        opened = ("cuda", "cpu")
        applies, fuses_on = compiled_kernels.CompiledKernel.applies, fused_projections.fuses_on
        self.originals = applies, fuses_on
        recorder = self

        def noting_applies(kernel, args, devices):
            if applies(kernel, args, opened):
                recorder.note()
            return applies(kernel, args, devices)

        def noting_fuses_on(model, devices=None):
            if fuses_on(model, opened):
                recorder.note()
            return fuses_on(model, devices)

        compiled_kernels.CompiledKernel.applies = noting_applies
        fused_projections.fuses_on = noting_fuses_on

    def pytest_unconfigure(self) -> None:
        from archlab.modeling import compiled_kernels, fused_projections

        compiled_kernels.CompiledKernel.applies, fused_projections.fuses_on = self.originals

    @pytest.hookimpl(hookwrapper=True)
    def pytest_make_collect_report(self, collector):
        """A test module is imported as it is collected: what its module-level code comes to is noted for it."""
        if isinstance(collector, pytest.Module):
            self.module = collector
        try:
            yield
        finally:
            self.module = None

    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        """Each test of a module that came to a path as it was imported (every test, where code before collection
        did) is noted as coming to one itself: the values that code computed may differ opened."""
        for item in items:
            module = item.getparent(pytest.Module)
            if self.came_elsewhere or (module is not None and module.nodeid in self.modules_that_came):
                item.user_properties.append((REACHED, True))

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item):
        self.item = item
        yield
        self.item = None

    @pytest.hookimpl(hookwrapper=True)
    def pytest_fixture_setup(self, fixturedef):
        self.fixtures.append(fixturedef)
        try:
            yield
        finally:
            self.fixtures.pop()


class _Notes:
    """The controlling process of a closed run (the only one of a run without workers): gathers the tests' reports and
    keeps what they say in the cache, added to an earlier run's notes of the same code."""

    def __init__(self, config: pytest.Config, tree: str) -> None:
        self.config, self.tree = config, tree
        self.ran: set[str] = set()
        self.failed: set[str] = set()
        self.reached: set[str] = set()
        self.fixtures: set[str] = set()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.ran.add(report.nodeid)
        if report.failed:
            self.failed.add(report.nodeid)
        for name, value in report.user_properties:
            if name == REACHED:
                self.reached.add(report.nodeid)
            elif name == FIXTURE:
                self.fixtures.add(value)

    def pytest_sessionfinish(self) -> None:
        earlier = self.config.cache.get(CACHE_KEY, None)
        notes = {"tree": self.tree, "passed": [], "reached": [], "fixtures": []}
        if isinstance(earlier, dict) and earlier.get("tree") == self.tree:
            notes.update(earlier)
        passed = (set(notes["passed"]) - self.ran) | (self.ran - self.failed)
        reached = (set(notes["reached"]) - self.ran) | self.reached
        notes.update(
            passed=sorted(passed), reached=sorted(reached), fixtures=sorted(set(notes["fixtures"]) | self.fixtures)
        )
        self.config.cache.set(CACHE_KEY, notes)


def _notes_of_this_code(config: pytest.Config) -> tuple[dict | None, str]:
    notes = config.cache.get(CACHE_KEY, None)
    if not isinstance(notes, dict) or notes.get("tree") != code_hash(config.rootpath):
        return None, "no closed run of this code is noted: every test runs"
    reached = len(notes["reached"])
    return notes, (
        f"{len(notes['passed'])} tests passed with the paths closed on this code, {reached} of them came to an opened "
        f"path, and {len(notes['fixtures'])} fixtures of wider scope as they were set up: the others are left out "
        "(ARCHLAB_TEST_CUDA_PATHS_ON_CPU=all runs them)"
    )


def pytest_configure(config: pytest.Config) -> None:
    if mode() in ("1", "all"):
        config.pluginmanager.register(_Opened(), "archlab-cuda-paths-opened")
        return
    if not hasattr(config, "cache"):  # `-p no:cacheprovider`: nothing is noted
        return
    recorder = _Recorder()
    recorder.install()
    config.pluginmanager.register(recorder, "archlab-cuda-paths-recorder")
    if not hasattr(config, "workerinput"):
        config.pluginmanager.register(_Notes(config, code_hash(config.rootpath)), "archlab-cuda-paths-notes")


def pytest_report_header(config: pytest.Config) -> str | None:
    if mode() != "1" or not hasattr(config, "cache"):
        return "CUDA paths opened to the CPU: every test runs" if mode() == "all" else None
    return f"CUDA paths opened to the CPU: {_notes_of_this_code(config)[1]}"


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if mode() != "1" or not hasattr(config, "cache"):
        return
    notes, _ = _notes_of_this_code(config)
    if notes is None:
        return
    passed, reached, fixtures = set(notes["passed"]), set(notes["reached"]), set(notes["fixtures"])
    kept, left_out = [], []
    for item in items:
        unknown = item.nodeid not in passed
        runs = unknown or item.nodeid in reached or fixtures.intersection(getattr(item, "fixturenames", ()))
        (kept if runs else left_out).append(item)
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = kept
