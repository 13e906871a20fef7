"""The engine process itself: ``python -m localspec.server.engine_child`` (started by
``EngineProcess``, never by hand). It loads the pair and serves localspec's API on a private
unix socket, reporting what its engine is doing into the shared activity board."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="localspec-engine")
    ap.add_argument("--socket", required=True)
    ap.add_argument("--activity", required=True)
    ap.add_argument("--config", required=True)
    ap.add_argument("--log-file")
    # Named by the parent, not read here with getppid(): by the time this process looks, a
    # parent killed meanwhile has been replaced by init, and that one never goes away.
    ap.add_argument("--parent", type=int, required=True)
    args = ap.parse_args(argv)
    handler: logging.Handler = (logging.FileHandler(args.log_file, encoding="utf-8")
                                if args.log_file else logging.StreamHandler(sys.stderr))
    handler.setFormatter(logging.Formatter("%(asctime)s engine %(levelname)s %(name)s: "
                                           "%(message)s"))
    logging.basicConfig(level=logging.INFO if args.log_file else logging.WARNING,
                        handlers=[handler])
    logging.getLogger("localspec.llama_cpp").setLevel(logging.ERROR)

    from pathlib import Path

    import uvicorn

    from ..engine import activity
    from ..loading import load_engine
    from .app import create_app
    from .config import ServerConfig
    from .engine_process import KEY_ENV, spec_from_json, watch_parent

    watch_parent(args.parent)
    activity.install(activity.Board.file(Path(args.activity)))
    config = json.loads(args.config)
    spec = spec_from_json(config["spec"])
    server = dataclasses.replace(ServerConfig.from_json(config["options"]),
                                 api_key=os.environ.pop(KEY_ENV, None))
    app = create_app(lambda: load_engine(spec), server)
    uvicorn.Server(uvicorn.Config(app, uds=args.socket, log_level="warning",
                                  timeout_graceful_shutdown=5)).run()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
