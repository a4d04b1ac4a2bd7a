"""Model providers: the protocol, the scripted test double, and the real SDK-backed ones."""

from tesserix_adk.providers.base import ModelRequest, ModelResponse, Provider
from tesserix_adk.providers.scripted import ScriptedProvider, ScriptedTurn

__all__ = ["ModelRequest", "ModelResponse", "Provider", "ScriptedProvider", "ScriptedTurn"]
