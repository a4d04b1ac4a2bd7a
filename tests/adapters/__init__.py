"""Tests of the Redis and PostgreSQL adapters, against real servers."""
