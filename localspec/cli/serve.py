"""``localspec serve``: the pair behind an OpenAI-compatible HTTP API."""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys

from .common import add_draft_options, add_model_options, engine_spec


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("serve", help="serve the pair over an OpenAI-compatible HTTP API",
                       description="Loads the pair once and answers /v1/chat/completions, "
                                   "/v1/completions and /v1/models (streaming or not), plus "
                                   "/health and /metrics. Requests queue for the one engine.")
    p.add_argument("pair", nargs="?", help="pair name (or use --target/--draft)")
    add_model_options(p)
    add_draft_options(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1: this machine only)")
    g.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    g.add_argument("--api-key", default=os.environ.get("LOCALSPEC_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (default: $LOCALSPEC_API_KEY)")
    g.add_argument("--model-name", default=None,
                   help="the model id clients see (default: the pair name or the target's)")
    g.add_argument("--queue-size", type=int, default=16,
                   help="requests that may wait for the engine; more get 429 (default 16)")
    g.add_argument("--max-tokens-limit", type=int, default=4096,
                   help="largest max_tokens a request may ask for (default 4096)")
    g.add_argument("--max-body-bytes", type=int, default=1 << 20,
                   help="largest request body in bytes (default 1 MiB)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # Deferred: the engine (llama_cpp) and the HTTP stack load only when serving.
    from ..engine import DraftSettings
    from ..loading import load_engine
    from ..models.names import display_name
    from ..server import ServerConfig
    from ..server.app import create_app
    from ..server.running import serve

    spec = engine_spec(args, args.pair)
    model_id = args.model_name or spec.pair_name or display_name(spec.target)
    config = ServerConfig(
        model_id=model_id,
        aliases=tuple(n for n in (spec.pair_name, display_name(spec.target)) if n),
        api_key=args.api_key or None, queue_size=args.queue_size,
        max_tokens_limit=args.max_tokens_limit, max_body_bytes=args.max_body_bytes,
        draft=DraftSettings(mode=spec.draft_mode, k=args.draft_k,  # type: ignore[arg-type]
                            k_max=args.k_max, rule=args.accept_rule))
    config.validate()
    if not _is_loopback(args.host) and not config.api_key:
        print(f"localspec: warning: serving on {args.host} without --api-key: anyone who can "
              "reach this port can use the model", file=sys.stderr)
    print(f"localspec: loading {spec.display_name} ...", file=sys.stderr)
    engine = load_engine(spec)
    try:
        config.draft.validate(engine.draft is not None)
        app = create_app(engine, config)
        print(f"localspec: serving '{model_id}' at http://{_url_host(args.host)}:{args.port}/v1 "
              "(Ctrl-C to stop)", file=sys.stderr)
        serve(app, args.host, args.port)
    finally:
        engine.close()
    return 0


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
