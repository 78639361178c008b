"""`postrain serve`: the OpenAI-compatible gateway in front of one generator, for chatting with a
policy or evaluating it with any harness that speaks the OpenAI API.

    postrain serve --model tiny --port 8000
    postrain serve --model smollm2 --host 0.0.0.0 --api-key-file ~/.postrain-key --kv-cache-mb 256
    postrain serve --model runs/r1/policy      # a run's policy, or a `postrain export` folder

    # then, from any OpenAI client:
    #   OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none").chat.completions.create(
    #       model="tiny", messages=[{"role": "user", "content": "hi"}])

It starts a generator actor and a gateway actor (postrain.actors.gateway) under a local
supervisor, prints `serving MODEL at URL/v1` and runs until interrupted (Ctrl-C). The model
id clients send is --served-model-name (default: --model as given).

With a key (--api-key, --api-key-file or $POSTRAIN_API_KEY), clients must send it as
`Authorization: Bearer KEY`; a --host other than loopback is refused without one.

With --tinker it serves the Tinker API instead (postrain.actors.tinker, docs/tinker.md): the
researcher's own loop, written with the `tinker==0.38.0` SDK, trains LoRA adapters on the base
models --model names (comma-separated, each SPEC or NAME=SPEC; default tiny) and samples them:

    postrain serve --tinker --model tiny,HuggingFaceTB/SmolLM2-135M-Instruct=smollm2 --api-key tml-local
    # then: TINKER_BASE_URL=http://127.0.0.1:8000 TINKER_API_KEY=tml-local python my_loop.py

The SDK sends its key as `X-API-Key` and only a key that starts with `tml-`. The tenant
limits (--max-training-clients-per-base, --max-queued-requests-per-session: past them a 429
with Retry-After, which the SDK retries) and idle eviction (--evict-after-s, --state-dir) are in
docs/tinker.md, "Tenants and limits". The sandbox extension (POST /api/v1/postrain/sandbox/run:
the loop's code run in nsjail, `postrain.actors.tinker.SandboxClient`) is served unless
--no-sandbox, with --sandbox-workers runs at once (docs/tinker.md, "Sandbox extension").
"""
from __future__ import annotations

import argparse
import os
import sys

HELP = "serve a model over the OpenAI API (chat completions, completions, models), or --tinker: the Tinker API"
API_KEY_ENV = "POSTRAIN_API_KEY"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="HF folder, .gguf file or built-in name (tiny, small); "
                        "required without --tinker; with --tinker a comma-separated list of SPEC or NAME=SPEC "
                        "(default tiny)")
    parser.add_argument("--tinker", action="store_true", help="serve the Tinker API (tinker==0.38.0 SDK) under /api/v1 "
                        "instead of the OpenAI API: LoRA training clients and samplers on the --model bases")
    tenants = parser.add_argument_group("--tinker tenants and limits (docs/tinker.md)")
    tenants.add_argument("--max-training-clients-per-base", type=int, default=16, metavar="N", help="LoRA training "
                         "clients resident on one base at once, evicted ones not counted; past it create_model gets "
                         "429 with Retry-After (default 16)")
    tenants.add_argument("--max-training-memory-mb-per-base", type=float, default=None, metavar="MB",
                         help="training state (LoRA weights, gradients, AdamW moments) of the resident clients of "
                         "one base, MiB; past it create_model evicts idle ones, else gets 429 (default: no limit)")
    tenants.add_argument("--max-queued-requests-per-session", type=int, default=1024, metavar="N", help="requests "
                         "of one session accepted and not yet finished; past it a request gets 429 with Retry-After "
                         "(default 1024)")
    tenants.add_argument("--evict-after-s", type=_seconds_or_never, default=600.0, metavar="S", help="a training "
                         "client idle this long, seconds, is written to --state-dir and leaves its base until its "
                         "next request restores it exactly ('never': keep every one resident; default 600)")
    tenants.add_argument("--session-timeout-s", type=_seconds_or_never, default=300.0, metavar="S",
                         help="a session with no heartbeat for S seconds (the SDK sends one every 10 s) is finished "
                         "and its training clients freed; 'never': kept until it closes (default 300)")
    tenants.add_argument("--state-dir", default=None, metavar="PATH", help="where evicted training clients are "
                         "written (default: a temporary folder, removed when the server stops)")
    tenants.add_argument("--no-batch-tenants", dest="batch_tenants", action="store_false", help="run each "
                         "training client's forward_backward in turn (default: those of one base ready together "
                         "run as one forward, each adapter on its own rows)")
    sandbox = parser.add_argument_group("--tinker sandbox extension: POST /api/v1/postrain/sandbox/run runs code in "
                                        "nsjail (docs/tinker.md)")
    sandbox.add_argument("--no-sandbox", dest="enable_sandbox", action="store_false", help="do not serve the "
                         "sandbox extension: its endpoint answers 404 (default: served, jails started at its "
                         "first run)")
    sandbox.add_argument("--sandbox-workers", type=int, default=2, metavar="N", help="warm jails, the runs at "
                         "once; past it a run gets 429 with Retry-After (default 2)")
    sandbox.add_argument("--sandbox-max-timeout-s", type=float, default=60.0, metavar="S", help="the most "
                         "timeout_s a run may ask for, seconds; a run that names none gets 10, or S if less "
                         "(default 60)")
    sandbox.add_argument("--sandbox-memory-mb", type=int, default=512, metavar="MB", help="a run's memory, MiB "
                         "(default 512)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0: a free one)")
    parser.add_argument("--served-model-name", default=None, help="the model id clients send (default: --model)")
    parser.add_argument("--kv-cache-mb", type=float, default=64, help="the generator's KV cache, MiB (default 64); "
                        "with --tinker each sampler engine's")
    parser.add_argument("--max-num-seqs", type=int, default=32, help="sequences decoded together (default 32)")
    parser.add_argument("--seed", type=int, default=0, help="init seed of a built-in config (default 0)")
    key = parser.add_mutually_exclusive_group()
    key.add_argument("--api-key", metavar="KEY", help=f"the key clients must send as `Authorization: Bearer "
                     f"KEY` (default: ${API_KEY_ENV}; required when --host is not loopback)")
    key.add_argument("--api-key-file", metavar="PATH", help="a file whose first line is the key (unlike "
                     "--api-key, not shown to other users by `ps`)")


def _seconds_or_never(value: str) -> float | None:
    if value == "never":
        return None
    try:
        return float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"want seconds (a number >= 0) or 'never', got {value!r}") from None


def tinker_options(args):
    """The TinkerOptions of these arguments; pydantic's ValidationError names a bad value."""
    from postrain.actors.tinker import TinkerOptions
    return TinkerOptions(max_training_clients_per_base=args.max_training_clients_per_base,
                         max_queued_requests_per_session=args.max_queued_requests_per_session,
                         max_training_memory_mb_per_base=args.max_training_memory_mb_per_base,
                         evict_after_s=args.evict_after_s, session_timeout_s=args.session_timeout_s,
                         state_dir=args.state_dir, batch_tenants=args.batch_tenants,
                         enable_sandbox=args.enable_sandbox, sandbox_workers=args.sandbox_workers,
                         sandbox_max_timeout_s=args.sandbox_max_timeout_s, sandbox_memory_mb=args.sandbox_memory_mb,
                         kv_cache_mb=args.kv_cache_mb)


def api_key(args) -> str | None:
    """The key clients must send: --api-key-file's first line, --api-key or $POSTRAIN_API_KEY (None:
    none is set). ApiKeyError for an unreadable file or a key that is not visible ASCII."""
    from postrain.actors.gateway.auth import check_api_key, read_api_key_file
    if args.api_key_file is not None:
        return read_api_key_file(args.api_key_file)
    if args.api_key is not None:
        return check_api_key(args.api_key, "--api-key")
    key = os.environ.get(API_KEY_ENV) or None
    return check_api_key(key, f"${API_KEY_ENV}") if key is not None else None


def specs(args, api_key: str | None = None) -> list:
    """The generator's and the gateway's ActorSpecs for these arguments; `api_key`: the key clients
    must send (None: none)."""
    from postrain.core import ActorSpec
    generator = ActorSpec(name="generator", cls="postrain.actors.generator:GeneratorActor", cpus=1, memory_mb=0,
                          start_timeout_s=300, options={"model": args.model, "kv_cache_mb": args.kv_cache_mb,
                                                        "max_num_seqs": args.max_num_seqs, "seed": args.seed})
    gateway = ActorSpec(name="gateway", cls="postrain.actors.gateway:GatewayActor", cpus=0.1, memory_mb=0,
                        start_timeout_s=300, options={"model": args.model, "generators": ["generator"],
                                                      "host": args.host, "port": args.port,
                                                      "served_model_name": args.served_model_name,
                                                      "api_key": api_key})
    return [generator, gateway]


async def serve(args, ready=None, until=None) -> None:
    """Start both actors, print where they serve, run until cancelled or until the event `until` is
    set (then the actors stop in about a second; a cancelled serve takes its stop timeouts).
    `ready(address, gateway)`, when given, is called with the GatewayAddress and the gateway actor's
    ref once serving (tests, benches)."""
    import anyio

    from postrain.actors.records import GATEWAY_ADDRESS
    from postrain.core import Supervisor

    async with Supervisor.open() as supervisor:
        for spec in specs(args, api_key(args)):
            ref = await supervisor.start(spec)
        address = await ref.call(GATEWAY_ADDRESS)
        print(f"serving {address.model} at {address.base_url}", flush=True)
        if ready is not None:
            ready(address, ref)
        await (until.wait() if until is not None else anyio.sleep_forever())


def tinker_models(args) -> list[str]:
    """The base models a --tinker server holds: --model split on commas (default: tiny)."""
    return [m.strip() for m in (args.model or "tiny").split(",") if m.strip()]


async def serve_tinker(args, api_key: str | None, options=None, ready=None, until=None) -> None:
    """Load the --model bases, serve the Tinker API, print where, run until cancelled or until the
    event `until` is set. `options`: the TinkerOptions (default: `tinker_options(args)`).
    `ready(base_url, service)`, when given, is called once serving (tests)."""
    import socket

    import trio

    from postrain.actors.tinker import BaseModels
    from postrain.actors.tinker import serve_tinker as serve_api

    bases = await trio.to_thread.run_sync(lambda: BaseModels.load(tinker_models(args), seed=args.seed))
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    sock.listen(128)
    host = f"[{args.host}]" if ":" in args.host else args.host
    base_url = f"http://{host}:{sock.getsockname()[1]}"
    async with trio.open_nursery() as nursery:
        service = await nursery.start(serve_api, bases, options or tinker_options(args), sock, api_key)
        print(f"serving the Tinker API ({', '.join(bases.names)}) at {base_url} (set TINKER_BASE_URL to it)",
              flush=True)
        if ready is not None:
            ready(base_url, service)
        await (until.wait() if until is not None else trio.sleep_forever())
        nursery.cancel_scope.cancel()


def main(args) -> int:
    import anyio

    from postrain.actors.gateway.auth import ApiKeyError, is_loopback
    from postrain.actors.models.loading import CheckpointError, check_model_spec
    from postrain.core.errors import ActorStartError

    try:
        key = api_key(args)
        if args.tinker:
            from postrain.actors.tinker.app import check_tinker_key
            key = check_tinker_key(key)
    except ApiKeyError as exc:
        print(f"postrain serve: {exc}", file=sys.stderr)
        return 2
    if key is None and not is_loopback(args.host):
        print(f"postrain serve: --host {args.host} is reachable beyond this machine, so clients must send an "
              f"API key; fix: add --api-key-file PATH (or --api-key KEY, or set {API_KEY_ENV}), or serve on "
              f"--host 127.0.0.1", file=sys.stderr)
        return 2
    if args.model is None and not args.tinker:
        print("postrain serve: --model is required (an HF folder, a .gguf file or a built-in name such as tiny); "
              "or pass --tinker to serve the Tinker API", file=sys.stderr)
        return 2
    if args.tinker:
        import importlib.util
        if importlib.util.find_spec("tinker") is None:
            print("postrain serve --tinker needs the `tinker` package (the SDK whose wire it speaks), which the "
                  "`tinker` extra installs; fix: pip install 'postrain[tinker]'", file=sys.stderr)
            return 1
        from pydantic import ValidationError
        try:
            options = tinker_options(args)
        except ValidationError as exc:
            bad = "; ".join(f"--{str(e['loc'][0]).replace('_', '-')} {e['input']!r}: {e['msg']}" for e in exc.errors())
            print(f"postrain serve: {bad}", file=sys.stderr)
            return 2
    try:
        if args.tinker:
            for spec in tinker_models(args):
                check_model_spec(spec.partition("=")[2] or spec)
            anyio.run(serve_tinker, args, key, options, backend="trio")
            return 0
        check_model_spec(args.model)
        anyio.run(serve, args, backend="trio")
    except CheckpointError as exc:
        print(f"postrain serve: --model: {exc}", file=sys.stderr)
        return 2
    except BaseException as exc:   # Ctrl-C and a failed start arrive wrapped in the nurseries' groups
        if _leaf(exc, KeyboardInterrupt) is not None:
            print("postrain serve: stopped", file=sys.stderr)
            return 0
        failed = _leaf(exc, ActorStartError)
        bind = _leaf(exc, OSError) if args.tinker else None
        if bind is not None:
            print(f"postrain serve: cannot listen on {args.host}:{args.port} ({bind}); fix: choose another "
                  f"--port (0: a free one)", file=sys.stderr)
            return 1
        if failed is None:
            raise
        lines = [line for line in str(failed).splitlines() if line.strip()]
        print(f"postrain serve: {lines[0]} {lines[-1] if len(lines) > 1 else ''}".rstrip(), file=sys.stderr)
        return 1
    return 0


def _leaf(exc: BaseException, kind: type) -> BaseException | None:
    """The first `kind` in `exc` or in its exception groups, else None."""
    if isinstance(exc, kind):
        return exc
    for inner in getattr(exc, "exceptions", ()):
        found = _leaf(inner, kind)
        if found is not None:
            return found
    return None
