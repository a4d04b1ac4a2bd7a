"""Checkpoints: payload and codec (format, redaction, size cap), policy, planning."""
