"""docs/engine_args.md and docs/server_flags.md are what the settings' one definition
generates (as tests/test_readme.py does for the README's sample), and every `raylm serve`
flag is on one of them."""

from __future__ import annotations

import re

from raylm.deploy import settings_docs
from raylm.deploy.cli import build_parser


def test_the_settings_pages_are_current():
    stale = settings_docs.stale_pages()
    assert not stale, f"{stale} differ from their settings: `python -m raylm.deploy.settings_docs` rewrites them."


def test_a_changed_help_text_makes_its_page_stale(tmp_path, monkeypatch):
    settings_docs.write_pages(tmp_path)
    assert settings_docs.stale_pages(tmp_path) == []
    page = tmp_path / "server_flags.md"
    page.write_text(page.read_text().replace("Port to listen on.", "Port to listen on (old text)."))
    assert settings_docs.stale_pages(tmp_path) == ["server_flags.md"]


def test_every_serve_flag_is_documented():
    serve = build_parser(["serve"])._subparsers._group_actions[0].choices["serve"]
    documented = (settings_docs.DOCS / "server_flags.md").read_text() + (settings_docs.DOCS / "engine_args.md").read_text()
    flags = [option for action in serve._actions for option in action.option_strings
             if option.startswith("--") and not option.startswith("--no-") and option not in ("--help", "--ray-serve")]
    assert flags and [flag for flag in flags if not re.search(rf"`{re.escape(flag)}`", documented)] == []
