"""Makes a repository checkout importable as `raylm` without installing it:
`python scripts/raylm_shim.py REPO DIR` creates DIR/raylm/ with one symlink per package
of pyproject's `[tool.setuptools] package-dir` (raylm.engine -> REPO/engine, ...); put DIR
first on PYTHONPATH. `raylm` stays a namespace package, as it is installed."""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path


def make_shim(repo: Path, target: Path) -> Path:
    package_dir = tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    package = target / "raylm"
    package.mkdir(parents=True, exist_ok=True)
    for name, folder in package_dir.items():
        parent, _, child = name.partition(".")
        if parent != "raylm" or "." in child:
            raise ValueError(f"package-dir entry {name!r} is not a top-level raylm subpackage")
        link = package / child
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to((repo / folder).resolve(), target_is_directory=True)
    return package


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: raylm_shim.py REPO DIR")
    make_shim(Path(sys.argv[1]), Path(sys.argv[2]))
