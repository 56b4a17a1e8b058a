"""Decode forwards at static shapes, replayed as CUDA graphs: a decode step's host time becomes one replay.

An eager decode step launches thousands of small kernels (about 2100 at the 8B shape), so its host time,
not the device's work, sets the step's time (benchmarks/profile_decode.py measures both). A forward whose
requests are all decode-sized (at most SHARED_ATTENTION_ROWS rows each, no leading prefill rows) runs here at a
bucketed shape: G requests of R rows (powers of two), each attending T keys (key_bucket). Request i's rows are rows
[i*R, i*R + n) of the forward and its keys the first `length` of its T; the rest is padding, masked out.
Padding rows attend their request's keys (padding requests: one key), write their KV to the pool's trash slot,
which no call owns, and are dropped.
Every input of the forward (token ids, positions, where each row's KV goes, which pool slots each request
reads, the masks) is copied into the bucket's static buffers, so one CUDA graph per bucket, captured the
first time the bucket is used, replays the whole decoder; lm_head then runs on the rows that need logits,
as it does for forwards that run as they come.

The padded forward computes what the scheduler's shared decode attention (engine.model_runner._Step) computes,
with more masked keys and rows: the same tokens, logits equal within rounding (the masked keys add exact
zeros, but sums over longer rows may round differently). Tested on CPU, where mode "eager" runs the
padded forward without capturing it.

A graph replays the weights it was captured with. The scheduler's LoRA forwards swap merged copies of the
adapted weights in (methods.calibration.MergedLora) over every row when there are no leading prefill rows, as in a
static forward, so buckets are kept per weights: base, or each adapter, captured while it is in place. Where the
runner compiles (EngineConfig.compile), a base-weight bucket's forward is the compiled one (compiled in the warm-up
before its capture), and its graph replays the compiled kernels.
"""

import logging
from collections import OrderedDict
from dataclasses import dataclass

import torch

from braid.engine.host import to_device
from braid.engine.kv_cache import KVPool
from braid.engine.model_runner import (
    SHARED_ATTENTION_ROWS,
    ModelRunner,
    RequestInput,
    _Part,
    _Step,
    fill_masks,
    padded_keys,
)

log = logging.getLogger(__name__)

MAX_REQUESTS = 64  # requests in one static forward (more run as they come)
MAX_KEYS = 1 << 18  # G * T: the keys one static forward reads (its gathered KV and scores grow with it)
MAX_BUCKETS = 64  # buckets kept (with their graphs and outputs); the least recently used goes first
MIN_KEYS = 64  # the smallest T
KEY_STEP = 512  # past this many keys, T grows in steps (not doubling: attention reads all of T): key_bucket


def bucket(n: int, least: int = 1) -> int:
    """The power of two at or above n (and at or above `least`)."""
    return max(least, 1 << max(0, n - 1).bit_length())


def key_bucket(n: int) -> int:
    """T for requests of at most n keys: a power of two up to KEY_STEP, then a multiple of a quarter of the next
    power of two (at least KEY_STEP): under a third of T is padding past 2 * KEY_STEP, and a decode that
    grows crosses four steps for each doubling of its keys (each a graph to capture)."""
    if n <= KEY_STEP:
        return bucket(n, MIN_KEYS)
    step = max(KEY_STEP, bucket(n) // 4)
    return -(-n // step) * step


class PaddedStep(_Step):
    """A static forward's view for the cache writes and the attention: every row is a padded row of the
    shared decode attention. Its buffers belong to a bucket and are overwritten for each forward."""

    padded = True

    def __init__(self, pool: KVPool, shape: tuple[int, int, int], paged_decode=None):
        g, r, t = shape
        self.paged_decode = paged_decode
        device, trash = pool.kv.device, pool.trash
        self.pool, self.shape = pool, shape
        self.parts, self.large, self.small = [], [], True
        self.write_index = torch.full((g * r,), trash, dtype=torch.long, device=device)  # each row's KV slot
        self.read_index = torch.full((g * t,), trash, dtype=torch.long, device=device)  # each key's pool slot
        self.allowed = torch.zeros(g, 1, r, t, dtype=torch.bool, device=device)
        # what attention reads: the mask made additive once a forward, not in every layer
        self.mask = torch.zeros(g, 1, r, t, dtype=pool.kv.dtype, device=device)
        self.input_ids = torch.zeros(1, g * r, dtype=torch.long, device=device)
        self.positions = torch.zeros(1, g * r, dtype=torch.long, device=device)
        self.clear()

    def clear(self) -> None:
        """Every row padding: it reads key 0 (the trash slot) and writes there."""
        self.write_index.fill_(self.pool.trash)
        self.read_index.fill_(self.pool.trash)
        self.allowed.zero_()
        self.allowed[..., 0] = True
        self.input_ids.zero_()
        self.positions.zero_()

    def load(self, requests: list[RequestInput], parts: list[_Part]) -> None:
        """This forward's requests into the buffers: request i's rows at [i*R, i*R + n), its keys at
        [i*T, i*T + length).
        A few copies for all the requests, not a few per request (the host time of a step of many calls)."""
        _, r, t = self.shape
        self.clear()
        g = len(requests)
        rows = to_device([i * r + j for i, x in enumerate(requests) for j in range(len(x.input_ids))],
                         self.input_ids.device)
        self.input_ids[0].index_copy_(0, rows, torch.cat([x.input_ids for x in requests]))
        self.positions[0].index_copy_(0, rows, torch.cat([x.positions for x in requests]))
        self.write_index.index_copy_(0, rows, torch.cat([p.write_index for p in parts]))
        read_index, inside = padded_keys(parts, t, self.pool.trash)
        self.read_index[:g * t] = read_index
        fill_masks(self.allowed, parts, inside)  # (padding requests, past the real ones: key 0, from clear)
        self.mask.zero_().masked_fill_(~self.allowed, float("-inf"))


@dataclass(eq=False)
class _Bucket:
    step: PaddedStep
    weights: object = None  # the weights in place for its forwards (None: the base ones)
    graph: "torch.cuda.CUDAGraph | None" = None
    hidden: torch.Tensor | None = None  # the captured forward's output: last hidden states [G * R, hidden]
    replays: int = 0


class DecodeGraphs:
    """The runner's static decode forwards, one bucket per (G, R, T) in use. `capture`: replay CUDA graphs
    (CUDA only); false: run the padded forward as it comes (what the graphs replay; CPU tests)."""

    def __init__(self, runner: ModelRunner, pool: KVPool, capture: bool):
        if capture and runner.lm.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {runner.lm.device}")
        self.runner, self.pool, self.capture = runner, pool, capture
        # (weights, (G, R, T)) -> bucket, least recently used first; weights: None (base) or the adapter in place
        self.buckets: OrderedDict[tuple[object, tuple[int, int, int]], _Bucket] = OrderedDict()
        self.mempool = torch.cuda.graph_pool_handle() if capture else None  # (one memory pool for every graph)
        self.replays = self.captures = 0

    def shape(self, requests: list[RequestInput]) -> tuple[int, int, int] | None:
        """The bucket these requests' next forward runs in, or None when it
        is not a static decode forward."""
        if not requests or len(requests) > MAX_REQUESTS:
            return None
        rows = max(len(g.input_ids) for g in requests)
        if rows > SHARED_ATTENTION_ROWS or any(g.lead_rows for g in requests):
            return None
        keys = max(g.slots.length - g.cache.start for g in requests)  # (this step's rows included)
        shape = (bucket(len(requests)), bucket(rows), key_bucket(keys))
        return shape if shape[0] * shape[2] <= MAX_KEYS else None

    def run(self, requests: list[RequestInput], parts: list[_Part], shape: tuple[int, int, int],
            weights=None) -> torch.Tensor | None:
        """The forward of these requests in bucket `shape` (`shape(requests)`; their masks built: ModelRunner._part),
        with the weights in place named by `weights` (None: the base ones):
        the last hidden states of its padded rows [G * R, hidden], request i's at [i * R, i * R + its rows).
        None when there is no memory for the bucket: this forward runs as it comes."""
        key = (weights, shape)
        b = self.buckets.get(key)
        if b is None:
            b = self._bucket(shape, weights)
            if b is None:
                return None
            if len(self.buckets) == MAX_BUCKETS:
                self.buckets.popitem(last=False)  # (its graph's memory goes back to the graphs' pool)
            self.buckets[key] = b
        self.buckets.move_to_end(key)
        b.step.load(requests, parts)
        if b.graph is None:
            return self._forward(b)
        with torch.cuda.device(self.pool.kv.device):  # (the engine's device may not be the thread's current one)
            b.graph.replay()
        self.replays += 1
        b.replays += 1
        return b.hidden

    def _forward(self, b: _Bucket) -> torch.Tensor:
        return self.runner.forward(b.step.input_ids, b.step.positions, b.step, b.weights)  # [G * R, hidden]

    def _bucket(self, shape: tuple[int, int, int], weights=None) -> _Bucket | None:
        """A new bucket's buffers, and its graph captured over them while every row is padding (it writes
        only the trash slot). None when the device has no memory for it. A capture that fails otherwise (an op
        a graph cannot hold) leaves that bucket, and every later one, eager."""
        try:
            b = _Bucket(PaddedStep(self.pool, shape, self.runner.paged_decode), weights)
            if self.capture:
                self._capture(b)
            return b
        except torch.OutOfMemoryError:
            log.warning("no device memory for a decode bucket of %d request(s) x %d row(s) x %d keys; that forward "
                        "runs as it comes", *shape)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            return None

    def _capture(self, b: _Bucket) -> None:
        try:
            with torch.cuda.device(self.pool.kv.device):  # (streams and capture on the engine's device)
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):  # (warm-up off the graph: lazy initialisations, cuBLAS workspaces)
                    for _ in range(2):  # (a compiled forward compiles here, where the shape is new to it)
                        self._forward(b)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.mempool, capture_error_mode="thread_local"):
                    b.hidden = self._forward(b)
            b.graph = graph
            self.captures += 1
            log.info("captured a decode graph for %d request(s) x %d row(s) x %d keys", *b.step.shape)
        except torch.OutOfMemoryError:
            raise
        except Exception:
            log.exception("capturing a decode graph for %s failed; static forwards run without graphs",
                          b.step.shape)
            self.capture = False
            b.hidden = None
