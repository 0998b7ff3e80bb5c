"""`actord serve --config FILE` (TOML, the flags' fields, flags override) and `actord config
show` (issue 27.4): a key or value the file should not have is refused by name, exit 2."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib

import msgspec
import pytest

from actord.cli import main
from actord.frontends.config_file import read_config_file, render
from actord.frontends.config_flags import serve_config
from actord.vocabulary.config import Config
from actord.vocabulary.errors import InvalidParams


@pytest.fixture
def toml(tmp_path):
    def write(text: str) -> str:
        p = tmp_path / "actord.toml"
        p.write_text(text)
        return str(p)
    return write


def test_the_file_alone_sets_the_fields_it_names(toml):
    path = toml('model = "m.gguf"\nslots = 3\nctx_checkpoints_bytes = 1048576\nswa_full_share = 1\n'
                'gene = ["a.gguf", "b.gguf"]\nhttp = "127.0.0.1:0"\nflash_attn = "off"\n')
    c = serve_config(["--config", path])
    assert (c.model, c.slots, c.ctx_checkpoints_bytes, c.gene, c.http, c.flash_attn) == (
        "m.gguf", 3, 1 << 20, ["a.gguf", "b.gguf"], "127.0.0.1:0", "off")
    assert c.swa_full_share == 1.0 and isinstance(c.swa_full_share, float)  # an int is a number
    assert c.ctx == Config(model="x").ctx  # what the file leaves out keeps its default


def test_a_flag_overrides_the_file(toml):
    path = toml('model = "m.gguf"\nslots = 3\nctx = 2048\ngene = ["a.gguf"]\n')
    c = serve_config(["--config", path, "--slots", "5", "-m", "other.gguf", "--gene", "z.gguf"])
    assert (c.model, c.slots, c.ctx, c.gene) == ("other.gguf", 5, 2048, ["z.gguf"])


@pytest.mark.parametrize("text, named", [
    ("slotz = 3\n", "unknown key 'slotz' (did you mean slots?)"),
    ("ctx-size = 3\n", "unknown key 'ctx-size'"),
    ("[http]\nport = 8080\n", "http must be a string"),
    ('slots = "3"\n', "slots must be an integer, not str '3'"),
    ("http_max_connections = true\n", "http_max_connections must be an integer, not bool"),
    ("gene = \"a.gguf\"\n", "gene must be a list of strings"),
    ("slots = 3\nslots = 4\n", "not valid TOML"),
])
def test_a_key_or_value_the_file_should_not_have_exits_2_naming_it(toml, text, named, capsys):
    path = toml('model = "m.gguf"\n' + text)
    with pytest.raises(InvalidParams) as e:
        read_config_file(path)
    assert named in e.value.message
    assert main(["serve", "--config", path]) == 2
    assert named in capsys.readouterr().err
    assert main(["config", "show", "--config", path]) == 2
    assert named in capsys.readouterr().err


def test_settings_that_do_not_go_together_are_refused_after_the_flags_are_in(toml, capsys):
    path = toml('model = "m.gguf"\nslots = 0\n')
    assert main(["config", "show", "--config", path]) == 2
    assert "slots must be >= 1" in capsys.readouterr().err
    assert main(["config", "show", "--config", path, "--slots", "2"]) == 0  # the flag mends it


def test_config_show_prints_the_effective_configuration_as_toml_that_reads_back(toml, capsys):
    path = toml('model = "m.gguf"\nslots = 3\nallow_uid = [1000]\n')
    assert main(["config", "show", "--config", path, "--ctx", "2048"]) == 0
    shown = capsys.readouterr().out
    doc = tomllib.loads(shown)
    assert (doc["model"], doc["slots"], doc["ctx"], doc["allow_uid"]) == ("m.gguf", 3, 2048, [1000])
    assert "# http = (unset)" in shown  # None has no TOML spelling
    # What it shows is what `serve` would run with: fed back, the same Config.
    again = toml(shown)
    assert serve_config(["--config", again]) == serve_config(["--config", path, "--ctx", "2048"])
    assert render(serve_config(["--config", again])) == shown.rstrip("\n")


def test_config_show_as_json(toml, capsys):
    path = toml('model = "m.gguf"\nslots = 3\n')
    assert main(["config", "show", "--config", path, "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert msgspec.convert(doc, Config) == serve_config(["--config", path])


def test_the_real_command_refuses_a_bad_file_before_loading_anything(toml):
    path = toml('model = "m.gguf"\nslotz = 4\n')
    r = subprocess.run([sys.executable, "-m", "actord.cli", "serve", "--config", path],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "slotz" in r.stderr and "Traceback" not in r.stderr
    missing = path + ".missing"
    r = subprocess.run([sys.executable, "-m", "actord.cli", "serve", "--config", missing],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "cannot read the config file" in r.stderr and "Traceback" not in r.stderr
