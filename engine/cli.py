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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="braid", description="Braid: multi-agent LLM serving that ships KV caches.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)
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
    for name, value in [("--branches", getattr(args, "branches", 1)), ("--branch-tokens", getattr(args, "branch_tokens", 1)),
                        ("--answer-tokens", getattr(args, "answer_tokens", 1))]:
        if value < 1:
            parser.error(f"{name} must be >= 1, got {value}")
    try:
        return args.func(args)
    except ValueError as e:  # configuration and bad-input errors: one clear line, no traceback
        print(f"braid: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
