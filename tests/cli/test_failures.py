"""``cli.failures.explain``: what the operator gave the command is shown as given, and
everything else in the sentence is still redacted."""

from __future__ import annotations

import argparse

from tesserix_adk import ProviderError
from tesserix_adk.checkpoint.redaction import default_redactor
from tesserix_adk.cli.failures import ExitCode, explain, told_by

RUN = "Acme/Orders/2026/Invoice/Q3Batch/Item007"  # what the redactor takes for an AWS key
KEY = "sk-proj-AbCdEfGhIjKlMnOpQrStUvWxYz0123456789abcd"


def test_the_run_id_is_kept_and_a_key_beside_it_is_masked() -> None:
    assert RUN not in default_redactor().text(f"run {RUN}")  # why ``told`` exists
    exc = ProviderError(f"run {RUN}: the provider refused {KEY}", retryable=False)
    code, said = explain(exc, told=(RUN,))
    assert code == ExitCode.MUST_NOT_CARRY_ON
    assert RUN in said
    assert KEY not in said and "sk-proj-AbCd" not in said


def test_a_key_touching_the_run_id_is_still_masked() -> None:
    # With nothing between them, where the key ends cannot be told: the run id goes with it.
    exc = ProviderError(f"{KEY}{RUN}", retryable=False)
    _, said = explain(exc, told=(RUN,))
    assert "sk-proj-AbCd" not in said and "tesserixtold" not in said


def test_a_told_word_is_no_way_round_the_redactor() -> None:
    """A word the redactor would not mask alone is left in its place while the text is
    redacted, where it is the context that shows the secret beside it."""
    for text, told in [
        ("cannot reach postgresql://acme-prod:hunter2hunter2@db/adk", "acme-prod"),
        ("bad option password=acme-prod-S3cret!x", "acme-prod"),
    ]:
        assert "hunter2" not in default_redactor().text(text)  # masked without told
        _, said = explain(ProviderError(text, retryable=False), told=(told,))
        assert "hunter2hunter2" not in said and "S3cret" not in said, said


def test_without_told_the_sentence_is_redacted_whole() -> None:
    _, said = explain(ProviderError(f"run {RUN}", retryable=False))
    assert RUN not in said


def test_told_by_names_the_run_tenant_and_a_sqlite_store_but_no_other_store_url() -> None:
    sqlite = argparse.Namespace(
        run=RUN, tenant="acme-tenant", store="sqlite:///data/adk.sqlite3?mode=rw"
    )
    told = told_by(sqlite)
    assert {RUN, "acme-tenant", "sqlite:///data/adk.sqlite3", "data/adk.sqlite3"} <= set(told)
    assert not any("mode=rw" in word for word in told)  # a query may hold a secret
    secret_url = "postgresql://user:S3cretPassw0rdS3cretPassw0rd@db/test"
    told = told_by(argparse.Namespace(run=RUN, tenant="t", store=secret_url))
    assert secret_url not in told
    _, said = explain(ProviderError(f"could not reach {secret_url}", retryable=True), told=told)
    assert "S3cretPassw0rd" not in said
