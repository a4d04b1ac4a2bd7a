"""The web console (``tesserix ui``): an ASGI app over a store, for the on-call engineer.

Importing ``tesserix_adk`` never imports this package (Starlette is the ``[ui]`` extra).
"""

from __future__ import annotations

from tesserix_adk.console.app import create_app

__all__ = ["create_app"]
