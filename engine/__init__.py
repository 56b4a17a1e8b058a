"""Braid's model runtime: a message-level KV store with the choreography API and synthesis."""

from braid.engine.config import EngineConfig
from braid.engine.engine import DecodeCall, DecodeStream, Engine, PrefillCall, TokenEvent
from braid.engine.errors import BraidError
from braid.engine.sampling import SamplingParams
from braid.engine.store import Message, MessageStore
from braid.engine.workflow import BranchStream, fan_out

__all__ = ["BraidError", "BranchStream", "DecodeCall", "DecodeStream", "Engine", "EngineConfig", "Message", "MessageStore",
           "PrefillCall", "SamplingParams", "TokenEvent", "fan_out"]
