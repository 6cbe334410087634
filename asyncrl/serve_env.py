"""`asyncrl serve-env`: host a config's agents over HTTP for remote rollouts (asyncrl/agents/server.py).

    export ASYNCRL_ENV_TOKEN=$(python -c 'import secrets; print(secrets.token_urlsafe(32))')
    asyncrl serve-env --config recipes/multi_task/env_server.yaml --port 8765 [--host 127.0.0.1] [key=value ...]

The config file is a recipe-style YAML over the defaults (the `agents` list, `model` for
the tokenizer, `rollout` for sampling); the server binds to 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from asyncrl.agents.registry import build_agents
from asyncrl.agents.server import DEFAULT_MAX_REQUEST_BYTES, create_app
from asyncrl.run_config import load_config_file

logger = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="asyncrl serve-env", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="YAML with `agents` (and model / rollout settings)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--token-env", default="ASYNCRL_ENV_TOKEN",
                        help="environment variable holding the bearer token clients must send")
    parser.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES)
    parser.add_argument("overrides", nargs="*", help="config overrides, key=value")
    args = parser.parse_args(argv)

    token = os.environ.get(args.token_env, "")
    if len(token) < 16:
        sys.exit(f"asyncrl serve-env: ${args.token_env} must hold a bearer token of at least 16 characters "
                 "(e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))')")
    try:
        agents = build_agents(load_config_file(args.config, args.overrides))
    except (ValueError, OSError) as e:  # ConfigError is a ValueError
        sys.exit(f"asyncrl serve-env: {e}")
    for a in agents.agents.values():  # load problems now: a broken dataset fails at start
        a.problems("train"), a.problems("heldout")
    import uvicorn

    logging.basicConfig(level=logging.INFO)
    logger.info("serving envs %s on http://%s:%d", ", ".join(agents.agents), args.host, args.port)
    uvicorn.run(create_app(agents, token, args.max_request_bytes), host=args.host, port=args.port, log_level="info")


if __name__ == "__main__":
    main()
