"""``attn_implementation="ringpack"`` for any process that imported ringpack, without importing transformers.

transformers checks an ``attn_implementation`` against its ``AttentionInterface`` registry, which
lives in ``transformers.modeling_utils``; a model cannot be built before that module has run.
:func:`install` (called by ``import ringpack``) registers ringpack's attention function the moment
that module finishes loading, or at once if it already has. It adds a finder to ``sys.meta_path``
that answers for ``transformers.modeling_utils`` alone, once: it lets the other finders locate the
module and wraps that module's ``exec_module`` to run :func:`ringpack.integrations.transformers.register`
after it. Nothing here imports torch or transformers; where transformers is not installed the
finder is never asked.

See docs/training.md, "Hugging Face transformers".
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from importlib.machinery import ModuleSpec
from typing import Any

__all__ = ["WATCHED", "install"]

#: The module whose loading makes ``AttentionInterface`` usable.
WATCHED = "transformers.modeling_utils"
logger = logging.getLogger(__name__)


def _register() -> None:
    """Register ringpack's attention; a failure is logged, never raised into transformers' import."""
    try:
        from ringpack.integrations.transformers import register

        register()
    except Exception as exc:  # an old transformers without AttentionInterface, a broken install
        logger.debug("attn_implementation='ringpack' not registered: %s", exc)


class _RegisterAfterLoad:
    """A ``sys.meta_path`` finder for :data:`WATCHED` only: the real spec, with registration after its code runs."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> ModuleSpec | None:
        if fullname != WATCHED:
            return None
        _uninstall()  # once, and so the search below does not come back here
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            _register()

        spec.loader.exec_module = exec_module  # this module's loader object only
        return spec


_finder = _RegisterAfterLoad()


def _uninstall() -> None:
    if _finder in sys.meta_path:
        sys.meta_path.remove(_finder)


def install() -> None:
    """Register ringpack's attention now if transformers' models are loaded, else when they load (idempotent)."""
    if WATCHED in sys.modules:
        _register()
    elif _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
