"""A run's embedded Ray cluster opens no more to other local users than Ray forces (docs/security.md,
"The run's Ray cluster"): Ray's token file is private, whatever mode an earlier Ray left it in; the
session's files are created private; the dashboard answers on loopback; Ray's metrics exporter,
which carries the run's gauges, does not listen on every IPv4 interface (off by default)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from ray.autoscaler._private.constants import AUTOSCALER_METRIC_PORT
from ray.dashboard.consts import DASHBOARD_METRIC_PORT

from tests.conftest import REPO

pytestmark = pytest.mark.slow

# Starts the cluster as `asyncrl train` does and reports what it left open.
PROBE = r"""
import json, os, sys, time
from pathlib import Path
import psutil, ray
from asyncrl.actors import start_ray
from asyncrl.run_config import load_config

start_ray(load_config(["recipe=arith", "cluster.num_cpus=1", *sys.argv[1:]]))
ray.get(ray.remote(lambda: 1).remote())
session = Path(ray._private.worker.global_worker.node.get_session_dir_path())


def agent_serving():  # the dashboard agent records its HTTP port (-1: none) once its modules (the
    # metrics exporter among them) are up; the port may be taken by another cluster of the machine
    return any(f.read_text().strip() for f in session.glob("dashboard_agent_listen_port_*"))


deadline = time.monotonic() + 120
while not agent_serving():
    assert time.monotonic() < deadline, "the dashboard agent never started"
    time.sleep(0.2)
tree = {p.pid: " ".join(p.cmdline()) for p in psutil.Process().children(recursive=True)} | {os.getpid(): "driver"}
listening = sorted({(c.laddr.ip, c.laddr.port, tree[c.pid]) for c in psutil.net_connections("inet")
                    if c.status == psutil.CONN_LISTEN and c.pid in tree})
files = {str(f.relative_to(session)): f.stat().st_mode & 0o777 for f in session.iterdir() if f.is_file()}
print(json.dumps({"listening": listening, "files": files}))
ray.shutdown()
"""


def probe(home: Path, *overrides: str) -> dict:
    env = {**os.environ, "HOME": str(home), "RAY_AUTH_MODE": "token"}
    env.pop("RAY_ADDRESS", None)
    out = subprocess.run([sys.executable, "-c", PROBE, *overrides], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.attack
def test_a_local_run_leaves_its_token_private_and_none_of_its_data_on_every_interface(tmp_path):
    token = tmp_path / ".ray" / "auth_token"
    token.parent.mkdir(mode=0o755)
    token.write_text("a" * 64)  # as an earlier Ray wrote it: 0644 in a 0755 directory
    token.chmod(0o644)
    seen = probe(tmp_path)
    assert stat.S_IMODE(token.stat().st_mode) == 0o600 and stat.S_IMODE(token.parent.stat().st_mode) == 0o700
    assert seen["files"] and all(mode & 0o077 == 0 for mode in seen["files"].values()), seen["files"]
    # On every IPv4 interface only what Ray binds there with no setting to say otherwise (2.60): the
    # autoscaler monitor's and the dashboard's Prometheus servers of Ray's own metrics, at their fixed
    # ports; never the metrics agent's, which carries the run's gauges (docs/security.md).
    everywhere = {(port, "monitor.py" if "monitor.py" in cmd else "dashboard.py" if "dashboard.py" in cmd else cmd)
                  for ip, port, cmd in seen["listening"] if ip == "0.0.0.0"}
    assert everywhere <= {(AUTOSCALER_METRIC_PORT, "monitor.py"), (DASHBOARD_METRIC_PORT, "dashboard.py")}, everywhere
    dashboard = [x for x in seen["listening"] if x[1] == 8265]
    assert dashboard and all(ip == "127.0.0.1" for ip, *_ in dashboard), dashboard
