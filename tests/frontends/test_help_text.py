"""Help a user can read: `actord serve --help` says, for every flag, why it exists, its
default and its unit (from Config's own comments, as the generated reference does);
`actord --help` says what the program does, with three examples; `python -m actord` is the
program."""

from __future__ import annotations

import re
import subprocess
import sys

import msgspec

from actord.cli import build_parser
from actord.frontends.config_flags import flag_help
from actord.frontends.config_help import field_comments
from actord.vocabulary.config import Config


def _help(*argv: str) -> str:
    p = subprocess.run([sys.executable, "-m", "actord", *argv, "--help"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return p.stdout


def test_every_serve_flag_says_why_its_default_and_its_unit():
    why, _ = field_comments()
    _, serve = build_parser()
    helps = {a.dest: a.help for a in serve._actions}
    for f in msgspec.structs.fields(Config):
        assert helps[f.name] == flag_help(f)
        assert re.search(r"\[default: .+; .+\]$", helps[f.name]), f.name
        if why.get(f.name):
            assert helps[f.name].startswith(why[f.name].replace("%", "%%")[:40]), f.name


def test_serve_help_prints_a_flags_description_default_and_unit():
    text = " ".join(_help("serve").split())
    assert "--page-ram-bytes PAGE_RAM_BYTES" in text
    assert re.search(r"--http-default-max-tokens HTTP_DEFAULT_MAX_TOKENS A chat completion naming no max_tokens "
                     r"generates at most this many .*\[default: 2048; tokens\]", text)
    assert "[default: 5.0; seconds]" in text  # http_idle_timeout_s, in its unit


def test_actord_help_says_what_the_program_does_with_three_examples():
    text = _help()
    assert "minds" in text and "_SUGAR" not in text and "config_flags.py" not in text
    examples = text.split("examples:\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert len(examples) == 3 and all(line.strip().startswith("actord ") for line in examples)


def test_python_dash_m_actord_runs_the_cli():
    p = subprocess.run([sys.executable, "-m", "actord", "no-such-verb"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "invalid choice: 'no-such-verb'" in p.stderr
