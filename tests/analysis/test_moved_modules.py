"""Modules that moved keep their old import paths for one release, each with a DeprecationWarning naming the new one."""

from __future__ import annotations

import subprocess
import sys

import pytest

MOVED = {
    "ringpack.analysis.layout": ("ringpack.planner.layout", "choose_layout"),
    "ringpack.analysis.comm_model": ("ringpack.comm_model", "CommModel"),
    "ringpack.analysis.calibration": ("ringpack.calibration", "calibrate_kernels"),
    "ringpack.analysis.calibration.run": ("ringpack.calibration.run", "KernelCalibrationConfig"),
    "ringpack.analysis.calibration.step": ("ringpack.calibration.step", "StepCalibrationConfig"),
    "ringpack.planner.wlb": ("ringpack.analysis.peers.wlb", "make_wlb_plan"),
    "ringpack.analysis.dynamic_cp": ("ringpack.analysis.peers.megatron_dcp", "dcp_schedule"),
    "ringpack.analysis.peer_runner": ("ringpack.analysis.peers", "peer_rows"),
}


@pytest.mark.slow
@pytest.mark.parametrize("old", MOVED)
def test_an_old_path_imports_the_new_module_and_says_where_it_went(old):
    new, name = MOVED[old]
    code = (
        "import importlib, warnings\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        f"    value = getattr(importlib.import_module({old!r}), {name!r})\n"
        f"new = getattr(importlib.import_module({new!r}), {name!r})\n"
        "said = [str(w.message) for w in caught if w.category is DeprecationWarning]\n"
        "print(value is new, any(m.endswith('import it from there') and 'moved to' in m for m in said))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["True", "True"], (old, run.stdout, run.stderr)
