"""ringpack.analysis
See docs/analysis.md.

The package face loads its one name, :func:`~ringpack.analysis.host_time.compile_milliseconds`
(which needs torch), on first use, so the command line imports it without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ringpack._lazy import lazy_face

_EXPORTS = {"compile_milliseconds": "ringpack.analysis.host_time"}
__all__ = list(_EXPORTS)

if TYPE_CHECKING:
    from ringpack.analysis.host_time import compile_milliseconds  # noqa: F401

__getattr__, __dir__ = lazy_face(__name__, _EXPORTS)
