"""The serving core: calls, a message store of KV, scheduling and sampling over one model (no method lives here)."""

from braid.engine.config import EngineConfig
from braid.engine.engine import DecodeCall, DecodeStream, Engine, PrefillCall, TokenEvent
from braid.engine.errors import BraidError
from braid.engine.sampling import SamplingParams
from braid.engine.store import Message, MessageStore

__all__ = ["BraidError", "DecodeCall", "DecodeStream", "Engine", "EngineConfig", "Message", "MessageStore",
           "PrefillCall", "SamplingParams", "TokenEvent"]
