"""Build zeroshard's API reference, HTML pages made by pdoc from the docstrings:

    .venv/bin/python scripts/api_reference.py --out docs/api

Every public module gets a page (any module whose dotted name has no part starting with
``_``), not only the ones a package's ``__all__`` names: ``pdoc zeroshard`` stops there
and would leave out, among others, ``zeroshard.engine.fragments``, whose collective
``get_full_*`` / ``set_full_*`` methods ZeroOptimizer inherits. Docstrings are read as
Google style (``Args:``, ``Raises:``) over reStructuredText (double-backquoted code, roles
such as ``:class:``). Any warning is an error. tests/test_docstrings.py builds it the same
way; docs/api/ is not committed.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "zeroshard"


def public_modules(package: str = PACKAGE) -> list[str]:
    """``package`` and every submodule of it whose dotted name has no part starting with ``_``."""
    root = importlib.import_module(package)
    walked = pkgutil.walk_packages(root.__path__, f"{package}.")
    return [package] + [info.name for info in walked if not any(part.startswith("_") for part in info.name.split("."))]


def build(out: Path, *, search: bool = True) -> list[Path]:
    """Write a page per public module (and ``index.html``; with ``search``, pdoc's search
    index) under ``out``; returns the module pages.

    Raises:
        ImportError: pdoc is not installed (``pip install -e '.[test]'``), or a module does
            not import.
    """
    import pdoc.doc
    import pdoc.render

    names = public_modules()
    for name in names:
        module = importlib.import_module(name)
        for export in getattr(module, "__all__", ()):
            getattr(module, export, None)  # a lazy export (PEP 562) lands in the module's globals, where pdoc looks
    pdoc.render.configure(docformat="google", show_source=False)
    documented = {name: pdoc.doc.Module.from_name(name) for name in names}
    pages = []
    for name, module in documented.items():
        page = out / f"{name.replace('.', '/')}.html"
        page.parent.mkdir(parents=True, exist_ok=True)
        page.write_text(pdoc.render.html_module(module, documented), encoding="utf-8")
        pages.append(page)
    (out / "index.html").write_text(pdoc.render.html_index(documented), encoding="utf-8")
    if search:
        (out / "search.js").write_text(pdoc.render.search_index(documented), encoding="utf-8")
    return pages


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line: ``--out DIR`` (default docs/api)."""
    parser = argparse.ArgumentParser(description="build zeroshard's API reference with pdoc")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "api", help="output folder (default docs/api)")
    return parser.parse_args(argv)


def main() -> int:
    """Build the reference from this checkout's sources; any warning fails the build."""
    args = parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    warnings.simplefilter("error")
    pages = build(args.out)
    print(f"{len(pages)} module pages in {args.out} (open {args.out / 'index.html'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
