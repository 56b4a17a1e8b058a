"""API keys for the agent API (loaded from a file or the environment, checked on every RPC), and what a client
sends: its key, and TLS where the API sits behind a TLS endpoint."""

import hashlib
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from braid.engine.errors import BraidError

ENV_KEYS = "BRAID_API_KEYS"  # comma-separated [name:]key entries, added to the file's
ENV_CLIENT_KEY = "BRAID_API_KEY"  # the key `braid run` and `braid loadtest` send when --api-key is not given
HEADER = "authorization"  # gRPC metadata: "Bearer <key>"
# gRPC metadata: the client's deadline in milliseconds. Serve's gRPC proxy does not pass the call's own deadline
# on to the application, so Braid's clients send it here too and the ingress enforces it (braid.api.ingress).
TIMEOUT_HEADER = "braid-timeout-ms"


class UnauthenticatedError(BraidError):
    code = "UNAUTHENTICATED"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def client_metadata(key: str | None, timeout_s: float | None = None) -> tuple[tuple[str, str], ...]:
    """The metadata a client adds to each call: its key (if any) and, with `timeout_s`, its deadline."""
    key = key or os.environ.get(ENV_CLIENT_KEY)
    return (((HEADER, f"Bearer {key}"),) if key else ()) + timeout_metadata(timeout_s)


def timeout_metadata(timeout_s: float | None) -> tuple[tuple[str, str], ...]:
    """The deadline a client sends (none without `timeout_s`)."""
    return ((TIMEOUT_HEADER, str(max(1, round(1e3 * timeout_s)))),) if timeout_s else ()


class DeadlineError(BraidError):
    code = "DEADLINE_EXCEEDED"


def request_timeout(metadata) -> float | None:
    """The deadline a client sent (seconds), or None; a malformed one is INVALID_ARGUMENT."""
    value = dict(metadata or ()).get(TIMEOUT_HEADER)
    if value is None:
        return None
    try:
        ms = int(value)
        if ms < 1:
            raise ValueError
    except ValueError:
        raise BraidError(f"metadata {TIMEOUT_HEADER} must be a positive number of milliseconds, got {value!r}") \
            from None
    return ms / 1e3


def client_credentials(tls: bool, ca_cert: str | None = None):
    """TLS channel credentials (the system's roots, or `ca_cert`'s PEM), or None for a plaintext channel."""
    import grpc

    if not tls and not ca_cert:
        return None
    roots = None
    if ca_cert:
        with open(ca_cert, "rb") as f:
            roots = f.read()
    return grpc.ssl_channel_credentials(root_certificates=roots)


@dataclass(frozen=True)
class ApiKeys:
    """Accepted keys, held as SHA-256 digests, each with a name (the key's owner, for logs and limits)."""
    names: dict[bytes, str]

    @classmethod
    def parse(cls, entries: Iterable[str], source: str) -> "ApiKeys":
        names = {}
        for n, entry in enumerate(entries, 1):
            entry = entry.strip()
            if not entry or entry.startswith("#"):
                continue
            name, _, key = entry.rpartition(":")
            if len(key) < 16:
                raise ValueError(f"{source}, entry {n}: an API key must be at least 16 characters "
                                 f"(make one with `python -c 'import secrets; print(secrets.token_urlsafe(32))'`)")
            names[_digest(key)] = name or f"key-{n}"
        return cls(names)

    @classmethod
    def load(cls, path: str | None = None, env: Mapping[str, str] = os.environ) -> "ApiKeys | None":
        """Keys from `path` (one `[name:]key` per line, # comments) and $BRAID_API_KEYS; None when neither is
        given, which leaves the API open. A file given without a key is refused: it must not open the API."""
        names = {}
        if path:
            with open(path) as f:
                names.update(cls.parse(f.read().splitlines(), path).names)
            if not names:
                raise ValueError(f"API key file {path} holds no key: add `[name:]key` lines, or give no file to "
                                 f"leave the API open")
        if env.get(ENV_KEYS):
            names.update(cls.parse(env[ENV_KEYS].split(","), f"${ENV_KEYS}").names)
        return cls(names) if names else None

    def check(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
        """The caller's key name; UnauthenticatedError when the call carries no key or a wrong one."""
        value = next((v for k, v in metadata or () if k.lower() == HEADER), None)
        if value is None:
            raise UnauthenticatedError(f"this API needs a key: send gRPC metadata '{HEADER}: Bearer <key>' "
                                       f"(braid run --api-key, or ${ENV_CLIENT_KEY})")
        value = value.decode() if isinstance(value, bytes) else value
        scheme, _, key = value.partition(" ")
        if scheme.lower() != "bearer" or not key:
            raise UnauthenticatedError(f"metadata '{HEADER}' must be 'Bearer <key>'")
        # looked up by digest: how long a lookup takes says nothing about how close a guess was
        name = self.names.get(_digest(key.strip()))
        if name is None:
            raise UnauthenticatedError("the API key is not valid")
        return name
