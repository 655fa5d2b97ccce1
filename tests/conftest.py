"""Shared fixtures. ``ray_session``: one small local Ray cluster for every cluster test of the session."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def ray_session():
    # Imported here, not at the top, so the engine tests can also run where only torch is installed
    # (BUCKETSERVE_TEST_DEVICE=cuda on a GPU machine); a missing Ray still fails every cluster test.
    import ray

    # Small on purpose: the box is shared; workers take fractional CPUs.
    ray.init(num_cpus=4, include_dashboard=False, namespace="bucketserve-tests", log_to_driver=False)
    yield ray
    ray.shutdown()
