"""Writes the documentation pages generated from the code (run from the repository root):

    python scripts/generate_docs.py          # rewrite them
    python scripts/generate_docs.py --check  # exit 1 if one is stale

docs/environment_variables.md comes from engine/envs.py.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from raylm.engine import envs

DOCS_DIR = Path(__file__).resolve().parent.parent / "docs"
# Page -> the function that writes its text.
PAGES: dict[str, Callable[[], str]] = {"environment_variables.md": envs.markdown}


def stale_pages() -> list[str]:
    """The pages whose file differs from what the code generates now."""
    return [name for name, generate in PAGES.items()
            if not (DOCS_DIR / name).exists() or (DOCS_DIR / name).read_text() != generate()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="Only report stale pages (exit status 1).")
    args = parser.parse_args(argv)
    stale = stale_pages()
    if args.check:
        for name in stale:
            print(f"docs/{name} is stale: run python scripts/generate_docs.py", file=sys.stderr)
        return 1 if stale else 0
    for name in stale:
        (DOCS_DIR / name).write_text(PAGES[name]())
        print(f"wrote docs/{name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
