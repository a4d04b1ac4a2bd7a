"""Redaction of the user data a payload carries: one path for a tool's result.

``redact_outcome_content`` is used for the recorded outcome, the transcript entry and the
frontier's ``observation`` alike, so all three mask alike.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from tesserix_adk.checkpoint.payload.envelope import _bounded
from tesserix_adk.checkpoint.redaction import Redactor
from tesserix_adk.messages import Message, content_json
from tesserix_adk.messages import message_to_json as _message_to_json

__all__ = ["redact_outcome_content"]


def redact_outcome_content(content: Any, redactor: Redactor) -> Any:
    """A tool result's content, redacted: the one path for the recorded outcome, the
    transcript entry and the frontier's observation, so all three mask alike.

    Text that is a JSON object or array is redacted as data (values under keys like
    ``password`` are masked) and written back as JSON text; other text by pattern; any
    other value as data.
    """
    if isinstance(content, str):
        return _redacted_text(content, redactor)
    # As JSON data first, the way the transcript entry writes it (``default=str``): a
    # result the codec cannot write would leave a completed call's claim in flight.
    data = json.loads(content_json(_bounded(content, "a tool result"), default=str))
    return redactor.value(data)


def _redacted_text(text: str, redactor: Redactor) -> str:
    # Redactor.text masks JSON text in place (every duplicate of a key included, which a
    # json.loads round trip would drop) and anything else as free text.
    return redactor.text(text)


def _redacted_message(message: Message, redactor: Redactor) -> dict[str, Any]:
    for call in message.tool_calls:
        _bounded(call.arguments, f"the arguments of {call.name} ({call.id})")
    data = _message_to_json(message)
    if isinstance(data["content"], str):
        if data["role"] == "tool":
            data["content"] = redact_outcome_content(data["content"], redactor)
        else:
            data["content"] = redactor.text(data["content"])
    else:
        data["content"] = _redacted_parts(data["content"], redactor)
    for call in data.get("tool_calls", ()):
        # A name is the model's text too: one echoing a key would store the key.
        call["name"] = redactor.text(call["name"])
        call["arguments"] = redactor.value(call["arguments"])
    return data


# A placeholder ending a part, and the run of value characters that starts the next one.
_ENDS_MASKED = re.compile(r"\[redacted:[a-z0-9_]+\]\Z")
_VALUE_RUN = re.compile(r"[^\s,;&\"'()\[\]{}<>]+")


def _redacted_parts(parts: list[dict[str, Any]], redactor: Redactor) -> list[dict[str, Any]]:
    """Each text part redacted, and a run of adjacent text parts redacted again as the one
    text the model reads, so a secret split across parts is found:

    - a value masked at the very end of a part goes on into the next one, up to a
      delimiter (a key whose head alone matched leaves no tail);
    - the parts joined are redacted again (pieces each too short to match alone).

    Each part is masked on its own first, so what only a part's own shape gives away (a
    JSON document's secret-named keys) stays masked. When the run gives away more than its
    parts did, it is stored as one part holding the masked text (the same text, so what a
    resume sends the model says the same)."""
    out: list[dict[str, Any]] = []
    run: list[dict[str, Any]] = []

    def close_run() -> None:
        masked = [redactor.text(p["text"]) for p in run]
        if len(run) < 2:
            out.extend({**p, "text": m} for p, m in zip(run, masked, strict=True))
            run.clear()
            return
        texts = list(masked)
        for k in range(1, len(texts)):
            if _ENDS_MASKED.search(texts[k - 1]) and not texts[k].startswith("[redacted:"):
                tail = _VALUE_RUN.match(texts[k])
                if tail is not None:
                    texts[k] = texts[k][tail.end() :]
        whole = redactor.text("".join(texts))
        if whole != "".join(masked):
            out.append({"type": "text", "text": whole})
        else:
            out.extend({**p, "text": m} for p, m in zip(run, masked, strict=True))
        run.clear()

    for part in parts:
        if part["type"] == "text":
            run.append(part)
        else:
            close_run()
            out.append(_redacted_binary(part, redactor))
    close_run()
    return out


# Media whose bytes are samples, not text: nothing in them reads as a secret (an SVG is
# text, XML, though it is an image).
_SAMPLED = ("image", "audio", "video")


def _sampled(media: str) -> bool:
    kind, _, subtype = media.lower().partition("/")
    return kind in _SAMPLED and "svg" not in subtype and "xml" not in subtype


def _redacted_binary(part: dict[str, Any], redactor: Redactor) -> dict[str, Any]:
    """A binary part (base64 ``data``) as it is, or, when the document's bytes hold a
    secret (a ``.env`` attached as text/plain), a text part saying it was masked: its
    bytes cannot be kept masked and still be the document."""
    media = str(part.get("media_type", ""))
    shown = redactor.text(media)  # a media type's parameters could name anything
    if shown != media:
        part = {**part, "media_type": shown}
    data = part.get("data")
    if _sampled(media) or not isinstance(data, str) or redactor.text(data) == data:
        return part
    return {"type": "text", "text": f"[redacted:encoded] (a {shown} part holding a secret)"}


def _redacted_observation(observation: Any, redactor: Redactor) -> Any:
    """The last turn's tool results: each entry's ``content`` through the outcome path."""
    _bounded(observation, "the observation")
    if not isinstance(observation, list | tuple):
        return redactor.value(observation)
    out: list[Any] = []
    for entry in observation:
        if isinstance(entry, Mapping) and "content" in entry:
            rest = redactor.value({k: v for k, v in entry.items() if k != "content"})
            out.append({**rest, "content": redact_outcome_content(entry["content"], redactor)})
        else:
            out.append(redactor.value(entry))
    return out
