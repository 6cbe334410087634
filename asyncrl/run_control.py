"""Talking to a running job from outside: `asyncrl scale` and `asyncrl stop`.

    asyncrl scale RUN_DIR --engines N      # grow or shrink the job's engines (asyncrl/control/elastic.py)
    asyncrl stop RUN_DIR                   # end it after its current step: final evaluation, export, summary

Both talk to `RunControl`, a named Ray actor the driver starts in a namespace of the run's own;
RUN_DIR/control.json (mode 0600) says where: the Ray cluster's address, the namespace and the
name. Whoever can reach the Ray cluster can control the run, as with `ray job submit`. The
driver reads the requests once a step, after the step's metrics.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from asyncrl.config.validate import MAX_WORKERS
from asyncrl.messages import ControlRequest

# Ray is imported only where it is used: `asyncrl scale` and `asyncrl stop` load this module and
# must set RAY_AUTH_MODE before Ray loads.
if TYPE_CHECKING:
    from ray.actor import ActorHandle

CONTROL_FILE = "control.json"


class RunControl:
    """The run's mailbox (a named Ray actor): the newest engine count asked for wins."""

    def __init__(self) -> None:
        self.pending = ControlRequest()

    def request_engines(self, n: int) -> None:
        if not 1 <= n <= MAX_WORKERS:
            raise ValueError(f"--engines {n}: must be in [1, {MAX_WORKERS}]")
        self.pending.engines = n

    def request_stop(self) -> None:
        self.pending.stop = True

    def take_request(self) -> ControlRequest:
        request, self.pending = self.pending, ControlRequest()
        return request


def control_address() -> dict[str, str]:
    """Where a new run's RunControl goes: the Ray cluster's address, a namespace of the run's own, its
    name, and Ray's authentication mode (a local cluster uses token authentication, the token in
    ~/.ray/auth_token, and a client must ask for it before it imports Ray)."""
    import ray

    return {"address": ray.get_runtime_context().gcs_address, "namespace": f"asyncrl-{uuid.uuid4().hex[:12]}",
            "name": "asyncrl-control", "auth_mode": os.environ.get("RAY_AUTH_MODE", "")}


def announce(run_dir: Path, where: dict[str, str]) -> None:
    """Tell `asyncrl scale` and `asyncrl stop` where the run's RunControl is: RUN_DIR/control.json."""
    path = run_dir / CONTROL_FILE
    path.write_text(json.dumps(where) + "\n")
    path.chmod(0o600)


def _control(run_dir: Path, command: str) -> ActorHandle[RunControl]:
    """The RunControl actor of the run in `run_dir` (this process joins its Ray cluster)."""
    path = Path(run_dir) / CONTROL_FILE
    if not path.is_file():
        raise SystemExit(f"asyncrl {command}: {path} not found (is a run going on in {run_dir}?)")
    where = json.loads(path.read_text())
    if where.get("auth_mode"):
        os.environ.setdefault("RAY_AUTH_MODE", where["auth_mode"])
    import ray  # after RAY_AUTH_MODE: Ray reads it when it loads

    ray.init(address=where["address"], namespace=where["namespace"], logging_level=logging.WARNING,
             log_to_driver=False)
    try:
        return ray.get_actor(where["name"], namespace=where["namespace"])
    except ValueError:
        raise SystemExit(f"asyncrl {command}: the run of {run_dir} is over (no {where['name']} on its cluster)") \
            from None


def scale_main() -> None:
    parser = argparse.ArgumentParser(prog="asyncrl scale", description="grow or shrink a running job's engines")
    parser.add_argument("run_dir", type=Path, help="the run's output directory (run.output_dir)")
    parser.add_argument("--engines", type=int, required=True, help="how many engines the run should have")
    args = parser.parse_args()
    if not 1 <= args.engines <= MAX_WORKERS:
        parser.error(f"--engines {args.engines}: must be in [1, {MAX_WORKERS}]")
    control = _control(args.run_dir, "scale")
    control.request_engines.remote(args.engines).future().result(timeout=60)
    print(f"asked the run in {args.run_dir} for {args.engines} engine(s); it applies the request after its "
          f"current step (RUN_DIR/scale.jsonl records it)")


def stop_main() -> None:
    parser = argparse.ArgumentParser(prog="asyncrl stop", description="end a running job after its current step "
                                     "(final evaluation, export and summary as at its last step)")
    parser.add_argument("run_dir", type=Path, help="the run's output directory (run.output_dir)")
    args = parser.parse_args()
    _control(args.run_dir, "stop").request_stop.remote().future().result(timeout=60)
    print(f"asked the run in {args.run_dir} to stop after its current step")
