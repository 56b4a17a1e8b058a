"""What each API key may hold at once, counted in the directory across replicas, and the error past it."""

from dataclasses import dataclass

from braid.engine.errors import BraidError


class QuotaError(BraidError):
    code = "RESOURCE_EXHAUSTED"


@dataclass(frozen=True)
class KeyLimits:
    """What each API key may hold at once (0: no limit). Sessions and KV bytes are counted in the directory
    (Redis), so they hold across replicas; KV bytes are checked before each call that adds KV (a call may end
    above the limit by its own output, the next one is refused)."""

    sessions: int = 0  # open sessions
    store_bytes: int = 0  # KV bytes registered in its sessions
    workflows: int = 0  # RunWorkflow / RunAgents requests running at once

    def __post_init__(self):
        for name in ("sessions", "store_bytes", "workflows"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"key limit {name} must be an int >= 0 (0: no limit), got {value!r}")
