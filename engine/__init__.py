"""The serving core: calls, a message store of KV, scheduling and sampling over one model (no method lives here)."""

from braid.engine.call import Adapter, Call, CallStatus, TokenEvent
from braid.engine.config import EngineConfig
from braid.engine.engine import DecodeCall, DecodeStream, Engine, KVTransform, PrefillCall, Sibling
from braid.engine.errors import BraidError
from braid.engine.sampling import SamplingParams
from braid.engine.store import Message, MessageStore

__all__ = ["Adapter", "BraidError", "Call", "CallStatus", "DecodeCall", "DecodeStream", "Engine", "EngineConfig",
           "KVTransform", "Message", "MessageStore", "PrefillCall", "SamplingParams", "Sibling", "TokenEvent"]
