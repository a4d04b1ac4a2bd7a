"""Store protocols and the stores that ship with the kit.

``open_stores(url)`` builds a backend's whole set as a ``Stores`` bundle. Importing this
package imports no driver: each backend's module is loaded by ``open_stores`` for the
scheme that needs it. Nothing here imports ``tesserix_adk.checkpoint`` (the checkpointer is
built over stores, not the other way round), so the names are imported plainly.
"""

from __future__ import annotations

from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.urls import open_stores, redact_url

__all__ = ["Stores", "open_stores", "redact_url"]
