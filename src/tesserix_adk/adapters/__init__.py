"""Stores on servers many workers share: ``adapters.redis`` and ``adapters.postgres``.

Each module imports its driver (``redis``, ``psycopg``); importing this package imports
neither. Install them with ``pip install "tesserix-adk[redis]"`` or
``pip install "tesserix-adk[postgres]"``, and open a whole set with ``open_stores(url)``.
"""
