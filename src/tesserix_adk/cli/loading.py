"""Loading what a command names: an agent, its model provider, a replay stub; and closing a
provider the command built, so its HTTP client does not outlive the command."""

from __future__ import annotations

import importlib
import inspect
import logging
import os
import sys
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

from tesserix_adk.agent import Agent
from tesserix_adk.cli.failures import UsageError
from tesserix_adk.providers.base import Provider

__all__ = ["built_provider", "import_ref", "load_agent", "load_provider"]

_log = logging.getLogger(__name__)


def load_agent(ref: str, agents: Mapping[str, Agent]) -> Agent:
    """An agent by name from ``agents``, else by ``module:attr`` (cwd importable)."""
    if ref in agents:
        return agents[ref]
    value = import_ref(ref, "agent")
    if not isinstance(value, Agent):
        raise UsageError(f"--agent {ref} is a {type(value).__name__}, not an Agent")
    return value


def load_provider(ref: str | None, agent: Agent, agent_ref: str) -> Provider:
    """``--provider module:attr``, else the agent module's ``PROVIDER``, else ``agent.model``."""
    return _load_provider(ref, agent, agent_ref)[0]


@asynccontextmanager
async def built_provider(ref: str | None, agent: Agent, agent_ref: str) -> AsyncIterator[Provider]:
    """``load_provider``, closed on the way out (also when the body raises) if this call
    built it: called a class or factory, or made one from ``agent.model``. An object the
    reference names as it is belongs to its module, which may use it again, and is left open.
    """
    provider, built = _load_provider(ref, agent, agent_ref)
    try:
        yield provider
    finally:
        if built:
            await _close(provider)


async def _close(provider: Any) -> None:
    close = getattr(provider, "aclose", None) or getattr(provider, "close", None)
    if not callable(close):
        return
    try:
        result = close()
        if inspect.isawaitable(result):
            await result
    except Exception as exc:  # the command's outcome stands; a client that will not close
        # only leaks until the process ends.
        _log.warning("closing the model provider failed: %s", exc)


def _load_provider(ref: str | None, agent: Agent, agent_ref: str) -> tuple[Provider, bool]:
    value: Any = None
    built = False
    if ref is not None:
        value = import_ref(ref, "provider")
    elif ":" in agent_ref:
        module = _import_module(agent_ref.split(":", 1)[0], "agent")
        value = getattr(module, "PROVIDER", None)
    if value is None and agent.model:
        value = _provider_from_model(agent.model)
        built = value is not None
    if value is None:
        raise UsageError(
            f"no model provider for agent {agent.name!r}: pass --provider module:attr, or set "
            "PROVIDER in the agent's module, or give the agent a model like 'openai:gpt-4o'"
        )
    if isinstance(value, type) or (callable(value) and not hasattr(value, "complete")):
        try:
            value = value()
        except Exception as exc:  # e.g. an API key that is not set
            raise UsageError(
                f"the provider for agent {agent.name!r} could not be built: {exc}"
            ) from exc
        built = True
    if not hasattr(value, "complete"):
        raise UsageError(f"the provider for agent {agent.name!r} has no complete() method")
    provider: Provider = value
    return provider, built


def _provider_from_model(model: str) -> Any:
    vendor, _, name = model.partition(":")
    if vendor == "openai":
        module = _import_module("tesserix_adk.providers.openai", "provider")
        return module.OpenAIProvider(name)
    if vendor == "anthropic":
        module = _import_module("tesserix_adk.providers.anthropic", "provider")
        return module.AnthropicProvider(name)
    return None


def import_ref(ref: str, what: str) -> Any:
    """The object ``module:attr`` (``attr`` may be dotted) names; ``UsageError`` if none."""
    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name or not attr:
        raise UsageError(f"--{what} {ref!r} is not of the form module:attr")
    module = _import_module(module_name, what)
    value: Any = module
    for part in attr.split("."):
        try:
            value = getattr(value, part)
        except AttributeError:
            raise UsageError(f"--{what} {ref}: {module_name} has no attribute {attr!r}") from None
    return value


def _import_module(name: str, what: str) -> Any:
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise UsageError(f"cannot load the {what} module {name!r}: {exc}") from exc
    except Exception as exc:  # its import raised: still not something we can run
        raise UsageError(f"loading the {what} module {name!r} failed: {exc!r}") from exc
