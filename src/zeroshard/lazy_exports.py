"""Package exports imported on first use (PEP 562).

Reading and converting checkpoints needs no torch, so a package whose exports include
torch-using modules imports each only when its name is first looked up."""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable, Mapping


def lazy_exports(package: str, exports: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package``, whose ``exports`` map each public
    name to the relative module defining it. A name, once imported, is cached in the
    package's globals, so later lookups do not come back here."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        vars(sys.modules[package])[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__
