"""The local sending side: worker and synthesizer share one engine, so a branch message changes hands, no copy."""

import threading

from braid.kv.connector import BranchChunk, KVSender, SentStream, TransferError, Transport

_RECEIVERS: dict[str, object] = {}  # address -> KVReceiver living in this process
_LOCK = threading.Lock()


def register(address: str, receiver) -> None:
    with _LOCK:
        _RECEIVERS[address] = receiver


def unregister(address: str) -> None:
    with _LOCK:
        _RECEIVERS.pop(address, None)


def receiver_here(address: str):
    """The KVReceiver at `address` if it lives in this process, else None."""
    with _LOCK:
        return _RECEIVERS.get(address)


class LocalSender(KVSender):
    """Hands finished branch messages to a receiver in this process. Partial chunks are not copied: the
    message is in the shared store once its last chunk is sent (`local_message` names it)."""

    transport = Transport.LOCAL
    copies = False

    def __init__(self, address: str, fingerprint: str):
        self.receiver = receiver_here(address)
        if self.receiver is None:
            raise TransferError(f"no KV receiver at {address!r} in this process; the local transport needs the "
                                "worker and the synthesizer on one engine")
        self.fingerprint = fingerprint
        self.sent: dict[str, SentStream] = {}
        self._streams: list[str] = []

    def open(self, stream_ids: list[str]) -> None:
        self._streams += stream_ids
        for sid in stream_ids:
            self.receiver.opened(sid)

    def send(self, chunk: BranchChunk) -> None:
        stats = self.sent.setdefault(chunk.stream_id, SentStream(chunk.stream_id))
        if chunk.total_tokens:
            if not chunk.local_message:
                raise TransferError(f"stream {chunk.stream_id!r}: a local hand-over needs the message id")
            self.receiver.deliver_local(chunk.stream_id, chunk.local_message, self.fingerprint)
        else:
            self.receiver.opened(chunk.stream_id)  # progress: keeps the receiver's idle clock fresh
        stats.chunks += 1

    def finish(self) -> dict[str, SentStream]:
        return self.sent

    def abort(self, reason: str) -> None:
        self.receiver.abandon(self._streams, f"the worker gave up: {reason}")
