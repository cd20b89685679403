"""The old path of :mod:`ringpack.analysis.peers`: works, with a ``DeprecationWarning``, for one release.

See docs/analysis.md, "Peers".
"""

import sys
import warnings

from ringpack.analysis import peers

warnings.warn(
    "ringpack.analysis.peer_runner moved to ringpack.analysis.peers: import it from there",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = peers
