"""Prices and cost in micros; the providers' shared helpers; importing without the SDKs."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from tesserix_adk import ConfigurationError, Usage
from tesserix_adk.providers._common import (
    MALFORMED_ARGUMENTS,
    arguments_from_text,
    arguments_to_text,
    is_transient_status,
    scrub,
    strip_vendor,
)
from tesserix_adk.providers.pricing import Price, cost_micros, price_for

GPT = Price(input_per_million_micros=2_500_000, output_per_million_micros=10_000_000)
MINI = Price(input_per_million_micros=150_000, output_per_million_micros=600_000)


def test_cost_is_tokens_times_price_per_million() -> None:
    assert cost_micros(Usage(input_tokens=1_000_000, output_tokens=0), GPT) == 2_500_000
    assert cost_micros(Usage(input_tokens=120, output_tokens=30), GPT) == 600


def test_cost_rounds_up_once_over_the_sum() -> None:
    # 1 * 0.15 + 1 * 0.6 = 0.75 micros: a call is never free once it has a price.
    assert cost_micros(Usage(input_tokens=1, output_tokens=1), MINI) == 1
    assert cost_micros(Usage(input_tokens=3, output_tokens=1), MINI) == 2  # 0.45 + 0.6 = 1.05
    assert cost_micros(Usage(), MINI) == 0


def test_no_price_costs_nothing() -> None:
    assert cost_micros(Usage(input_tokens=10**9, output_tokens=10**9), None) == 0


def test_price_is_looked_up_by_configured_then_reported_model() -> None:
    table = {"gpt-4o": GPT, "gpt-4o-mini-2024-07-18": MINI}
    assert price_for(table, "gpt-4o", "gpt-4o-2024-08-06") is GPT
    assert price_for(table, "my-alias", "gpt-4o-mini-2024-07-18") is MINI
    assert price_for(table, "other", None) is None
    assert price_for(GPT, "anything") is GPT  # one price fits every model
    assert price_for(None, "gpt-4o") is None


def test_negative_price_is_refused() -> None:
    with pytest.raises(ConfigurationError):
        Price(input_per_million_micros=-1, output_per_million_micros=0)


def test_vendor_prefix_is_stripped_but_local_model_colons_stay() -> None:
    assert strip_vendor("openai:gpt-4o", "openai") == "gpt-4o"
    assert strip_vendor("gpt-4o", "openai") == "gpt-4o"
    assert strip_vendor("llama3.1:8b", "openai") == "llama3.1:8b"
    assert strip_vendor("openai:qwen2.5:7b", "openai") == "qwen2.5:7b"
    with pytest.raises(ConfigurationError):
        strip_vendor("anthropic:", "anthropic")


@pytest.mark.parametrize(
    ("raw", "arguments"),
    [
        ('{"flight": "LH123"}', {"flight": "LH123"}),
        ("", {}),
        (None, {}),
        ('{"flight": "LH1', {MALFORMED_ARGUMENTS: '{"flight": "LH1'}),
        ("[1, 2]", {MALFORMED_ARGUMENTS: "[1, 2]"}),
        ("null", {MALFORMED_ARGUMENTS: "null"}),
    ],
)
def test_tool_call_arguments_from_the_wire(raw: str | None, arguments: dict[str, str]) -> None:
    assert arguments_from_text(raw) == arguments


def test_malformed_arguments_go_back_verbatim() -> None:
    assert arguments_to_text({MALFORMED_ARGUMENTS: '{"flight": "LH1'}) == '{"flight": "LH1'
    assert arguments_to_text({"flight": "LH123"}) == '{"flight": "LH123"}'


def test_transient_statuses_match_the_sdks_retry_policy() -> None:
    assert [
        s for s in (400, 401, 403, 404, 408, 409, 422, 429, 500, 503, 529) if is_transient_status(s)
    ] == [408, 409, 429, 500, 503, 529]


def test_scrub_masks_the_key_in_error_text() -> None:
    assert scrub("bad key sk-123abcdef given", ["sk-123abcdef", None, ""]) == (
        "bad key [redacted:api_key] given"
    )
    # A placeholder (a local server's "unused") is no secret: the vendor's words stay.
    assert scrub("unused_tools_hint", ["unused"]) == "unused_tools_hint"


@pytest.mark.parametrize(
    ("module", "package"),
    [
        ("tesserix_adk.providers.openai", "openai"),
        ("tesserix_adk.providers.anthropic", "anthropic"),
    ],
)
def test_import_without_the_sdk_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, module: str, package: str
) -> None:
    monkeypatch.setitem(sys.modules, package, None)  # as if it were not installed
    monkeypatch.delitem(sys.modules, module, raising=False)
    with pytest.raises(ImportError, match=rf'pip install "tesserix-adk\[{package}\]"'):
        importlib.import_module(module)


def test_importing_the_kit_imports_neither_sdk() -> None:
    probe = (
        "import sys, tesserix_adk, tesserix_adk.providers; "
        "print(sorted(m for m in ('openai', 'anthropic') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "[]"
