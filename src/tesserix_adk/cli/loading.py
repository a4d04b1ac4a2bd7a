"""Loading what a command names: an agent, its model provider, a replay stub; and closing a
provider the command built, so its HTTP client does not outlive the command.

A reference is ``module:attr`` (the current directory is importable, as with ``python -m``)
or ``path/to/file.py:attr`` (the file is loaded as a module named after it, its directory
importable). Anything else is one sentence, exit 2.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
import os
import sys
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from tesserix_adk.agent import Agent
from tesserix_adk.checkpoint.redaction import Masked
from tesserix_adk.cli.failures import UsageError
from tesserix_adk.providers.base import Provider

__all__ = ["ProviderSource", "built_provider", "import_ref", "load_agent", "load_provider"]

# What an embedding product passes ``resume_main(provider=...)``: the same kinds of thing as
# a ``PROVIDER`` attribute (a provider, or a class or factory called with no arguments).
ProviderSource = Any

_log = logging.getLogger(__name__)


def load_agent(ref: str, agents: Mapping[str, Agent]) -> Agent:
    """An agent by name from ``agents``, else by ``module:attr`` (cwd importable)."""
    if ref in agents:
        return agents[ref]
    value = import_ref(ref, "agent")
    if not isinstance(value, Agent):
        raise UsageError(f"--agent {ref} is a {type(value).__name__}, not an Agent")
    return value


def load_provider(
    ref: str | None, agent: Agent, agent_ref: str, *, default: ProviderSource = None
) -> Provider:
    """``--provider module:attr``, else ``default`` (what an embedding product passed), else
    the agent module's ``PROVIDER``, else ``agent.model``."""
    return _load_provider(ref, agent, agent_ref, default)[0]


@asynccontextmanager
async def built_provider(
    ref: str | None, agent: Agent, agent_ref: str, *, default: ProviderSource = None
) -> AsyncIterator[Provider]:
    """``load_provider``, closed on the way out (also when the body raises) if this call
    built it: called a class or factory, or made one from ``agent.model``. An object the
    reference names as it is belongs to its module, which may use it again, and is left open.
    """
    provider, built = _load_provider(ref, agent, agent_ref, default)
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
        _log.warning("closing the model provider failed: %s", Masked(exc))


def _load_provider(
    ref: str | None, agent: Agent, agent_ref: str, default: ProviderSource
) -> tuple[Provider, bool]:
    value: Any = None
    built = False
    if ref is not None:
        value = import_ref(ref, "provider")
    elif default is not None:
        value = default
    elif ":" in agent_ref:
        module = _import_module(agent_ref.rsplit(":", 1)[0], "agent")
        value = getattr(module, "PROVIDER", None)
    if value is None and agent.model:
        value = _provider_from_model(agent.model)
        built = value is not None
    if value is None:
        where = (
            "set PROVIDER in the agent's module"
            if ":" in agent_ref
            else "pass resume_main(provider=...)"
        )
        raise UsageError(
            f"no model provider for agent {agent.name!r}: pass --provider module:attr, or "
            f"{where}, or give the agent a model like 'openai:gpt-4o'"
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
    """The object ``module:attr`` or ``path/to/file.py:attr`` (``attr`` may be dotted)
    names; ``UsageError`` if none."""
    module_name, sep, attr = ref.rpartition(":")
    if not sep or not module_name or not attr:
        raise UsageError(
            f"--{what} {ref!r} is not of the form module:attr (or path/to/file.py:attr)"
        )
    module = _import_module(module_name, what)
    value: Any = module
    for part in attr.split("."):
        try:
            value = getattr(value, part)
        except AttributeError:
            raise UsageError(f"--{what} {ref}: {module_name} has no attribute {attr!r}") from None
    return value


def _import_module(name: str, what: str) -> Any:
    if _is_path(name):
        return _import_file(name, what)
    if name.startswith(".") or not all(part.isidentifier() for part in name.split(".")):
        raise UsageError(
            f"--{what} {name!r} names no module: pass module:attr, the module importable "
            "from the current directory (my_agent:agent), or path/to/file.py:attr"
        )
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise UsageError(f"cannot load the {what} module {name!r}: {exc}") from exc
    except Exception as exc:  # its import raised: still not something we can run
        raise UsageError(f"loading the {what} module {name!r} failed: {exc!r}") from exc


def _is_path(name: str) -> bool:
    return name.endswith(".py") or "/" in name or os.sep in name


def _import_file(name: str, what: str) -> Any:
    """A ``.py`` file loaded as a module named after it; its directory importable, so it can
    import its neighbours. Loaded once per process: a second reference gets the same module
    (the agent's ``PROVIDER`` is read from the module its agent came from)."""
    path = Path(name).expanduser().resolve()
    if path.suffix != ".py" or not path.is_file():
        raise UsageError(
            f"--{what} {name!r} is not a Python file: pass module:attr, the module importable "
            "from the current directory (my_agent:agent), or path/to/file.py:attr"
        )
    module_name = path.stem
    loaded = sys.modules.get(module_name)
    if loaded is not None:
        if Path(getattr(loaded, "__file__", "") or "").resolve() == path:
            return loaded
        raise UsageError(
            f"--{what} {name!r}: a module named {module_name!r} is already loaded from "
            f"elsewhere; rename the file"
        )
    if not module_name.isidentifier():
        raise UsageError(f"--{what} {name!r}: {path.name!r} is not a name Python can import")
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:  # pragma: no cover - a .py file always has one
        raise UsageError(f"--{what} {name!r} cannot be loaded as a module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[module_name]
        raise UsageError(f"loading the {what} file {name!r} failed: {exc!r}") from exc
    return module
