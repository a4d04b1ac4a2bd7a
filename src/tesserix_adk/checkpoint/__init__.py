"""Checkpoints: payload and codec (format, checksum, nesting limit, redaction, size cap),
policy, planning."""
