"""The collective sending side: chunk headers on the gRPC stream, payloads on a two-rank NCCL or gloo link."""

import logging
from datetime import timedelta

import grpc
import torch
import torch.distributed as dist

from braid.kv.connector import Transport
from braid.kv.grpc_transport import GrpcSender
from braid.kv.peer_auth import peer_channel
from braid.protos import kv_pb2, kv_pb2_grpc

log = logging.getLogger(__name__)


def collective_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


class CollectiveLink:
    """Two ranks (receiver 0, sender 1) over a TCPStore; payloads arrive in the order they are sent."""

    def __init__(self, store: dist.TCPStore, rank: int, backend: str, timeout_s: float = 60):
        timeout = timedelta(seconds=timeout_s)
        if backend == "nccl":
            self.pg, self.device = dist.ProcessGroupNCCL(store, rank, 2, timeout=timeout), torch.device("cuda")
        elif backend == "gloo":
            self.pg, self.device = dist.ProcessGroupGloo(store, rank, 2, timeout), torch.device("cpu")
        else:
            raise ValueError(f"collective backend {backend!r} is not nccl or gloo")
        self.store, self.peer, self.backend = store, 1 - rank, backend

    @classmethod
    def connect(cls, host: str, port: int, backend: str) -> "CollectiveLink":
        """The sender's side, once the receiver has answered OpenLink."""
        return cls(dist.TCPStore(host, port, 2, is_master=False, timeout=timedelta(seconds=60)), 1, backend)

    def send(self, piece: torch.Tensor) -> None:
        self.pg.send([piece.to(self.device).contiguous()], self.peer, 0).wait()

    def recv(self, shape, dtype: torch.dtype) -> torch.Tensor:
        piece = torch.empty(tuple(shape), dtype=dtype, device=self.device)
        self.pg.recv([piece], self.peer, 0).wait()
        return piece


def close_link(address: str, link_id: str, timeout: float = 10) -> None:
    """Tell the receiver to let go of a link this side has dropped (best effort: logged if it cannot be reached)."""
    try:
        with peer_channel(address) as channel:
            kv_pb2_grpc.KVTransferStub(channel).CloseLink(kv_pb2.LinkRequest(link_id=link_id), timeout=timeout)
    except grpc.RpcError as e:
        log.warning("could not close KV link %s at %s: %s", link_id, address, e.code().name)


def open_link(address: str, link_id: str, backend: str) -> CollectiveLink:
    """Ask a KVReceiver for a collective link and join it as the sender."""
    with peer_channel(address) as channel:
        info = kv_pb2_grpc.KVTransferStub(channel).OpenLink(kv_pb2.LinkRequest(link_id=link_id, backend=backend),
                                                            timeout=60)
    return CollectiveLink.connect(info.host, info.port, backend)


class CollectiveSender(GrpcSender):
    """Headers on the gRPC stream (so the receiver posts receives in sending order), tensors on `link`."""

    transport = Transport.COLLECTIVE

    def __init__(self, address: str, fingerprint: str, link: CollectiveLink, link_id: str,
                 max_chunk_bytes: int = 1 << 20):
        super().__init__(address, fingerprint, max_chunk_bytes)
        self.link, self.link_id = link, link_id

    def _send_piece(self, piece) -> None:
        self.link.send(piece)
