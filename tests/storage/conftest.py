"""The storage tests' shared fixture: the structlog events a test caused."""

from __future__ import annotations

import logging

import pytest
import structlog


@pytest.fixture
def logs():
    """Every structlog event, whatever level the suite's logging is configured at."""
    cap = structlog.testing.LogCapture()
    old = structlog.get_config()
    structlog.configure(processors=[cap], wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG))
    try:
        yield cap.entries
    finally:
        structlog.configure(**old)
