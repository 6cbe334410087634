"""`asyncrl serve-env`: host a config's agents over HTTP for remote rollouts (asyncrl/agents/server.py).

    export ASYNCRL_ENV_TOKEN=$(python -c 'import secrets; print(secrets.token_urlsafe(32))')
    asyncrl serve-env --config recipes/multi_task/env_server.yaml --port 8765 [--host 127.0.0.1] \
        [--allow-inference-host HOST ...] [key=value ...]

The config file is a recipe-style YAML over the defaults (the `agents` list, `model` for
the tokenizer, `rollout` for sampling); the server binds to 127.0.0.1 unless told otherwise.
Requests may send the agents' inference to loopback only, and to the hosts given with
--allow-inference-host (a name, an address or a network; repeatable). The other limits
(request size and time, connections, rollouts and generations at once) are `ServerLimits`,
with options.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from agent_loops import any_uses_tools
from agent_loops.tools import SandboxUnavailable, check_sandbox
from asyncrl.agents.http_guard import ServerLimits, uvicorn_config
from asyncrl.agents.registry import build_agents
from asyncrl.agents.server import InferenceHosts, create_app
from asyncrl.run_config import load_config_file

logger = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> None:
    defaults = ServerLimits()
    parser = argparse.ArgumentParser(prog="asyncrl serve-env", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="YAML with `agents` (and model / rollout settings)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--token-env", default="ASYNCRL_ENV_TOKEN",
                        help="environment variable holding the bearer token clients must send")
    parser.add_argument("--allow-inference-host", action="append", default=[], metavar="HOST",
                        help="a host (name, IP address or CIDR network) requests may send inference to, besides "
                             "loopback; repeatable")
    parser.add_argument("--max-request-bytes", type=int, default=defaults.max_request_bytes)
    parser.add_argument("--read-timeout-s", type=float, default=defaults.read_timeout_s,
                        help="time a client has for a request's headers, and again for its body; without the "
                             "token, for all of the request and its answer")
    parser.add_argument("--write-timeout-s", type=float, default=defaults.write_timeout_s,
                        help="time an answer may wait for its client to read it; then the connection is dropped")
    parser.add_argument("--max-connections", type=int, default=defaults.max_connections)
    parser.add_argument("--max-unauthenticated", type=int, default=defaults.max_unauthenticated,
                        help="connections on which no request has carried the token yet; past it, the oldest "
                             "of them is closed")
    parser.add_argument("--max-unauthenticated-per-peer", type=int, default=defaults.max_unauthenticated_per_peer,
                        help="the same, from one client address (an IPv6 /64)")
    parser.add_argument("--max-rollouts-in-flight", type=int, default=defaults.max_rollouts_in_flight,
                        help="rollouts under way across all requests; a request past it gets 503")
    parser.add_argument("--max-concurrent-generations", type=int, default=defaults.max_concurrent_generations,
                        help="requests to inference endpoints at once, server-wide")
    parser.add_argument("overrides", nargs="*", help="config overrides, key=value")
    args = parser.parse_args(argv)

    token = os.environ.get(args.token_env, "")
    if len(token) < 16:
        sys.exit(f"asyncrl serve-env: ${args.token_env} must hold a bearer token of at least 16 characters "
                 "(e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))')")
    try:
        limits = ServerLimits(max_request_bytes=args.max_request_bytes, read_timeout_s=args.read_timeout_s,
                              write_timeout_s=args.write_timeout_s, max_connections=args.max_connections,
                              max_unauthenticated=args.max_unauthenticated,
                              max_unauthenticated_per_peer=args.max_unauthenticated_per_peer,
                              max_rollouts_in_flight=args.max_rollouts_in_flight,
                              max_concurrent_generations=args.max_concurrent_generations,
                              inference_hosts=tuple(args.allow_inference_host))
        InferenceHosts(limits.inference_hosts)
        cfg = load_config_file(args.config, args.overrides)
        agents = build_agents(cfg)
    except (ValueError, OSError) as e:  # ConfigError is a ValueError
        sys.exit(f"asyncrl serve-env: {e}")
    for a in agents.agents.values():  # load problems now: a broken dataset fails at start
        a.problems("train"), a.problems("heldout")
    if any_uses_tools(a.agent_loop for a in agents.agents.values()):
        try:
            check_sandbox(cfg.tools.sandbox)
        except SandboxUnavailable as e:
            sys.exit(f"asyncrl serve-env: {e}")
    import uvicorn

    logging.basicConfig(level=logging.INFO)
    logger.info("serving envs %s on http://%s:%d (inference to loopback%s)", ", ".join(agents.agents), args.host,
                args.port, "".join(f", {h}" for h in limits.inference_hosts))
    uvicorn.Server(uvicorn_config(create_app(agents, token, limits), args.host, args.port, limits)).run()


if __name__ == "__main__":
    main()
