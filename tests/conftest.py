"""Shared pytest setup: hypothesis profiles sized for a 2-core CI machine; ``datasets`` stays offline;
the length cache lives in a temporary folder.

Under CI (``CI`` set, as ``.ci/run`` runs) examples are derandomized, so a CI verdict is
reproducible; local runs explore fresh random examples each time (that is how bugs get found).
"""

import os

import pytest
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


@pytest.fixture(autouse=True, scope="session")
def _length_cache_in_a_temporary_folder(tmp_path_factory):
    """The length cache of every test (and of the processes tests start) lives under pytest's temporary
    folder, never in the home folder's cache."""
    saved = os.environ.get("RINGPACK_CACHE")
    os.environ["RINGPACK_CACHE"] = str(tmp_path_factory.mktemp("ringpack-cache"))
    yield
    if saved is None:
        os.environ.pop("RINGPACK_CACHE", None)
    else:
        os.environ["RINGPACK_CACHE"] = saved
