"""The old path of :mod:`ringpack.analysis.peers.megatron_dcp`: works, with a ``DeprecationWarning``, for one release.

See docs/analysis.md, "Peers".
"""

import sys
import warnings

from ringpack.analysis.peers import megatron_dcp

warnings.warn(
    "ringpack.analysis.dynamic_cp moved to ringpack.analysis.peers.megatron_dcp: import it from there",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = megatron_dcp
