"""The old path of :mod:`ringpack.analysis.peers.wlb`: works, with a ``DeprecationWarning``, for one release.

See docs/analysis.md, "Peers".
"""

import sys
import warnings

from ringpack.analysis.peers import wlb

warnings.warn(
    "ringpack.planner.wlb moved to ringpack.analysis.peers.wlb: import it from there", DeprecationWarning, stacklevel=2
)
sys.modules[__name__] = wlb
