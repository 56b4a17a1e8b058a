"""The `braid` command line."""

import argparse
import logging
import os
import sys

from braid.models import REFERENCE_MODEL

CALIBRATION_HELP = ("the synthesizer's calibration directory (braid calibrate); auto: the model's own "
                    "<model>/calibration when it has one; none: uncalibrated (default: auto)")


def _model_path(args) -> str:
    path = args.model or os.environ.get("BRAID_MODEL") or REFERENCE_MODEL
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"no checkpoint at {path}: pass --model DIR or set BRAID_MODEL")
    return path


def _ints(text: str, what: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"{what} must be comma-separated integers, got {text!r}") from None


def _length(text: str) -> tuple[int, int]:
    length = _ints(text, "--length")
    if len(length) != 2:
        raise ValueError(f"--length must be MIN,MAX, got {text!r}")
    return length


def eval_cmd(args) -> int:
    """Run the synthetic tasks through every synthesis mode; print accuracy (95% CI) and TTFT, write JSON."""

    from braid.engine import EngineConfig
    from braid.engine.config import OWN_VERIFICATION, verification_file
    from braid.evals.harness import (
        EvalConfig,
        engine_modes,
        evaluate,
        format_bands,
        format_table,
        hooked_modes,
        load_hooks,
        plot_accuracy,
        report,
        verify,
    )
    from braid.methods.calibration import fingerprints, load_engine, mode_name, served_refresh
    from braid.results import write_json_to

    if args.verification is not None:  # (checked before anything is loaded or run)
        if not args.verify:
            raise ValueError("--verification names the verification --verify records: add --verify")
        if args.verification != OWN_VERIFICATION:
            verification_file("", args.verification)  # (the name's form)
    elif args.verify:
        raise ValueError(f"--verify records a verification, by name: --verification NAME writes it beside the "
                         f"calibration (<calibration>/verifications/NAME.json), its own record left as it is, and a "
                         f"deployment trusts it with `verification: NAME`; --verification {OWN_VERIFICATION} replaces "
                         "the calibration's own record (in its manifest, trusted by default): for a calibration of "
                         "your own, not a shipped one")
    if args.verify and not 0 < args.tolerance < 1:
        raise ValueError(f"--tolerance must be in (0, 1) (a fraction of accuracy), got {args.tolerance}")
    if args.traces and args.held_out_traces < 0:
        raise ValueError(f"--held-out-traces must be >= 0 (0: every trace), got {args.held_out_traces}")
    config = EvalConfig(tasks=tuple(args.tasks.split(",")), branches=_ints(args.branches, "--branches"),
                        samples=args.samples, seed=args.seed, length=_length(args.length),
                        worker_max_tokens=args.worker_max_tokens, answer_max_tokens=args.answer_max_tokens)
    path = _model_path(args)
    engine = load_engine(EngineConfig(path, dtype=args.dtype, device=args.device, calibration=args.calibration))
    by_name = {m.name: m for m in engine_modes(engine)}
    names = list(by_name) if args.modes == "all" else args.modes.split(",")
    unknown = [m for m in names if m not in by_name]
    if unknown:
        raise ValueError(f"unknown mode(s) {', '.join(unknown)}; choose from {', '.join(by_name)}"
                         + ("" if engine.calibration else " (the calibrated modes need a calibration)"))
    modes = [by_name[m] for m in names]
    for spec in args.hooks:
        modes += hooked_modes(*load_hooks(spec, engine))
    if args.verify and args.verify_mode is None and engine.calibration is not None:
        # the mode the synthesizer serves this calibration with by default: with the refresh it was trained with
        args.verify_mode = mode_name(served_refresh(engine.calibration))
    if args.verify and (engine.calibration is None or not {"text", args.verify_mode} <= set(names)):
        raise ValueError(f"--verify compares {args.verify_mode or 'the calibrated mode'} with text: load a "
                         "calibration and run both modes")
    ran: EvalConfig | dict = config
    if args.traces:  # recorded workflows instead of synthetic tasks (those calibrate --traces held out, by default)
        from braid.evals.harness import evaluate_traces, traces_config
        from braid.models.chat import WORKER_HEADER
        from braid.models.traces import load_trace_workflows, split

        files = args.traces.split(",")
        workflows = load_trace_workflows(files, engine.lm.tokenizer, engine.fingerprint, WORKER_HEADER, path)
        workflows = split(workflows, args.held_out_traces)[1] if args.held_out_traces else workflows
        if not workflows:
            raise ValueError(f"no workflow in {args.traces} is held out with --held-out-traces "
                             f"{args.held_out_traces}: record more traces, or give a smaller N (the one braid "
                             "calibrate --traces held out with)")
        ran = traces_config(config, files, args.held_out_traces, workflows)
        results = evaluate_traces(engine, workflows, config, modes)
    else:
        results = evaluate(engine, config, modes)
    out = report(ran, path, engine.fingerprint, modes, results)
    print(format_table(out["summary"]))
    if args.verify:
        # the longest branch it was checked on: `auto` ships KV only for requests whose branches cannot be longer
        calibration = engine.calibration.record
        verified = next(m for m in modes if m.name == args.verify_mode).synthesis
        # (what was verified: where its mode placed the branches, and on which weights)
        referenced = [r.reference_correct for r in results if r.reference_correct is not None]
        checked = ({"traces": args.traces.split(","), "held_out_traces": args.held_out_traces,
                    "held_out": ran["held_out"],
                    # (text's own accuracy where traces carry reference answers: agreeing with it counts for little
                    # where it is low)
                    "text_reference_accuracy": sum(referenced) / len(referenced) if referenced else None}
                   if args.traces else {"seed": config.seed, "length": list(config.length)})
        verification = {**verify(results, args.verify_mode, args.tolerance), **checked,
                        "max_branch_tokens": max(t for r in results for t in r.branch_tokens),
                        "placement": verified.placement.value if verified.placement else "",
                        "calibration": calibration.digest,
                        "base_fingerprint": engine.fingerprint}
        out["verification"], out["verification_name"] = verification, args.verification
        recorded_at = calibration.record_verification(verification, args.verification)
        print(f"\n{format_bands(verification)}")
        short = [b for b in verification["bands"] if not b["verifiable"]]
        if short:
            print(f"  (bands of fewer than {verification['needed_per_band']} samples cannot pass even with every "
                  f"answer agreeing: evaluate more{' traces' if args.traces else ' --samples'})")
        print(f"{args.verify_mode} is verified up to {verification['max_branches']} branches; recorded as "
              f"verification {args.verification!r} in {recorded_at}"
              + ("" if args.verification == OWN_VERIFICATION else
                 f" (a deployment trusts it with `verification: {args.verification}`)"))
    if args.json:
        stem = write_json_to(args.json, out, device=str(engine.lm.device), **fingerprints(engine))
        plot_accuracy(out["summary"], stem + ".png")
        print(f"\nwrote {args.json} and its plot")
    return 0


def demo(args) -> int:
    """One synthetic task: workers in parallel, then the answer synthesized in every mode, text and cached KV."""
    from braid.engine import EngineConfig
    from braid.evals.harness import EvalConfig, engine_modes, run_task
    from braid.methods.calibration import load_engine, mode_name, served_refresh
    from braid.models.tasks import generate

    length = _length(args.length)
    task = generate(args.task, args.seed, args.branches, length)
    engine = load_engine(EngineConfig(_model_path(args), dtype=args.dtype, device=args.device,
                                      calibration=args.calibration))
    # the calibrated cache path as served (with the refresh it was trained with), and without the refresh; the
    # ablations and the other placement are braid eval's
    served = mode_name(served_refresh(engine.calibration)) if engine.calibration is not None else None
    modes = [m for m in engine_modes(engine) if m.name in ("calibrated", served) or not m.name.startswith("calibrated")]
    result = run_task(engine, task, modes, EvalConfig(tasks=(task.name,), branches=(args.branches,),
                                                           length=length))
    print(f"task {task.name} (seed {task.seed}): {task.system}")
    for j, (branch, said) in enumerate(zip(task.branches, result.worker_outputs)):
        print(f"  branch {j}: {branch.context}" + (f"\n     worker: {said.strip()}" if branch.output else ""))
    print(f"question: {task.question}  expected: {task.answer}\n")
    width = max(len(m.name) for m in modes)
    for mode in modes:
        print(f"  {mode.name:<{width}} {'right' if result.correct[mode.name] else 'wrong':<6} "
              f"TTFT {1e3 * result.ttft[mode.name]:6.1f} ms   {result.answers[mode.name].strip()!r}"
              + ("   (served)" if mode.name == served else ""))
    return 0


def _serve_keys(args) -> tuple[str | None, str | None, str]:
    """The API keys `braid serve` takes: (the cluster's key file, the key it made, how the banner says it). Keys
    given (--api-keys-file, $BRAID_API_KEYS) are used as they are; with none it makes one and leaves it for this
    machine's clients (api.auth.make_local_key), unless --open-api serves everyone without a key."""
    from braid.api.auth import ENV_CLIENT_KEY, ENV_KEYS, ApiKeys, make_local_key

    given = " and ".join(([args.api_keys_file] if args.api_keys_file else [])
                         + ([f"${ENV_KEYS}"] if os.environ.get(ENV_KEYS) else []))
    if args.open_api:
        if given:
            raise ValueError(f"--open-api serves the agent API without keys, but keys are given ({given}): drop "
                             "one or the other")
        return None, None, (f"none (--open-api): anyone who can reach port {args.port} can run workflows and "
                            "read sessions")
    if given:
        ApiKeys.load(args.api_keys_file)  # (refused here, in one line, rather than in a replica)
        return args.api_keys_file, None, f"from {given}; every call needs one (--api-key or ${ENV_CLIENT_KEY})"
    key, path = make_local_key(args.port)
    return path, key, (f"{key}\n               every call needs it: braid run and braid loadtest on this machine read "
                       f"it from {path}; elsewhere give --api-key or ${ENV_CLIENT_KEY}")


def serve_cmd(args) -> int:
    """Run the cluster on a local Ray: workers, synthesizer and the gRPC agent API. Every call needs an API key:
    the ones given, or one it makes and prints (--open-api: none)."""
    import signal
    import threading

    if args.no_auth:
        os.environ["RAY_AUTH_MODE"] = "disabled"
    from braid.api.auth import drop_local_key
    from braid.cluster.config import ClusterConfig
    from braid.cluster.listen import check_host, reach
    from braid.cluster.local import APP, start_local_cluster

    check_host(args.host)  # (refused here, in one line, before Ray starts)
    path = _model_path(args)
    keys_file, made, keys = _serve_keys(args)
    try:
        config = ClusterConfig(path, colocate=args.colocate, worker_replicas=args.workers,
                               synthesizer_replicas=args.synthesizers,
                               kv_transport=args.kv_transport, redis_url=args.redis_url, grpc_port=args.port,
                               calibration=args.calibration, verification=args.verification,
                               api_keys_file=keys_file, record_dir=args.record or "")
        cluster = start_local_cluster(config, num_cpus=args.num_cpus, dashboard=args.dashboard, host=args.host)
        try:
            print(f"braid: agent API (gRPC, braid.v1.AgentService, metadata application={APP}) on "
                  f"{reach(cluster.host)}, "
                  f"{cluster.listen_address} (from this machine: {cluster.address})\n"
                  f"  api key      {keys}\n"
                  f"  model        {path}\n  calibration  {config.engine_config().resolved().calibration}\n"
                  f"  redis        {cluster.redis_url}\n"
                  f"  dashboard    {cluster.dashboard_url or 'off (--dashboard starts it)'}\n"
                  f"  metrics      {cluster.metrics_url or 'unknown'} "
                  "(Prometheus text, braid metrics prefixed ray_braid_)\n"
                  "Ctrl-C stops", flush=True)
            stop = threading.Event()
            signal.signal(signal.SIGINT, lambda *_: stop.set())
            signal.signal(signal.SIGTERM, lambda *_: stop.set())
            stop.wait()
        finally:
            cluster.stop()
    finally:
        if made:
            drop_local_key(args.port, made)
    return 0


def serve_config_cmd(args) -> int:
    """Print Ray Serve's deploy config for a cluster config: what `serve deploy` runs on any Ray cluster, and
    the `serveConfigV2` the Helm chart renders into its RayService."""
    import json

    import yaml

    from braid.cluster.config import ClusterConfig
    from braid.cluster.deploy import serve_config

    if args.json_schema:
        print(json.dumps(ClusterConfig.json_schema(), indent=2))
        return 0
    values = {}
    if args.config:
        with open(args.config) as f:
            values = yaml.safe_load(f) or {}
        if not isinstance(values, dict):
            raise ValueError(f"{args.config} must hold a mapping of cluster config fields")
    for item in args.set:
        name, sep, text = item.partition("=")
        if not sep:
            raise ValueError(f"--set takes NAME=VALUE, got {item!r}")
        values[name] = yaml.safe_load(text)
    out = serve_config(values)
    print(json.dumps(out, indent=2) if args.format == "json" else yaml.safe_dump(out, sort_keys=False), end="")
    return 0


def notes_request(args, sampling, output: str, stair):
    """A preset over the workers' own notes (methods.dag.presets.notes_graph, the shape the reference model's
    workflows take) as a RunGraph request in chat messages: --task the system message, each --branch one solver's
    notes (a user message) and --prompt the question the last node answers; the server renders them with the
    model's template. The graph is built once with placeholders and each placeholder becomes its messages."""
    import dataclasses

    from braid.methods.dag.presets import notes_graph
    from braid.protos import agent_pb2 as pb
    from braid.runtime.convert import graph_request

    if args.preset == "moa":
        raise ValueError("--preset moa takes --question (it has no form over the workers' notes); over notes use "
                         "tot, mad-iter or mad-par")
    if not args.prompt:
        raise ValueError(f"--preset {args.preset} over notes needs --prompt: the question its last node answers")
    notes = [f"\0notes{j}" for j in range(len(args.branch))]
    graph = notes_graph(args.preset, "\0system", notes, "\0header", "\0final", solver=sampling, final=sampling,
                        output=output, staircase=stair is not None)
    if stair is not None:
        graph = dataclasses.replace(graph, variant=stair)
    chat = {"\0system": ([pb.ChatMessage(role="system", content=args.task)], ""),
            "\0final": ([pb.ChatMessage(role="user", content=args.prompt)], "synthesizer"),
            "\0header": ([], "worker"),
            **{n: ([pb.ChatMessage(role="user", content=b)], "") for n, b in zip(notes, args.branch)}}
    request = graph_request(graph)
    for node in request.nodes:
        messages, node.reply_role = chat[node.prompt]
        node.prompt = ""
        node.messages.extend(messages)
    return request


def run_preset(stub, args, metadata) -> None:
    """A preset agent workflow (methods.dag.presets) as RunGraph DAGs; each node's reply printed as it ends."""
    from braid.engine import SamplingParams
    from braid.methods.dag.presets import count_votes, mad_iter, mad_par, moa, tot, tot_final
    from braid.methods.staircase import Variant
    from braid.runtime.convert import graph_request

    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    output = "text" if args.transport == "text" else "kv"
    stair = Variant(args.staircase) if args.staircase else None
    if stair is not None and args.preset == "mad-iter":
        raise ValueError("--staircase: mad-iter has no staircase (each turn reads every earlier turn); use it "
                         "with mad-par, tot or moa")
    shape = {"--rounds": args.rounds, "--agents": args.agents, "--voters": args.voters}
    if not args.question:
        given = [name for name, value in shape.items() if value is not None]
        if given:
            raise ValueError(f"{', '.join(given)}: a preset over notes has a solver per --branch and its own "
                             "rounds; these shape the --question presets only")
        request = notes_request(args, sampling, output, stair)
    else:
        args.rounds, args.agents, args.voters = args.rounds or 3, args.agents or 3, args.voters or 2
        free = {"mad-iter": lambda: mad_iter(args.question, args.rounds, sampling, output),
                "mad-par": lambda: mad_par(args.question, args.agents, args.rounds, sampling, output, stair),
                "tot": lambda: tot(args.question, args.agents, args.voters, sampling, output, stair),
                "moa": lambda: moa(args.question, args.agents, args.rounds, sampling, output, stair)}
        request = graph_request(free[args.preset]())

    def run(request) -> tuple[str, dict]:
        outputs, session = {}, ""
        for event in stub.RunGraph(request, metadata=metadata, timeout=args.timeout):
            kind = event.WhichOneof("event")
            if kind == "token" and args.show_branches:
                print(f"[{event.token.node}] {event.token.text!r}")
            elif kind == "round" and args.show_branches:
                took = ", ".join(f"{c.parent} {c.start}-{c.end}" for c in event.round.chunks)
                print(f"[{event.round.node}] round {event.round.round} took in: {took or 'nothing new'}")
            elif kind == "node_done":
                d = event.node_done
                outputs[d.node] = d
                if d.text:
                    note = f" (read re-encoded: {', '.join(d.reencoded)})" if d.reencoded else ""
                    where = f" on {d.replica}" if d.replica and args.show_branches else ""
                    print(f"[{d.node}{where}]{note} {d.text.strip()}")
            elif kind == "done":
                session = event.done.session_id
                print(f"[done] session {session} in {event.done.seconds:.2f} s")
        return session, outputs

    session, outputs = run(request)
    if args.preset == "tot" and args.question:
        votes = [outputs[f"voter{j}"].text for j in range(args.voters)]
        winner = count_votes(votes, args.agents)
        print(f"[votes] solution {winner} wins")
        run(graph_request(tot_final(outputs["solve"].message_id, outputs["problem"].message_id,
                                    outputs[f"solution{winner}"].message_id, sampling), session))


def run_cmd(args) -> int:
    """Run a workflow on a running cluster and stream its events: a parallel-synthesis workflow (workers, then
    a synthesizer), or with --preset one of Prompt Choreography's agent workflows as RunGraph DAGs."""
    import grpc

    from braid.api.auth import client_credentials, client_key, client_metadata
    from braid.protos import agent_pb2 as pb
    from braid.protos import agent_pb2_grpc

    if args.preset and not (bool(args.question) ^ bool(args.task and args.branch)):
        raise ValueError("--preset runs over the workers' notes (--task, a --branch per solver and --prompt: the "
                         "reference model's workflows) or on a free-form --question (a general chat model's): give "
                         "one of the two")
    if not args.preset and not (args.task and args.branch):
        raise ValueError("a workflow needs --task and at least one --branch (or use --preset)")
    if args.preset:
        credentials = client_credentials(args.tls, args.ca_cert)
        channel = grpc.secure_channel(args.address, credentials) if credentials else \
            grpc.insecure_channel(args.address)
        with channel:
            try:
                run_preset(agent_pb2_grpc.AgentServiceStub(channel), args,
                           (("application", "braid"),
                            *client_metadata(client_key(args.api_key, args.address), args.timeout)))
            except grpc.RpcError as e:
                print(f"braid: {e.code().name}: {e.details()}", file=sys.stderr)
                return 1
        return 0
    sampling = pb.Sampling(max_tokens=args.max_tokens, temperature=args.temperature)
    request = pb.WorkflowRequest(worker_sampling=sampling, synthesis_sampling=sampling,
                                 transport=pb.Transport.Value(f"TRANSPORT_{args.transport.upper()}"),
                                 placement=args.placement or "")
    if args.raw:  # strings the model reads as they are (its role tokens written in by the user)
        request.task, request.synthesis_prompt = args.task, args.prompt or "<|synthesizer|>"
        request.branch_prompts.extend(args.branch)
    else:  # plain content, rendered by the server with the model's own chat template
        request.task_messages.add(role="system", content=args.task)
        for b in args.branch:
            request.branch_messages.add().messages.add(role="user", content=b)
        if args.prompt:
            request.synthesis_messages.add(role="user", content=args.prompt)
    if args.staircase:
        request.staircase.CopyFrom(pb.StaircaseOptions(variant=args.staircase))
    credentials = client_credentials(args.tls, args.ca_cert)
    channel = grpc.secure_channel(args.address, credentials) if credentials else grpc.insecure_channel(args.address)
    with channel:
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        try:
            metadata = (("application", "braid"), *client_metadata(client_key(args.api_key, args.address),
                                                                   args.timeout))
            for event in stub.RunWorkflow(request, metadata=metadata, timeout=args.timeout):
                kind = event.WhichOneof("event")
                if kind == "decision":
                    print(f"[transport] {pb.Transport.Name(event.decision.transport)}: {event.decision.reason}")
                elif kind == "branch_token" and args.show_branches:
                    print(f"[branch {event.branch_token.branch}] {event.branch_token.text!r}")
                elif kind == "round" and args.show_branches:
                    took = ", ".join(f"branch {c.branch} {c.start}-{c.end}" for c in event.round.chunks)
                    print(f"\n[round {event.round.round}] took in: {took or 'nothing new'}")
                elif kind == "branch_failed":
                    print(f"\n[branch {event.branch_failed.branch} lost] {event.branch_failed.reason}; the answer "
                          f"goes on with the others", file=sys.stderr)
                elif kind == "kv_receipt":
                    r = event.kv_receipt
                    how = pb.Transport.Name(r.transport).removeprefix("TRANSPORT_").lower()
                    print(f"[kv] branch {r.branch}: {r.bytes} bytes over {how} in {r.transfer_ms:.1f} ms, "
                          f"chunk digest {'ok' if r.crc32 == r.crc32_sent else 'MISMATCH'}")
                elif kind == "synthesis_token":
                    print(event.synthesis_token.text, end="", flush=True)
                elif kind == "timings":
                    t = event.timings
                    print(f"\n[timings] TTFT {t.ttft_ms:.1f} ms, last branch token to first answer token "
                          f"{t.last_branch_to_first_token_ms:.1f} ms, KV {t.kv_bytes} bytes")
                elif kind == "done":
                    d = event.done
                    if d.text_branches and len(d.text_branches) < len(request.branch_prompts or
                                                                      request.branch_messages):
                        print(f"[text] branches {', '.join(map(str, d.text_branches))} read from their text at "
                              "synthesis (longer than the calibration was verified on); the rest from KV")
                    print(f"[done] session {d.session_id}, answer {d.answer_message_id}")
        except grpc.RpcError as e:
            hint = ("; send pre-formatted strings with --raw" if not args.raw and "chat template" in (e.details() or "")
                    else "")
            print(f"braid: {e.code().name}: {e.details()}{hint}", file=sys.stderr)
            return 1
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    trainers = {"calibrate": "braid.train.calibrate", "calibrate-turns": "braid.train.turns"}
    if argv[:1] and argv[0] in trainers:  # the trainer's own parser (it imports torch; other commands stay light)
        import importlib

        try:
            return importlib.import_module(trainers[argv[0]]).main(argv[1:], prog=f"braid {argv[0]}")
        except ValueError as e:
            print(f"braid: error: {e}", file=sys.stderr)
            return 2
    if argv[:1] == ["loadtest"]:  # its own parser, like calibrate
        from braid.loadtest.run import main as loadtest_main

        return loadtest_main(argv[1:])
    parser = argparse.ArgumentParser(prog="braid", description="Braid: multi-agent LLM serving that ships KV caches.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)
    from braid.protos import agent_pb2  # (the API's Transport values: the one list of them)

    transports = [name.removeprefix("TRANSPORT_").lower() for name in agent_pb2.Transport.keys()]
    p = sub.add_parser("serve", help="run the cluster on a local Ray (embedded Redis, default model)",
                       description=serve_cmd.__doc__)
    p.add_argument("--model", help="checkpoint directory (default: $BRAID_MODEL, else the reference model)")
    p.add_argument("--port", type=int, default=9000, help="gRPC port of the agent API (default: 9000)")
    p.add_argument("--host", default="127.0.0.1",
                   help="the address the agent API listens on: 0.0.0.0 (or ::) for every interface, IPv4 and IPv6 "
                        "(default: 127.0.0.1, this machine only)")
    p.add_argument("--redis-url", help="Redis for the control plane (default: an embedded redis-server)")
    p.add_argument("--workers", type=int, default=1, help="worker replicas (default: 1)")
    p.add_argument("--synthesizers", type=int, default=1, help="synthesizer replicas (default: 1)")
    p.add_argument("--colocate", action="store_true",
                   help="workers and synthesizer share one engine per replica (one GPU): KV is reused in place")
    p.add_argument("--kv-transport", default="auto",
                   choices=["auto", *(t for t in transports if t not in ("unspecified", "local"))],
                   help="ship KV (grpc; collective: a gloo link on CPU, NCCL between GPUs) or re-prefill text, for "
                        "every request (default: auto, decided per request; colocated replicas reuse KV in place)")
    p.add_argument("--calibration", default="auto", help=CALIBRATION_HELP)
    p.add_argument("--verification", default="own",
                   help="which verification of the calibration `auto` transport trusts: own (its manifest's) or a "
                        "NAME that braid eval --verify --verification NAME recorded beside it (default: own)")
    p.add_argument("--record", metavar="DIR",
                   help="record every RunWorkflow and RunGraph served, one JSON line each (requests, replies, answers; "
                        "no keys), in DIR/traces-*.jsonl: traces for braid calibrate, eval and loadtest --traces "
                        "(default: off)")
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs Ray may use (default: all)")
    p.add_argument("--dashboard", action="store_true", help="start the Ray dashboard on 127.0.0.1:8265")
    p.add_argument("--no-auth", action="store_true", help="turn Ray's token authentication off (local use only)")
    p.add_argument("--api-keys-file",
                   help="the API keys the agent API takes, one [name:]key per line (also $BRAID_API_KEYS; default: "
                        "none given, so it makes one, prints it and leaves it in ~/.braid/api-key-PORT, where "
                        "braid run and braid loadtest on this machine find it)")
    p.add_argument("--open-api", action="store_true",
                   help="serve the agent API without keys: anyone who can reach the port (see --host) can run "
                        "workflows and read sessions")
    p.set_defaults(func=serve_cmd)

    p = sub.add_parser("run", help="run a workflow on a running cluster and stream its events",
                       description=run_cmd.__doc__)
    p.add_argument("--address", default="127.0.0.1:9000", help="the agent API (default: 127.0.0.1:9000)")
    p.add_argument("--task", help="the shared task every worker sees (a system message)")
    p.add_argument("--branch", action="append", help="one worker's instruction (a user message; repeat per worker)")
    p.add_argument("--preset", choices=["mad-iter", "mad-par", "tot", "moa"],
                   help="instead, an agent workflow as a RunGraph DAG: iterative debate, parallel debate, tree of "
                        "thoughts, or mixture-of-agents (--transport text: its text re-prefill baseline). With "
                        "--task, a --branch per solver (its notes) and --prompt, the solvers reply from their notes "
                        "and a last node answers (the reference model's workflows; not moa); with --question, a "
                        "free-form debate for a general chat model")
    p.add_argument("--question", help="the free-form question a --preset workflow works on (a general chat model: "
                                      "the reference model answers only over notes)")
    p.add_argument("--rounds", type=int,
                   help="--preset with --question, mad-iter/mad-par: debate rounds; moa: proposer layers (default: 3)")
    p.add_argument("--agents", type=int,
                   help="--preset with --question, mad-par: agents; tot: solutions; moa: proposers per layer "
                        "(default: 3)")
    p.add_argument("--voters", type=int, help="--preset tot with --question: voters (default: 2)")
    p.add_argument("--staircase", choices=["reprefill", "append"],
                   help="answer from the first chunks of what is read (Staircase Streaming), in this variant: the "
                        "synthesizer from the workers' KV as it arrives (needs --transport grpc or collective "
                        "between separate replicas), or with --preset mad-par/tot/moa, the readers of each "
                        "stage (default: wait for whole replies)")
    p.add_argument("--prompt", default="",
                   help="the synthesizer's question after the workers' replies (a user message; default: none, the "
                        "synthesizer answers right after them)")
    p.add_argument("--raw", action="store_true",
                   help="send --task, --branch and --prompt as pre-formatted strings, the model's role tokens "
                        "written in (--prompt default: '<|synthesizer|>', the reference model's answer role); "
                        "without it they are plain content, rendered with the model's chat template")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per worker and for the answer (default: 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: 0)")
    p.add_argument("--transport", default="unspecified",
                   choices=transports,
                   help="force a transport (default: the cluster decides)")
    p.add_argument("--placement", choices=["branch_point", "sequential", "mixed", "none"],
                   help="where the branches' KV goes (default: the synthesizer's, its calibration's placement)")
    p.add_argument("--show-branches", action="store_true", help="print every worker token")
    p.add_argument("--timeout", type=float, default=600, help="seconds before giving up (default: 600)")
    p.add_argument("--api-key", help="the API key to send (default: $BRAID_API_KEY, else for an address on this "
                                     "machine the key braid serve made, ~/.braid/api-key-PORT)")
    p.add_argument("--tls", action="store_true", help="connect over TLS (an Ingress that terminates it)")
    p.add_argument("--ca-cert", help="PEM file of the CA to trust for --tls (default: the system's roots)")
    p.set_defaults(func=run_cmd)

    p = sub.add_parser("serve-config", help="print Ray Serve's deploy config (serveConfigV2) for a cluster config",
                       description=serve_config_cmd.__doc__)
    p.add_argument("--config", help="a YAML or JSON file of cluster config fields (braid.cluster.config)")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="set one field, its value read as YAML (repeatable; after --config)")
    p.add_argument("--format", default="yaml", choices=["yaml", "json"], help="output format (default: yaml)")
    p.add_argument("--json-schema", action="store_true", help="print the JSON Schema of the cluster config instead")
    p.set_defaults(func=serve_config_cmd)
    p = sub.add_parser("eval", help="measure answer quality and TTFT of every synthesis mode on synthetic tasks",
                       description=eval_cmd.__doc__)
    p.add_argument("--model", help="checkpoint directory (default: $BRAID_MODEL, else the reference model)")
    p.add_argument("--tasks", default="chain,vote,trail,multiqa", help="comma-separated (default: all four)")
    p.add_argument("--branches", default="2,3,4,5,6,7,8", help="branch counts (default: 2,3,4,5,6,7,8)")
    p.add_argument("--samples", type=int, default=100, help="tasks per task and branch count (default: 100)")
    p.add_argument("--seed", type=int, default=0, help="first task seed (default: 0)")
    p.add_argument("--length", default="2,6", help="MIN,MAX size of each branch's work, up to 12 (default: 2,6)")
    p.add_argument("--worker-max-tokens", type=int, default=48, help="cap on each worker's reply (default: 48)")
    p.add_argument("--answer-max-tokens", type=int, default=160, help="cap on the synthesizer's answer (default: 160)")
    p.add_argument("--calibration", default="auto", help=CALIBRATION_HELP)
    p.add_argument("--modes", default="all",
                   help="comma-separated synthesis modes: text, cache:none, cache:branch_point, cache:sequential, "
                        "cache:sequential+refresh (each branch's first and last token re-encoded with the earlier "
                        "branches in view), cache:mixed (branches encoded apart right after the prefix kept at the "
                        "branch point, the others end to end), cache:mixed+refresh (and refreshed), "
                        "the staircase modes staircase-reprefill:text, staircase-append:text, staircase-reprefill:kv, "
                        "staircase-append:kv, staircase-reprefill:kv+refresh, staircase-append:kv+refresh and, with a "
                        "calibration, calibrated, calibrated+refresh (or calibrated+refresh<head>-<tail>: the "
                        "refresh it was trained with, when that is not a token at each end), "
                        "staircase-reprefill:calibrated+refresh, staircase-append:calibrated+refresh, "
                        "calibrated:<other placement> and the ablations calibrated-no-reencode, calibrated-no-mapper, "
                        "calibrated-no-lora (default: all)")
    p.add_argument("--hooks", action="append", default=[], metavar="NAME=MODULE:FACTORY",
                   help="add the cached modes again through factory(engine) -> SynthesisHooks (repeatable)")
    p.add_argument("--verify", action="store_true",
                   help="record up to which branch count the calibration's answers match text's, by a paired "
                        "one-sided 95%% bound over branch-count bands (docs/calibration.md); `auto` transport ships "
                        "KV only up to there. Needs --verification")
    p.add_argument("--verification", metavar="NAME",
                   help="with --verify, the name it records under: NAME, in <calibration>/verifications/NAME.json "
                        "beside the calibration (its own record left as it is; a deployment trusts it with its "
                        "`verification: NAME` setting); own: the calibration's own record, in its manifest, which "
                        "deployments trust by default (replaces it: for a calibration of your own)")
    p.add_argument("--verify-mode", default=None,
                   help="the mode --verify checks: the one the synthesizer serves (default: the calibration with "
                        "the boundary refresh it was trained with, as an unset refresh_tokens serves it: "
                        "calibrated+refresh for a token at each end, calibrated for none)")
    p.add_argument("--tolerance", type=float, default=0.02,
                   help="how far below text (accuracy, as a fraction) --verify lets each band's paired lower bound "
                        "go, on every task (default: 0.02; a band then needs at least 149 samples per task)")
    p.add_argument("--traces", metavar="FILE[,FILE]",
                   help="evaluate recorded workflows (braid serve --record) instead of synthetic tasks: every mode "
                        "is held to the text pipeline's answer on the same branches; text's own accuracy against the "
                        "traces' reference answers, where they carry one, is reported beside it")
    p.add_argument("--held-out-traces", type=int, default=10,
                   help="with --traces: evaluate only the traces braid calibrate --traces held out with the same N: "
                        "about one in N of each kind (branch count and task), by a hash of each workflow "
                        "(models.traces.split; 0: all of them; default: 10)")
    p.add_argument("--json", help="write the table and every answer to this JSON file, and a plot beside it")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default: auto)")
    p.add_argument("--dtype", default="auto", help="float32, bfloat16, float16 or auto (default: auto)")
    p.set_defaults(func=eval_cmd)
    p = sub.add_parser("demo", help="run a local parallel-synthesis workflow in this process",
                       description=demo.__doc__)
    p.add_argument("--model", help="checkpoint directory (default: $BRAID_MODEL, else the reference model)")
    p.add_argument("--task", default="chain", choices=["chain", "vote", "trail", "multiqa"],
                   help="which synthetic task (default: chain)")
    p.add_argument("--branches", type=int, default=4, help="parallel worker branches, 2..12 (default: 4)")
    p.add_argument("--length", default="2,6", help="MIN,MAX size of each branch's work, up to 12 (default: 2,6)")
    p.add_argument("--seed", type=int, default=0, help="task seed (default: 0)")
    p.add_argument("--calibration", default="auto", help=CALIBRATION_HELP)
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default: auto)")
    p.add_argument("--dtype", default="auto", help="float32, bfloat16, float16 or auto (default: auto)")
    p.set_defaults(func=demo)
    # (listed here for --help; its options live with the trainer, which `braid calibrate ...` runs directly)
    sub.add_parser("calibrate", help="train a cache mapper and synthesizer LoRA for a model (Parallel-Synthesis); "
                                     "braid calibrate --help lists its options", add_help=False)
    sub.add_parser("calibrate-turns", help="train the calibration's turn LoRA: debaters that speak after other "
                                           "agents' cached replies (Prompt Choreography's fine-tuning; --help lists "
                                           "its options)", add_help=False)
    sub.add_parser("loadtest", help="drive a running agent API with a workflow mix; TTFT, TPOT, ITL, E2EL, "
                                    "throughput and goodput (braid loadtest --help)", add_help=False)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name, value in [("--branches", getattr(args, "branches", 1)), ("--max-tokens", getattr(args, "max_tokens", 1))]:
        if isinstance(value, int) and value < 1:
            parser.error(f"{name} must be >= 1, got {value}")
    try:
        return args.func(args)
    except ValueError as e:  # configuration and bad-input errors: one clear line, no traceback
        print(f"braid: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
