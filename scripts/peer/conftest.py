# actord's stand-in for llama.cpp's server-test conftest: each test's servers stop after it.
import pytest
from utils import *  # noqa: F401,F403
import utils


@pytest.fixture(autouse=True)
def _stop_servers_after_each_test():
    yield
    for s in list(utils.server_instances):
        s.stop()
