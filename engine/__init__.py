"""Braid's model runtime: a message-level KV store with the choreography API and synthesis."""

from engine.config import EngineConfig
from engine.engine import DecodeCall, DecodeStream, Engine, PrefillCall, TokenEvent
from engine.errors import BraidError
from engine.sampling import SamplingParams
from engine.store import Message, MessageStore

__all__ = ["BraidError", "DecodeCall", "DecodeStream", "Engine", "EngineConfig", "Message", "MessageStore",
           "PrefillCall", "SamplingParams", "TokenEvent"]
