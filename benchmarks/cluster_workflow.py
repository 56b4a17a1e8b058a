"""Cluster benchmarks, side by side in one run on a local cluster:

1. KV transfer throughput per transport (gRPC inline payloads; a gloo collective link), loopback.
2. Parallel-synthesis workflows over the gRPC agent API, KV over gRPC, KV over gloo and text, and a staircase
   over gRPC (the synthesizer answering from the workers' KV chunks as they arrive, default schedule),
   alternating: end-to-end TTFT (request to first answer token, worker decoding included) and the time from
   the last branch token to the first answer token (what shipping KV saves; negative for the staircase,
   whose answer begins before the workers finish).
"""

import argparse
import logging
import os
import socket
import statistics
import tempfile
import time

import grpc
import torch
from tqdm import tqdm

from braid.cluster.config import ClusterConfig
from braid.cluster.local import start_local_cluster
from braid.engine import EngineConfig
from braid.kv.collective import CollectiveSender, open_link
from braid.kv.connector import BranchChunk
from braid.kv.grpc_transport import GrpcSender
from braid.kv.receiver import KVReceiver
from braid.methods.calibration import fingerprints_at
from braid.models.checkpoints import SHAPES, make_random_checkpoint
from braid.protos import agent_pb2 as pb
from braid.protos import agent_pb2_grpc
from braid.results import pyplot, write_json


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="small", choices=sorted(SHAPES), help="model shape (random weights)")
    p.add_argument("--checkpoint", help="use this checkpoint directory instead of a random one")
    p.add_argument("--branches", type=int, default=4)
    p.add_argument("--lengths", type=int, nargs="+", default=[64, 128, 256], help="tokens each worker decodes")
    p.add_argument("--repeats", type=int, default=3, help="workflows per mode and length (median reported)")
    p.add_argument("--transfer-mib", type=int, default=64, help="size of the transfer-throughput payload")
    p.add_argument("--out", default="benchmarks/results", help="directory for the JSON and the plot")
    return p.parse_args(argv)


def transfer_throughput(mib: int, chunk_sizes=(1 << 20, 4 << 20)) -> list[dict]:
    tokens = mib * (1 << 20) // (2 * 8 * 128 * 4)  # one layer, 8 KV heads of 128, fp32
    kv = torch.randn(1, 2, 8, tokens, 128)
    rows = []
    receiver = KVReceiver("fp")
    try:
        link = open_link(receiver.address, "bench", "gloo")
        for transport, chunk in [("grpc", c) for c in chunk_sizes] + [("gloo", c) for c in chunk_sizes]:
            runs = []
            for r in range(3):
                stream_id = f"{transport}{chunk}:{r}"
                start = time.perf_counter()
                sender = (CollectiveSender(receiver.address, "fp", link, "bench", max_chunk_bytes=chunk)
                          if transport == "gloo" else GrpcSender(receiver.address, "fp", max_chunk_bytes=chunk))
                sender.send(BranchChunk(stream_id, "m", 0, 0, list(range(tokens)), kv, total_tokens=tokens))
                sender.finish()
                receiver.wait(stream_id, idle_timeout=120)
                runs.append(time.perf_counter() - start)
            seconds = statistics.median(runs)
            rows.append({"transport": transport, "chunk_bytes": chunk, "payload_bytes": kv.numel() * 4,
                         "seconds": seconds, "gb_per_s": kv.numel() * 4 / seconds / 1e9})
    finally:
        receiver.stop()
    return rows


def workflow(stub, args, length, transport, staircase=False):
    sampling = pb.Sampling(max_tokens=length, ignore_eos=True)
    req = pb.WorkflowRequest(task="User: combine what the workers found.", synthesis_prompt="Synthesizer:",
                             branch_prompts=[f"Worker {j}: look at part {j}." + " Think." * j
                                             for j in range(args.branches)],
                             worker_sampling=sampling, synthesis_sampling=pb.Sampling(max_tokens=4, ignore_eos=True),
                             transport=transport)
    if staircase:
        req.staircase.CopyFrom(pb.StaircaseOptions())
    events = list(stub.RunWorkflow(req, metadata=(("application", "braid"),), timeout=600))
    t = next(e.timings for e in events if e.HasField("timings"))
    return {"ttft_ms": t.ttft_ms, "last_branch_to_first_token_ms": t.last_branch_to_first_token_ms,
            "kv_bytes": t.kv_bytes, "kv_tail_ms": t.kv_transfer_ms}


def main(argv=None):
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a throwaway local cluster
    result = {"transfer": transfer_throughput(args.transfer_mib), "workflows": []}
    with tempfile.TemporaryDirectory() as tmp:
        path = args.checkpoint or make_random_checkpoint(tmp, "llama", args.shape)
        measured = fingerprints_at(EngineConfig(path))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cluster = start_local_cluster(ClusterConfig(path, grpc_port=port), num_cpus=2)
        try:
            with grpc.insecure_channel(cluster.address) as channel:
                stub = agent_pb2_grpc.AgentServiceStub(channel)
                for transport in (pb.TRANSPORT_GRPC, pb.TRANSPORT_COLLECTIVE):  # warm-up, and the gloo link
                    workflow(stub, args, 8, transport)
                for length in tqdm(args.lengths, desc="branch lengths"):
                    modes = {"kv": pb.TRANSPORT_GRPC, "gloo": pb.TRANSPORT_COLLECTIVE, "text": pb.TRANSPORT_TEXT,
                             "stair": pb.TRANSPORT_GRPC}
                    runs = {mode: [] for mode in modes}
                    for _ in range(args.repeats):  # alternate, so drift hits every mode alike
                        for mode, transport in modes.items():
                            runs[mode].append(workflow(stub, args, length, transport, staircase=mode == "stair"))
                    row = {"branch_tokens": length, "branches": args.branches}
                    for mode, rs in runs.items():
                        for key in rs[0]:
                            row[f"{mode}_{key}"] = statistics.median(r[key] for r in rs)
                    for mode in ("kv", "gloo"):
                        row[f"{mode}_handoff_speedup"] = (row["text_last_branch_to_first_token_ms"]
                                                          / row[f"{mode}_last_branch_to_first_token_ms"])
                    row["stair_ttft_reduction_vs_kv"] = 1 - row["stair_ttft_ms"] / row["kv_ttft_ms"]
                    result["workflows"].append(row)
        finally:
            cluster.stop()
    result["model"] = args.checkpoint or args.shape
    report(result, args.out, device="cpu", **measured)


def report(result, out_dir, **stamp):
    """Print the tables; write the JSON (under `stamp`: braid.results.write_json's keywords) and its plot."""
    print("\nKV transfer per transport (loopback, this machine)")
    for r in result["transfer"]:
        print(f"  {r['transport']:>5}, chunk {r['chunk_bytes'] >> 20} MiB: {r['payload_bytes'] / 2**20:.0f} MiB "
              f"in {r['seconds']:.2f} s = {r['gb_per_s']:.2f} GB/s")
    print(f"\nWorkflows over the agent API, model {result['model']}, medians (handoff: last branch token to "
          "first answer token)")
    print(f"{'tokens/branch':>13} {'TTFT grpc':>10} {'TTFT gloo':>10} {'TTFT text':>10} {'TTFT stair':>11} "
          f"{'handoff grpc':>13} {'handoff gloo':>13} {'handoff text':>13} {'KV MB':>7}")
    for r in result["workflows"]:
        print(f"{r['branch_tokens']:>13} {r['kv_ttft_ms']:>8.0f}ms {r['gloo_ttft_ms']:>8.0f}ms "
              f"{r['text_ttft_ms']:>8.0f}ms {r['stair_ttft_ms']:>9.0f}ms {r['kv_last_branch_to_first_token_ms']:>11.1f}ms "
              f"{r['gloo_last_branch_to_first_token_ms']:>11.1f}ms {r['text_last_branch_to_first_token_ms']:>11.1f}ms "
              f"{r['kv_kv_bytes'] / 1e6:>7.2f}")
    stem = write_json(out_dir, "cluster_workflow_cpu", result, **stamp)
    plt = pyplot()
    if plt is None:
        return
    xs = [r["branch_tokens"] for r in result["workflows"]]
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    for mode, label in (("kv", "KV over gRPC"), ("gloo", "KV over gloo"), ("text", "text re-prefill"),
                        ("stair", "staircase, KV over gRPC")):
        ax[0].plot(xs, [r[f"{mode}_ttft_ms"] for r in result["workflows"]], marker="o", label=label)
        ax[1].plot(xs, [r[f"{mode}_last_branch_to_first_token_ms"] for r in result["workflows"]], marker="o",
                   label=label)
    ax[0].set(xlabel="tokens per branch", ylabel="ms", title="End-to-end TTFT (workers included)")
    ax[1].set(xlabel="tokens per branch", ylabel="ms", title="Last branch token to first answer token")
    for a in ax:
        a.grid(alpha=0.3)
        a.legend()
    fig.tight_layout()
    fig.savefig(stem + ".png", dpi=110)
    print(f"wrote {stem}.json and {stem}.png")


if __name__ == "__main__":
    main()
