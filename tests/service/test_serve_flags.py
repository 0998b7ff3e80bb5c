"""`actord serve` takes exactly the flags it knows: a typo is refused with the closest flag,
never silently ignored; llama-server's names for the same settings are aliases (issue 19.10)."""

from __future__ import annotations

import subprocess
import sys

import msgspec
import pytest

from actord.cli import main
from actord.frontends.config_flags import LLAMA_SERVER_ALIASES, serve_config
from actord.vocabulary.config import Config


@pytest.mark.parametrize("argv, named, suggested", [
    (["--slotz", "4"], "--slotz", "--slots"),
    (["--slot", "4"], "--slot", "--slots"),  # no abbreviations either
    (["--ctx-checkpoint-bytes=5"], "--ctx-checkpoint-bytes", "--ctx-checkpoints-bytes"),
    (["--port", "8080"], "--port", None),
])
def test_an_unknown_serve_flag_exits_non_zero_naming_it_and_the_closest_known_one(argv, named, suggested, capsys):
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert f"unknown flag {named}" in err
    if suggested:
        assert f"did you mean {suggested}?" in err
    with pytest.raises(SystemExit) as e:
        serve_config(argv)
    assert e.value.code == 2


def test_the_real_command_refuses_a_typo_before_loading_anything():
    r = subprocess.run([sys.executable, "-m", "actord.cli", "serve", "--slotz", "4"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "--slotz" in r.stderr and "--slots" in r.stderr and "Traceback" not in r.stderr


def test_llama_server_names_are_aliases_of_the_same_config_fields():
    c = serve_config(["--model", "m.gguf", "--ctx-size", "8192", "-np", "3", "--batch-size", "256",
                      "--lora", "a.gguf", "--gene", "b.gguf", "--alias", "gpt-4o-mini"])
    assert (c.ctx, c.slots, c.batch, c.gene, c.model_alias) == (8192, 3, 256, ["a.gguf", "b.gguf"], ["gpt-4o-mini"])
    fields = {f.name for f in msgspec.structs.fields(Config)}
    assert set(LLAMA_SERVER_ALIASES) <= fields  # every alias names a Config field


def test_a_missing_gene_file_at_start_is_one_clear_error_without_a_traceback(tiny_model, tmp_path):
    r = subprocess.run([sys.executable, "-m", "actord.cli", "serve", "--model", tiny_model, "--ctx", "256",
                        "--slots", "1", "--socket", str(tmp_path / "s.sock"), "--page-dir", str(tmp_path / "p"),
                        "--gene", str(tmp_path / "missing.gguf")], capture_output=True, text=True, timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode == 1
    assert "daemon.refused" in out and "FileNotFound" in out and "missing.gguf" in out
    assert "Traceback" not in out


def test_the_room_left_for_sidecars_is_the_longest_sidecar():
    from actord.storage.pagefile import SUFFIXES
    from actord.vocabulary.names import LONGEST_SIDECAR, MAX_MIND, MAX_PART

    assert LONGEST_SIDECAR == max(len(s) for s in SUFFIXES)
    assert MAX_MIND + len(".page") + LONGEST_SIDECAR == MAX_PART


def test_api_keys_are_the_flags_then_the_files_and_an_unreadable_or_empty_file_is_a_typed_error(tmp_path):
    from actord.vocabulary.errors import InvalidParams

    f = tmp_path / "keys"
    f.write_text("# one a line\nb\n\n  a \n")
    assert Config(model="m", api_key="a, c", api_key_file=str(f)).api_keys() == ["a", "c", "b"]
    with pytest.raises(InvalidParams, match="api_key_file .*absent"):
        Config(model="m", api_key_file=str(tmp_path / "absent")).api_keys()
    (tmp_path / "empty").write_text("# nothing but this\n")
    with pytest.raises(InvalidParams, match="name no key"):
        Config(model="m", api_key_file=str(tmp_path / "empty")).api_keys()
