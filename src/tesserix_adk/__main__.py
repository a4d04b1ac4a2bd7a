"""``python -m tesserix_adk``: the ``tesserix`` command."""

from tesserix_adk.cli.main import main

raise SystemExit(main())
