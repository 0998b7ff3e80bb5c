"""The cluster tests: Ray reads these settings when it is imported, so they are set first;
and the client every module's tests drive their cluster with."""

import os

import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # loopback: a cluster on this machine only
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


@pytest.fixture(scope="module")
def client(cluster):
    """A ClusterClient on the router of the module's own `cluster` fixture (each module starts
    the cluster its tests need; test_http.py's `client` is an OpenAI client instead)."""
    from actord.cluster.client import ClusterClient  # after the settings above: it imports ray

    return ClusterClient(cluster.router)
