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
"""
from __future__ import annotations

import argparse
import os
import sys

HELP = "serve a model over the OpenAI API (chat completions, completions, models)"
API_KEY_ENV = "POSTRAIN_API_KEY"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="HF folder, .gguf file or built-in name (tiny, small)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0: a free one)")
    parser.add_argument("--served-model-name", default=None, help="the model id clients send (default: --model)")
    parser.add_argument("--kv-cache-mb", type=float, default=64, help="the generator's KV cache, MiB (default 64)")
    parser.add_argument("--max-num-seqs", type=int, default=32, help="sequences decoded together (default 32)")
    parser.add_argument("--seed", type=int, default=0, help="init seed of a built-in config (default 0)")
    key = parser.add_mutually_exclusive_group()
    key.add_argument("--api-key", metavar="KEY", help=f"the key clients must send as `Authorization: Bearer "
                     f"KEY` (default: ${API_KEY_ENV}; required when --host is not loopback)")
    key.add_argument("--api-key-file", metavar="PATH", help="a file whose first line is the key (unlike "
                     "--api-key, not shown to other users by `ps`)")


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


def main(args) -> int:
    import anyio

    from postrain.actors.gateway.auth import ApiKeyError, is_loopback
    from postrain.actors.models.loading import CheckpointError, check_model_spec
    from postrain.core.errors import ActorStartError

    try:
        key = api_key(args)
    except ApiKeyError as exc:
        print(f"postrain serve: {exc}", file=sys.stderr)
        return 2
    if key is None and not is_loopback(args.host):
        print(f"postrain serve: --host {args.host} is reachable beyond this machine, so clients must send an "
              f"API key; fix: add --api-key-file PATH (or --api-key KEY, or set {API_KEY_ENV}), or serve on "
              f"--host 127.0.0.1", file=sys.stderr)
        return 2
    try:
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
