"""Calibration: time rank shards on a GPU and fit the cost model the planner loads.

The face: :func:`calibrate_kernels` and :class:`KernelCalibrationConfig` (the kernel scope),
:func:`calibrate_step` and :class:`StepCalibrationConfig` (the step scope), :func:`refit_file`
(a saved calibration fitted again). The parts: :mod:`~ringpack.calibration.cases` (the shards
timed, the held-out plans), :mod:`~ringpack.calibration.timing` (clocks, timed calls),
:mod:`~ringpack.calibration.features` (a shard in the model's terms),
:mod:`~ringpack.calibration.fit` (fits and held-out quality), :mod:`~ringpack.calibration.run`
and :mod:`~ringpack.calibration.step` (each scope end to end). Names load on first use, so
importing the package needs no torch; the only part of ringpack that times a GPU.

See docs/analysis.md, "`ringpack calibrate`".
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

_FACE = {
    "KernelCalibrationConfig": "ringpack.calibration.run",
    "calibrate_kernels": "ringpack.calibration.run",
    "refit_file": "ringpack.calibration.run",
    "StepCalibrationConfig": "ringpack.calibration.step",
    "calibrate_step": "ringpack.calibration.step",
}
__all__ = list(_FACE)

if TYPE_CHECKING:
    from ringpack.calibration.run import KernelCalibrationConfig, calibrate_kernels, refit_file  # noqa: F401
    from ringpack.calibration.step import StepCalibrationConfig, calibrate_step  # noqa: F401


def __getattr__(name: str) -> Any:
    module = _FACE.get(name)
    if module is None:
        raise AttributeError(f"module 'ringpack.calibration' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_FACE))
