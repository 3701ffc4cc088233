"""Lazy re-exports for a package's ``__init__``: a name is imported from its module on first use.

    __getattr__, __dir__ = lazy_exports(__name__, {"EpisodeRecorder": "rlrec.producer.recorder"})

Keeps ``from rlrec import EpisodeRecorder`` free of Ray and torch: only the module that defines
the name is imported. Imports nothing of rlrec (any layer may use it).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(package: str, exports: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module-level ``__getattr__`` and ``__dir__`` of `package` for `exports` (name -> module)."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)  # later lookups skip __getattr__
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__
