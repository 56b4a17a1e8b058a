"""API keys for the agent API (loaded from a file or the environment, checked on every RPC), the key `braid serve`
makes when none is given, and what a client sends: its key, and TLS where the API sits behind a TLS endpoint."""

import hashlib
import ipaddress
import os
import re
import secrets
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


def local_key_path(port: int) -> str:
    """Where `braid serve` on `port` leaves the API key it made (~/.braid/api-key-<port>: one per port, so two
    clusters on one machine keep theirs apart)."""
    return os.path.join(os.path.expanduser("~"), ".braid", f"api-key-{port}")


def make_local_key(port: int) -> tuple[str, str]:
    """A new API key for `braid serve` on `port` and the file it is in (local_key_path), readable by this user
    only (0600, in a 0700 folder). The file is the cluster's key file too (one `local:<key>` line), and this
    machine's clients find it there (local_key). It names the process that made it: while that process lives,
    another `braid serve` on the same port is refused here and leaves the file as it is (it would neither share
    the key nor, on stopping, delete it); a file whose maker has gone is replaced."""
    key, path = secrets.token_urlsafe(32), local_key_path(port)
    try:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        staged = f"{path}.{os.getpid()}"
        if os.path.lexists(staged):
            os.unlink(staged)
        fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # (0600 before a byte is in it)
        with os.fdopen(fd, "w") as f:
            f.write(f"# the API key braid serve (pid {os.getpid()}) made for port {port}; braid run and braid "
                    f"loadtest on this machine send it\nlocal:{key}\n")
        try:
            os.link(staged, path)  # (only where there is no file: of two starting at once, one gets it)
        except FileExistsError:
            holder = _maker(path)
            if holder is not None:
                os.unlink(staged)
                raise ValueError(f"port {port} is taken by another braid serve (pid {holder}), whose API key is in "
                                 f"{path}: stop it, or serve on another --port") from None
            os.replace(staged, path)  # (its maker has gone: a key file left behind)
        else:
            os.unlink(staged)
    except OSError as e:
        raise ValueError(f"cannot write the API key to {path}: {e.strerror}; give keys (--api-keys-file or "
                         f"${ENV_KEYS}) or serve without any (--open-api)") from None
    return key, path


def _maker(path: str) -> int | None:
    """The live process other than this one that made the key file at `path` (make_local_key), or None: no
    file, a file that names no process (written by hand, or by an older braid), or one whose maker has gone."""
    try:
        with open(path) as f:
            first = f.readline()
    except FileNotFoundError:
        return None
    found = re.search(r"\(pid (\d+)\)", first)
    pid = int(found.group(1)) if found else None
    if pid is None or pid == os.getpid():
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:  # (alive, another user's)
        pass
    return pid


def drop_local_key(port: int, key: str) -> None:
    """Removes the key file of `port` when it still holds `key` (the cluster that made it has stopped)."""
    path = local_key_path(port)
    if _key_in(path) == key:
        os.unlink(path)


def _key_in(path: str) -> str | None:
    """The first key of a `[name:]key` file, or None when there is no such file."""
    try:
        with open(path) as f:
            entries = [line.strip() for line in f if line.strip() and not line.lstrip().startswith("#")]
    except FileNotFoundError:
        return None
    return entries[0].rpartition(":")[2] if entries else None


def local_key(address: str) -> str | None:
    """The key `braid serve` made for `address`, when that is on this machine (a loopback host) and it left one
    (local_key_path); None otherwise: a key made here is never sent anywhere else."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return None
    return _key_in(local_key_path(int(port))) if loopback and port.isdigit() else None


def client_key(key: str | None, address: str) -> str | None:
    """The key a client sends to `address`: `key` (--api-key), else $BRAID_API_KEY, else the key `braid serve`
    made for that address on this machine (local_key); None: none."""
    return key or os.environ.get(ENV_CLIENT_KEY) or local_key(address)


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
                                       f"(braid run --api-key, or ${ENV_CLIENT_KEY}; on the machine `braid serve` "
                                       f"runs on, braid run finds the key it made)")
        value = value.decode() if isinstance(value, bytes) else value
        scheme, _, key = value.partition(" ")
        if scheme.lower() != "bearer" or not key:
            raise UnauthenticatedError(f"metadata '{HEADER}' must be 'Bearer <key>'")
        # looked up by digest: how long a lookup takes says nothing about how close a guess was
        name = self.names.get(_digest(key.strip()))
        if name is None:
            raise UnauthenticatedError("the API key is not valid")
        return name
