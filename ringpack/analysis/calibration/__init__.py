"""The old path of :mod:`ringpack.calibration` and its modules: works, with a ``DeprecationWarning``, for one release.

See docs/analysis.md, "`ringpack calibrate`".
"""

import sys
import warnings

from ringpack import calibration
from ringpack.calibration import cases, features, fit, run, step, timing

warnings.warn(
    "ringpack.analysis.calibration moved to ringpack.calibration: import it from there",
    DeprecationWarning,
    stacklevel=2,
)
for _module in (cases, features, fit, run, step, timing):
    sys.modules[f"{__name__}.{_module.__name__.rsplit('.', 1)[1]}"] = _module
sys.modules[__name__] = calibration
