"""Calibration: time rank shards on a GPU and fit the cost model the planner loads.

The face: :func:`calibrate_kernels` and :class:`KernelCalibrationConfig` (the kernel scope),
:func:`calibrate_step` and :class:`StepCalibrationConfig` (the step scope), :func:`refit_file`
(a saved calibration fitted again). The parts: :mod:`~ringpack.calibration.config` (both
scopes' configs, importable without torch), :mod:`~ringpack.calibration.cases` (the shards
timed, the held-out plans), :mod:`~ringpack.calibration.timing` (clocks, timed calls),
:mod:`~ringpack.calibration.features` (a shard in the model's terms),
:mod:`~ringpack.calibration.fit` (fits and held-out quality), :mod:`~ringpack.calibration.run`
and :mod:`~ringpack.calibration.step` (each scope end to end). Names load on first use, so
importing the package needs no torch; the only part of ringpack that times a GPU.

See docs/analysis.md, "`ringpack calibrate`".
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ringpack._lazy import lazy_face

_FACE = {
    "KernelCalibrationConfig": "ringpack.calibration.config",
    "calibrate_kernels": "ringpack.calibration.run",
    "refit_file": "ringpack.calibration.run",
    "StepCalibrationConfig": "ringpack.calibration.config",
    "calibrate_step": "ringpack.calibration.step",
}
__all__ = list(_FACE)

if TYPE_CHECKING:
    from ringpack.calibration.config import KernelCalibrationConfig, StepCalibrationConfig  # noqa: F401
    from ringpack.calibration.run import calibrate_kernels, refit_file  # noqa: F401
    from ringpack.calibration.step import calibrate_step  # noqa: F401

__getattr__, __dir__ = lazy_face(__name__, _FACE)
