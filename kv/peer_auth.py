"""Only the cluster's own replicas on its internal KV ports (KVExport, KVTransfer): a shared secret in gRPC metadata.

The secret comes from $BRAID_CLUSTER_TOKEN, the same on every replica: `braid serve` makes one for the Ray cluster
it starts, and the Helm chart keeps one in a Secret that every pod reads. Servers built with `peer_check()` refuse
a call that does not carry it with UNAUTHENTICATED; channels from `peer_channel()` attach it to every call. With
no secret set (a process of its own, the tests' in-process servers), nothing is checked.
"""

import hmac
import logging
import os
import secrets

import grpc

log = logging.getLogger(__name__)
ENV = "BRAID_CLUSTER_TOKEN"
HEADER = "braid-cluster-token"


def cluster_token() -> str | None:
    """The secret, if set (surrounding whitespace dropped: a Secret made from a file often ends in a newline)."""
    token = os.environ.get(ENV, "").strip()
    if token and not (token.isascii() and token.isprintable()):
        raise ValueError(f"${ENV} must be printable ASCII (it travels as gRPC metadata)")
    return token or None


def ensure_cluster_token() -> str:
    """This process's secret, made now if it has none (processes it starts afterwards inherit it)."""
    if not cluster_token():
        os.environ[ENV] = secrets.token_urlsafe(32)
    return os.environ[ENV]


class _PeerCheck(grpc.ServerInterceptor):
    def __init__(self, token: str):
        self._token = token.encode()

    def intercept_service(self, continuation, details):
        got = dict(details.invocation_metadata).get(HEADER, "")
        if hmac.compare_digest(got.encode(), self._token):
            return continuation(details)
        handler = continuation(details)
        if handler is None:  # (an unknown method: gRPC answers UNIMPLEMENTED)
            return None
        message = (f"{details.method} is for this cluster's replicas only: the call lacks the cluster token "
                   f"(${ENV}) or carries another")

        def refuse(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        def refuse_stream(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
            yield  # (a generator, as a streaming response is)

        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(refuse_stream)
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(refuse)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(refuse_stream)
        return grpc.unary_unary_rpc_method_handler(refuse)


def peer_check(host: str) -> list[grpc.ServerInterceptor]:
    """Interceptors for an internal server on `host` (`grpc.server(..., interceptors=peer_check(host))`): none
    without a secret, which is logged unless the server is on loopback only."""
    token = cluster_token()
    if token is None and not host.startswith("127."):
        log.warning("an internal KV port on %s takes calls from anyone: $%s is not set", host, ENV)
    return [_PeerCheck(token)] if token else []


class _Details(grpc.ClientCallDetails):
    def __init__(self, details: grpc.ClientCallDetails, metadata):
        self.method, self.timeout, self.credentials = details.method, details.timeout, details.credentials
        self.wait_for_ready, self.compression = details.wait_for_ready, details.compression
        self.metadata = metadata


class _AttachToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                   grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    def __init__(self, token: str):
        self._entry = (HEADER, token)

    def _details(self, details):
        return _Details(details, [*(details.metadata or ()), self._entry])

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)


def peer_channel(address: str, options=None) -> grpc.Channel:
    """A channel to another replica's internal port, carrying the cluster token on every call (if there is one)."""
    channel = grpc.insecure_channel(address, options=options)
    token = cluster_token()
    return grpc.intercept_channel(channel, _AttachToken(token)) if token else channel
