"""The cluster tests: Ray reads these when it is imported, so they are set first."""

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # loopback: a cluster on this machine only
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
