"""Store protocols and the stores that ship with the kit.

``open_stores(url)`` builds a backend's whole set as a ``Stores`` bundle. This package
imports nothing on its own: names are loaded on first use, so no driver is imported and
``stores.protocols`` can be imported by the modules ``Stores`` itself depends on.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tesserix_adk.stores.bundle import Stores
    from tesserix_adk.stores.urls import open_stores, redact_url

__all__ = ["Stores", "open_stores", "redact_url"]

_NAMES = {
    "Stores": "bundle",
    "open_stores": "urls",
    "redact_url": "urls",
}


def __getattr__(name: str) -> Any:
    module = _NAMES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def __dir__() -> list[str]:
    return sorted(__all__)
