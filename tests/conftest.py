"""Shared pytest setup: hypothesis profiles sized for a 2-core CI machine; ``datasets`` stays offline.

Under CI (``CI`` set, as ``.ci/run`` runs) examples are derandomized, so a CI verdict is
reproducible; local runs explore fresh random examples each time (that is how bugs get found).
"""

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=bool(os.environ.get("CI")),
)
settings.load_profile("ci")

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # every dataset a test loads is local
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # and every tokenizer: a Hub name is looked up in the cache only
