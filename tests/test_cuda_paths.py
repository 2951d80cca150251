"""cuda_paths.py, the plugin that opens the CUDA-only fast paths to the CPU (`ARCHLAB_TEST_CUDA_PATHS_ON_CPU`): a run
with them closed notes which tests come to one, and the opened run runs those, the users of a wider fixture that
came to one, and every test it knows nothing of. Checked by running pytest in this process on a probe module."""

from __future__ import annotations

import torch

PROBE = """
import os

import pytest
import torch

from archlab.modeling.fused_projections import inference_projections
from archlab.modeling.rotary import apply_rotary


def rotate(gradient):
    query = torch.randn(1, 2, 3, 4, requires_grad=gradient)
    apply_rotary(query, query, torch.ones(1, 3, 4), torch.zeros(1, 3, 4))


@pytest.fixture(scope="module")
def rotated_in_setup():
    rotate(True)


def test_rotates_with_a_gradient():  # the compiled kernel's: autograd records it
    rotate(True)


def test_rotates_a_few_elements_without_one():
    rotate(False)


def test_projections_in_generate():  # the fused projections': parameters on a listed device
    with inference_projections(torch.nn.Linear(2, 2)):
        pass


def test_first_user_of_the_fixture(rotated_in_setup):
    pass


def test_second_user_of_the_fixture(rotated_in_setup):
    pass


def test_fails_in_the_first_run():
    assert not os.environ.get("PROBE_FAIL")
"""

NAMES = (
    "test_rotates_with_a_gradient",
    "test_rotates_a_few_elements_without_one",
    "test_projections_in_generate",
    "test_first_user_of_the_fixture",
    "test_second_user_of_the_fixture",
    "test_fails_in_the_first_run",
)


def _run(pytester, monkeypatch, mode: str, fail: bool = False):
    """The probe's tests through pytest in this process, in `mode`: (the names of those that ran and passed, the
    output)."""
    monkeypatch.setenv("ARCHLAB_TEST_CUDA_PATHS_ON_CPU", mode)
    if fail:
        monkeypatch.setenv("PROBE_FAIL", "1")
    else:
        monkeypatch.delenv("PROBE_FAIL", raising=False)
    result = pytester.runpytest_inprocess("-p", "cuda_paths", "-p", "no:xdist")
    passed = result.reprec.listoutcomes()[0]
    return {report.nodeid.split("::")[-1] for report in passed}, "\n".join(result.outlines)


def test_the_opened_run_runs_the_tests_that_come_to_a_path_and_those_it_knows_nothing_of(pytester, monkeypatch):
    from archlab.modeling import compiled_kernels, fused_projections
    from archlab.modeling.rotary import ROTARY_KERNEL

    monkeypatch.setitem(ROTARY_KERNEL.compiled, "cpu", None)  # opened, the formula all the same: nothing to compile
    before = compiled_kernels.CompiledKernel.applies, fused_projections.fuses_on
    devices = compiled_kernels.FUSED_KERNEL_DEVICES, fused_projections.FUSED_PROJECTION_DEVICES
    pytester.makepyfile(test_probe=PROBE)

    passed, _ = _run(pytester, monkeypatch, "", fail=True)  # closed; one test fails
    assert passed == set(NAMES) - {"test_fails_in_the_first_run"}
    assert (compiled_kernels.CompiledKernel.applies, fused_projections.fuses_on) == before  # put back

    passed, output = _run(pytester, monkeypatch, "1")
    assert passed == set(NAMES) - {"test_rotates_a_few_elements_without_one"}, output
    assert "1 deselected" in output and "5 tests passed" in output and "3 of them came to an opened path" in output
    assert (compiled_kernels.FUSED_KERNEL_DEVICES, fused_projections.FUSED_PROJECTION_DEVICES) == devices

    # a closed run of part of the suite adds to the notes: the test that failed now passed and came to no path
    passed, _ = _run(pytester, monkeypatch, "")
    assert passed == set(NAMES)
    passed, output = _run(pytester, monkeypatch, "1")
    assert passed == set(NAMES) - {"test_rotates_a_few_elements_without_one", "test_fails_in_the_first_run"}, output

    passed, output = _run(pytester, monkeypatch, "all")
    assert passed == set(NAMES) and "deselected" not in output

    pytester.makepyfile(test_probe=PROBE + "\n# other code: nothing noted of it\n")
    passed, output = _run(pytester, monkeypatch, "1")
    assert passed == set(NAMES) and "no closed run of this code is noted" in output


IMPORTED = """
import torch

from archlab.modeling.rotary import apply_rotary

query = torch.randn(1, 2, 3, 4, requires_grad=True)
ROTATED = apply_rotary(query, query, torch.ones(1, 3, 4), torch.zeros(1, 3, 4))  # as the module is imported


def test_reads_what_the_import_computed():
    assert ROTATED[0].shape == (1, 2, 3, 4)
"""

PLAIN = """
def test_plain():
    pass
"""


def test_what_a_module_computes_as_it_is_imported_counts_for_its_tests(pytester, monkeypatch):
    """A test module whose module-level code comes to an opened path: each of its tests reruns opened (the values it
    reads may differ); a module beside it that came to none does not."""
    from archlab.modeling.rotary import ROTARY_KERNEL

    monkeypatch.setitem(ROTARY_KERNEL.compiled, "cpu", None)
    pytester.makepyfile(test_imported=IMPORTED, test_plain=PLAIN)
    passed, _ = _run(pytester, monkeypatch, "")
    assert passed == {"test_reads_what_the_import_computed", "test_plain"}
    passed, output = _run(pytester, monkeypatch, "1")
    assert passed == {"test_reads_what_the_import_computed"}, output


def test_the_opened_run_opens_the_paths_and_puts_them_back(pytester, monkeypatch):
    from archlab.modeling import compiled_kernels, fused_projections, losses

    pytester.makepyfile(
        test_lists="""
        from archlab.modeling import compiled_kernels, fused_projections, losses

        def test_opened():
            lists = compiled_kernels.FUSED_KERNEL_DEVICES, losses.FUSED_GRADIENT_DEVICES
            assert all("cpu" in devices for devices in (*lists, fused_projections.FUSED_PROJECTION_DEVICES))
        """
    )
    before = (
        compiled_kernels.FUSED_KERNEL_DEVICES,
        losses.FUSED_GRADIENT_DEVICES,
        fused_projections.FUSED_PROJECTION_DEVICES,
    )
    for mode in ("1", "all"):
        monkeypatch.setenv("ARCHLAB_TEST_CUDA_PATHS_ON_CPU", mode)
        pytester.runpytest_inprocess("-p", "cuda_paths", "-p", "no:xdist").assert_outcomes(passed=1)
        after = (
            compiled_kernels.FUSED_KERNEL_DEVICES,
            losses.FUSED_GRADIENT_DEVICES,
            fused_projections.FUSED_PROJECTION_DEVICES,
        )
        assert after == before


def test_a_workers_notes_reach_the_controlling_process(pytestconfig):
    """pytest-xdist sends each report from a worker to the controlling process through pytest's serialization hooks:
    the note the plugin puts on a report goes with it."""
    from _pytest.reports import TestReport
    from cuda_paths import REACHED

    report = TestReport("test_probe.py::test_a", ("test_probe.py", 1, "test_a"), {}, "passed", None, "call")
    report.user_properties.append((REACHED, True))
    data = pytestconfig.hook.pytest_report_to_serializable(config=pytestconfig, report=report)
    back = pytestconfig.hook.pytest_report_from_serializable(config=pytestconfig, data=data)
    assert (REACHED, True) in back.user_properties and back.nodeid == report.nodeid


def test_the_recorder_notes_what_an_opened_path_would_have_run():
    """`CompiledKernel.applies` with the CPU listed: calls that record a gradient, or large ones; not a small call
    without one, nor one that dynamo traces."""
    from archlab.modeling.rotary import ROTARY_KERNEL

    opened = ("cuda", "cpu")
    small = torch.randn(1, 2, 3, 4)
    assert not ROTARY_KERNEL.applies((small,), opened) and not ROTARY_KERNEL.applies((small,), ("cuda",))
    assert ROTARY_KERNEL.applies((small.requires_grad_(),), opened)
    with torch.no_grad():
        assert not ROTARY_KERNEL.applies((small,), opened)
