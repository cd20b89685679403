"""The old path of :mod:`ringpack.planner.layout`: works, with a ``DeprecationWarning``, for one release.

See docs/planner.md, "Choosing the layout".
"""

import sys
import warnings

from ringpack.planner import layout

warnings.warn(
    "ringpack.analysis.layout moved to ringpack.planner.layout: import it from there", DeprecationWarning, stacklevel=2
)
sys.modules[__name__] = layout
