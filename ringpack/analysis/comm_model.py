"""The old path of :mod:`ringpack.comm_model`: works, with a ``DeprecationWarning``, for one release.

See docs/analysis.md, "The communication model".
"""

import sys
import warnings

from ringpack import comm_model

warnings.warn(
    "ringpack.analysis.comm_model moved to ringpack.comm_model: import it from there", DeprecationWarning, stacklevel=2
)
sys.modules[__name__] = comm_model
