"""The `braid` command line."""

import argparse
import logging
import os
import sys

DEFAULT_MODEL_DIR = os.path.join(os.path.expanduser("~"), ".cache", "braid", "random-small-llama")


def _default_model(log) -> str:
    """Until the project's trained reference model lands, the embedded default is a random-weight Llama."""
    from engine.checkpoints import make_random_checkpoint

    if not os.path.isfile(os.path.join(DEFAULT_MODEL_DIR, "config.json")):
        log.info("building a random-weight demo model in %s", DEFAULT_MODEL_DIR)
        make_random_checkpoint(DEFAULT_MODEL_DIR, "llama", "small")
    return DEFAULT_MODEL_DIR


def demo(args) -> int:
    """Parallel workers, then synthesis from their KV (cache path) and from their text (baseline)."""
    from tqdm import tqdm

    from engine import DecodeCall, Engine, EngineConfig, PrefillCall, SamplingParams
    from engine.synthesis import synthesize_stream, synthesize_text_stream

    log = logging.getLogger("braid.demo")
    path = args.model or os.environ.get("BRAID_MODEL") or _default_model(log)
    eng = Engine(EngineConfig(path, dtype=args.dtype, device=args.device))
    if path == DEFAULT_MODEL_DIR:
        print("note: random weights, so the text is noise; the timings and the data flow are real.\n")
    prefix = eng.prefill([PrefillCall(f"System: {args.branches} workers each solve part of the task.\n"
                                      "User: add up every worker's partial result.\n")])
    contexts = eng.prefill([PrefillCall(f"Worker {j}: your part is number {j * 7 + 3}.\n" + "Think. " * j,
                                        parents=prefix) for j in range(args.branches)])
    worker = SamplingParams(max_tokens=args.branch_tokens, temperature=0.8, seed=0, ignore_eos=True)
    stream = eng.decode_stream([DecodeCall("Worker:", parents=[*prefix, c], sampling=worker) for c in contexts])
    with tqdm(total=args.branches * args.branch_tokens, desc="workers decoding in parallel", unit="tok") as bar:
        for _ in stream:
            bar.update()
    branches = stream.ids
    print(f"workers: {args.branches} branches of {args.branch_tokens} tokens in "
          f"{stream.timings['first_token'] + stream.timings['decode']:.2f} s")
    answer = SamplingParams(max_tokens=args.answer_tokens, ignore_eos=True)
    results = {}
    for name, make in [("cache (re-encoded KV)", lambda: synthesize_stream(eng, branches, "Synthesizer:",
                                                                           prefix=prefix, sampling=answer)),
                       ("text re-prefill", lambda: synthesize_text_stream(eng, branches, "Synthesizer:",
                                                                          prefix=prefix, sampling=answer))]:
        s = make()
        text = "".join(e.text for e in s)
        results[name] = s.timings["first_token"]
        print(f"\n[{name}] TTFT {1e3 * s.timings['first_token']:.1f} ms\n  {text!r}")
    cache_ttft, text_ttft = results.values()
    print(f"\nsynthesis TTFT speedup, cache vs text: {text_ttft / cache_ttft:.1f}x")
    return 0


def serve_cmd(args) -> int:
    """Run the cluster on a local Ray: workers, synthesizer and the gRPC agent API."""
    import signal
    import threading

    if args.no_auth:
        os.environ["RAY_AUTH_MODE"] = "disabled"
    from cluster.config import ClusterConfig
    from cluster.local import start_local_cluster

    log = logging.getLogger("braid.serve")
    path = args.model or os.environ.get("BRAID_MODEL") or _default_model(log)
    config = ClusterConfig(path, colocate=args.colocate, worker_replicas=args.workers,
                           synthesizer_replicas=args.synthesizers,
                           kv_transport=args.kv_transport, redis_url=args.redis_url, grpc_port=args.port)
    cluster = start_local_cluster(config, num_cpus=args.num_cpus, dashboard=args.dashboard)
    try:
        print(f"braid: serving the agent API over gRPC on port {config.grpc_port} (model {path}, "
              f"redis {cluster.redis_url}); Ctrl-C stops", flush=True)
        stop = threading.Event()
        signal.signal(signal.SIGINT, lambda *_: stop.set())
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        stop.wait()
    finally:
        cluster.stop()
    return 0


def run_cmd(args) -> int:
    """Run a parallel-synthesis workflow on a running cluster and stream its events."""
    import grpc

    from protos import agent_pb2 as pb
    from protos import agent_pb2_grpc

    sampling = pb.Sampling(max_tokens=args.max_tokens, temperature=args.temperature)
    request = pb.WorkflowRequest(task=args.task, branch_prompts=args.branch, synthesis_prompt=args.prompt,
                                 worker_sampling=sampling, synthesis_sampling=sampling,
                                 transport=pb.Transport.Value(f"TRANSPORT_{args.transport.upper()}"),
                                 placement=args.placement)
    with grpc.insecure_channel(args.address) as channel:
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        try:
            for event in stub.RunWorkflow(request, metadata=(("application", "braid"),), timeout=args.timeout):
                kind = event.WhichOneof("event")
                if kind == "decision":
                    print(f"[transport] {pb.Transport.Name(event.decision.transport)}: {event.decision.reason}")
                elif kind == "branch_token" and args.show_branches:
                    print(f"[branch {event.branch_token.branch}] {event.branch_token.text!r}")
                elif kind == "kv_receipt":
                    r = event.kv_receipt
                    print(f"[kv] branch {r.branch}: {r.bytes} bytes in {r.transfer_ms:.1f} ms, "
                          f"crc32 {'ok' if r.crc32 == r.crc32_sent else 'MISMATCH'}")
                elif kind == "synthesis_token":
                    print(event.synthesis_token.text, end="", flush=True)
                elif kind == "timings":
                    t = event.timings
                    print(f"\n[timings] TTFT {t.ttft_ms:.1f} ms, last branch token to first answer token "
                          f"{t.last_branch_to_first_token_ms:.1f} ms, KV {t.kv_bytes} bytes")
                elif kind == "done":
                    print(f"[done] session {event.done.session_id}, answer {event.done.answer_message_id}")
        except grpc.RpcError as e:
            print(f"braid: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="braid", description="Braid: multi-agent LLM serving that ships KV caches.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="run the cluster on a local Ray (embedded Redis, default model)",
                       description=serve_cmd.__doc__)
    p.add_argument("--model", help="checkpoint directory (default: $BRAID_MODEL, else a random-weight demo model)")
    p.add_argument("--port", type=int, default=9000, help="gRPC port of the agent API (default: 9000)")
    p.add_argument("--redis-url", help="Redis for the control plane (default: an embedded redis-server)")
    p.add_argument("--workers", type=int, default=1, help="worker replicas (default: 1)")
    p.add_argument("--synthesizers", type=int, default=1, help="synthesizer replicas (default: 1)")
    p.add_argument("--colocate", action="store_true",
                   help="workers and synthesizer share one engine per replica (one GPU): KV is reused in place")
    p.add_argument("--kv-transport", default="auto", choices=["auto", "grpc", "text"],
                   help="ship KV or re-prefill text (default: auto, decided per request)")
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs Ray may use (default: all)")
    p.add_argument("--dashboard", action="store_true", help="start the Ray dashboard on 127.0.0.1:8265")
    p.add_argument("--no-auth", action="store_true", help="turn Ray's token authentication off (local use only)")
    p.set_defaults(func=serve_cmd)

    p = sub.add_parser("run", help="run a workflow on a running cluster and stream its events",
                       description=run_cmd.__doc__)
    p.add_argument("--address", default="127.0.0.1:9000", help="the agent API (default: 127.0.0.1:9000)")
    p.add_argument("--task", required=True, help="the shared task every worker sees")
    p.add_argument("--branch", action="append", required=True, help="one worker's instruction (repeat per worker)")
    p.add_argument("--prompt", default="Synthesizer:", help="the synthesizer's prompt (default: 'Synthesizer:')")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per worker and for the answer (default: 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: 0)")
    p.add_argument("--transport", default="unspecified", choices=["unspecified", "grpc", "text"],
                   help="force a transport (default: the cluster decides)")
    p.add_argument("--placement", default="branch_point", choices=["branch_point", "sequential"])
    p.add_argument("--show-branches", action="store_true", help="print every worker token")
    p.add_argument("--timeout", type=float, default=600, help="seconds before giving up (default: 600)")
    p.set_defaults(func=run_cmd)
    p = sub.add_parser("demo", help="run a local parallel-synthesis workflow in this process",
                       description=demo.__doc__)
    p.add_argument("--model", help="checkpoint directory (default: $BRAID_MODEL, else a random-weight demo model)")
    p.add_argument("--branches", type=int, default=4, help="parallel worker branches (default: 4)")
    p.add_argument("--branch-tokens", type=int, default=256, help="tokens each worker generates (default: 256)")
    p.add_argument("--answer-tokens", type=int, default=24, help="tokens the synthesizer generates (default: 24)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default: auto)")
    p.add_argument("--dtype", default="auto", help="float32, bfloat16, float16 or auto (default: auto)")
    p.set_defaults(func=demo)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name, value in [("--branches", getattr(args, "branches", 1)),
                        ("--branch-tokens", getattr(args, "branch_tokens", 1)),
                        ("--answer-tokens", getattr(args, "answer_tokens", 1)),
                        ("--max-tokens", getattr(args, "max_tokens", 1))]:
        if value < 1:
            parser.error(f"{name} must be >= 1, got {value}")
    try:
        return args.func(args)
    except ValueError as e:  # configuration and bad-input errors: one clear line, no traceback
        print(f"braid: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
