"""A lazy package face loads each name's module when the name is first read, and keeps the value."""

from __future__ import annotations

import sys
import types

import pytest

from ringpack._lazy import lazy_face


def test_a_name_loads_its_module_once_and_unknown_names_are_refused(monkeypatch):
    package = types.ModuleType("lazy_pkg")
    monkeypatch.setitem(sys.modules, "lazy_pkg", package)
    package.__getattr__, package.__dir__ = lazy_face("lazy_pkg", {"dumps": "json", "sqrt": "math"})
    assert package.dumps is sys.modules["json"].dumps
    assert vars(package)["dumps"] is package.dumps  # kept: the next read skips __getattr__
    assert "sqrt" not in vars(package) and {"dumps", "sqrt"} <= set(dir(package))
    with pytest.raises(AttributeError, match="module 'lazy_pkg' has no attribute 'loads'"):
        package.loads  # noqa: B018


def test_the_package_faces_offer_what_they_list():
    import ringpack
    import ringpack.calibration
    import ringpack.cli
    import ringpack.data

    for package in (ringpack, ringpack.calibration, ringpack.cli, ringpack.data):
        assert set(package.__all__) - {"__version__"} <= set(dir(package))
    assert ringpack.data.IGNORE_INDEX == -100 and ringpack.calibration.KernelCalibrationConfig().model
