"""`--swa-full auto|on|off` (actord.policy.swa): a full SWA cache when it fits, else checkpoints."""

from __future__ import annotations

import pytest

from actord.frontends.config_flags import add_config_flags, config_from_args
from actord.vocabulary.config import Config
from actord.vocabulary.errors import InvalidParams
from actord.policy.swa import choose_swa_full

MB = 2**20


def choose(mode="auto", **kw):
    base = dict(n_swa=512, bytes_per_token=18_432, n_ctx=8192, device_bytes=0, host_bytes=16 << 30)
    base.update(kw)
    return choose_swa_full(mode, **base)


def test_auto_takes_the_full_cache_when_it_fits_a_quarter_of_the_device_budget():
    c = choose(device_bytes=1 << 30)  # 144 MiB needed, 256 MiB allowed
    assert c.full and c.need_bytes == 18_432 * 8192 and c.limit_bytes == 256 * MB
    assert "fits" in c.reason and "--device-bytes" in c.reason and "18,432 B/token" in c.reason


def test_auto_falls_back_to_checkpoints_when_it_does_not_fit():
    c = choose(device_bytes=256 * MB)  # 144 MiB needed, 64 MiB allowed
    assert not c.full and "does not fit" in c.reason and "checkpoints" in c.reason


def test_without_a_device_budget_the_host_memory_stands_in():
    assert choose(host_bytes=1 << 30).full and "host memory" in choose(host_bytes=1 << 30).reason
    assert not choose(host_bytes=256 * MB).full


def test_on_and_off_decide_outright_and_a_model_without_a_window_needs_nothing():
    assert choose("on", device_bytes=1).full and not choose("off", device_bytes=1 << 40).full
    assert not choose("on", n_swa=0).full and "no sliding window" in choose("on", n_swa=0).reason
    with pytest.raises(ValueError):
        choose("maybe")


def test_the_flag_is_a_mode_and_a_bare_flag_means_on():
    import argparse

    p = argparse.ArgumentParser()
    add_config_flags(p)
    assert config_from_args(p.parse_args(["--model", "m", "--swa-full"])).swa_full == "on"
    assert config_from_args(p.parse_args(["--model", "m", "--swa-full", "off"])).swa_full == "off"
    assert config_from_args(p.parse_args(["--model", "m"])).swa_full == "auto"
    with pytest.raises(InvalidParams):
        Config(model="m", swa_full="sometimes").validate()
    with pytest.raises(InvalidParams):
        Config(model="m", swa_full_share=1.5).validate()
