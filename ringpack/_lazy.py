"""A package face whose names load on first use (:func:`lazy_face`).

A package lists its names as ``name -> module``; each module is imported when its name is first
read, so importing the package costs none of its parts' imports (torch, ortools, datasets).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from importlib import import_module
from typing import Any

__all__ = ["lazy_face"]


def lazy_face(module_name: str, exports: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module-level ``__getattr__`` and ``__dir__`` of a package whose names load on first use.

    Args:
        module_name: the package's ``__name__``.
        exports: each name the package offers -> the module it is defined in.

    Returns:
        ``(__getattr__, __dir__)``: ``__getattr__(name)`` imports the module of ``name``, keeps the
        value in the package's namespace (so later reads skip it) and returns it; ``__dir__()`` is
        the package's names and ``exports``, sorted.

    Raises:
        AttributeError: from ``__getattr__``, for a name not in ``exports``.
    """

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        value = getattr(import_module(module), name)
        setattr(sys.modules[module_name], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[module_name])) | set(exports))

    return __getattr__, __dir__
