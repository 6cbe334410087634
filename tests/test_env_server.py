"""`asyncrl serve-env` on loopback through real HTTP: authentication, request limits,
malformed bodies, unknown envs, that only registered agent types can be served, and that
its bodies are the request types a remote agent sends. The attacks on it (fuzzing, slow
clients, inference elsewhere, ...) are tests/test_security_servers.py."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import ASYNCRL

TOKEN = "test-token-0123456789abcdef"
CONFIG = Path(__file__).resolve().parents[1] / "recipes" / "multi_task" / "env_server.yaml"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(config: Path, port: int, token: str = TOKEN, *extra: str) -> subprocess.Popen:
    """serve-env in a subprocess; its log goes to a file (a pipe nobody reads would fill up and
    block the server's logging)."""
    env = {**os.environ, "ASYNCRL_ENV_TOKEN": token}
    log = tempfile.NamedTemporaryFile("w+", prefix="serve-env-", suffix=".log", delete=False)
    proc = subprocess.Popen([*ASYNCRL, "serve-env", "--config", str(config), "--port", str(port), *extra],
                            env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    proc.log_path = log.name
    return proc


def wait_ready(proc: subprocess.Popen, url: str, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"serve-env exited {proc.returncode}: {Path(proc.log_path).read_text()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise AssertionError("serve-env did not come up")


@pytest.fixture(scope="module")
def server():
    port = free_port()
    proc = start_server(CONFIG, port, TOKEN, "--max-request-bytes", "4096")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


AUTH = {"Authorization": f"Bearer {TOKEN}"}
INFERENCE = {"base_url": "http://127.0.0.1:9/v1"}  # nothing listens there


def test_requests_without_the_right_token_are_refused(server):
    r = httpx.post(server + "/problems/", json={"env_id": "word_problems"})
    assert r.status_code == 401 and "missing bearer token" in r.json()["detail"]
    r = httpx.post(server + "/problems/", json={"env_id": "word_problems"}, headers={"Authorization": "Bearer nope"})
    assert r.status_code == 403 and r.json()["detail"] == "invalid bearer token"
    r = httpx.get(server + "/envs/", headers={"Authorization": f"Basic {TOKEN}"})
    assert r.status_code == 403


def test_authorized_requests_list_envs_and_problems_without_answers(server):
    envs = httpx.get(server + "/envs/", headers=AUTH).json()["envs"]
    assert [e["env_id"] for e in envs] == ["word_problems", "retry", "word_problems_chat"]
    assert envs[1]["agent_loop"] == "multi_turn"
    problems = httpx.post(server + "/problems/", json={"env_id": "word_problems", "split": "heldout"},
                          headers=AUTH).json()["problems"]
    assert len(problems) == 200 and set(problems[0]) == {"prompt_id", "prompt", "messages", "tools"}
    assert problems[0]["messages"] == problems[0]["tools"] == []  # a plain prompt


def test_a_remote_agent_gets_a_problems_messages_and_tools(server, monkeypatch):
    from agent_loops.tools.schemas import tool_schemas
    from asyncrl.agents.api import AgentSettings
    from asyncrl.agents.remote import RemoteAgent, RemoteParams
    from asyncrl.config.schema import AgentConfig, Config

    monkeypatch.setenv("ASYNCRL_ENV_TOKEN", TOKEN)
    remote = RemoteAgent(AgentConfig(env_id="chat", type="remote"),
                         RemoteParams(url=server, remote_env_id="word_problems_chat"), AgentSettings.of(Config()))
    problem = remote.problems("heldout")[0]
    assert problem.messages == [{"role": "system", "content": "Use the calculator when it helps."},
                                {"role": "user", "content": problem.prompt}]
    assert problem.tools == tool_schemas(["calculator"])


def test_malformed_oversized_and_unknown_requests_get_a_clear_4xx(server):
    r = httpx.post(server + "/problems/", content=b"{not json", headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 422 and "JSON decode error" in r.text
    r = httpx.post(server + "/problems/", json={"env_id": "word_problems", "splt": "train"}, headers=AUTH)
    assert r.status_code == 422 and "splt" in r.text and "Unexpected keyword argument" in r.text
    r = httpx.post(server + "/rollouts/", json={"env_id": "retry", "inference": {**INFERENCE, "key": "k"}},
                   headers=AUTH)
    assert r.status_code == 422 and '"inference","key"' in r.text  # nested bodies refuse unknown fields too
    r = httpx.post(server + "/rollouts/", json={"env_id": "retry", "inference": INFERENCE,
                                                "sampling": {"max_new_tokens": 0}}, headers=AUTH)
    assert r.status_code == 422 and "max_new_tokens" in r.text
    r = httpx.post(server + "/grouped_rollouts/", json={"env_id": "word_problems", "group_size": 0,
                                                        "inference": INFERENCE}, headers=AUTH)
    assert r.status_code == 422 and "group_size" in r.text
    r = httpx.post(server + "/evaluation/", json={"env_id": "word_problems", "inference": {"base_url": "file:///"}},
                   headers=AUTH)
    assert r.status_code == 422 and "base_url" in r.text
    r = httpx.post(server + "/problems/", json={"env_id": "x" * 5000}, headers=AUTH)
    assert r.status_code == 413 and "over the server's limit of 4096 bytes" in r.json()["detail"]
    # an agent (or a module) that is not configured on the server cannot be reached by naming it
    r = httpx.post(server + "/rollouts/", json={"env_id": "os.system", "inference": INFERENCE}, headers=AUTH)
    assert r.status_code == 404
    assert r.json()["detail"] == ("unknown env_id 'os.system'; this server hosts: word_problems, retry, "
                                 "word_problems_chat")
    r = httpx.post(server + "/rollouts/", json={"env_id": "retry", "problem_ids": ["retry/train/999999"],
                                                "inference": INFERENCE}, headers=AUTH)
    assert r.status_code == 404 and "no train problem 'retry/train/999999'" in r.json()["detail"]
    # an inference endpoint that cannot be reached: a failed trajectory with its reason, not a crash
    r = httpx.post(server + "/rollouts/", json={"env_id": "retry", "problem_ids": ["retry/train/0"],
                                                "inference": INFERENCE}, headers=AUTH, timeout=60)
    assert r.status_code == 200
    traj = r.json()["rollouts"][0]
    assert traj["status"] == "failed" and traj["failure_reason"].startswith("loop_error: ")
    assert httpx.get(server + "/health").status_code == 200  # still serving


def test_rollouts_are_capped_after_expansion_and_inference_stays_on_loopback(server):
    r = httpx.post(server + "/rollouts/", json={"env_id": "retry", "problem_ids": ["retry/train/0"] * 4097,
                                                "inference": INFERENCE}, headers={**AUTH}, timeout=30)
    assert r.status_code == 413  # this server's 4096-byte limit comes first
    r = httpx.post(server + "/grouped_rollouts/", json={"env_id": "retry", "problem_ids": ["retry/train/0"] * 200,
                                                        "group_size": 21, "inference": INFERENCE}, headers=AUTH)
    assert r.status_code == 422 and r.json()["detail"] == "200 groups x 21 = 4200 rollouts, over 4096 per request"
    r = httpx.post(server + "/evaluation/", json={"env_id": "word_problems", "n_samples": 20, "pass_k": [1],
                                                  "inference": INFERENCE}, headers=AUTH)
    assert r.status_code == 422 and r.json()["detail"].startswith("200 problems x (1 greedy + 20 samples) = 4200")
    r = httpx.post(server + "/rollouts/", json={"env_id": "retry", "inference": {"base_url": "http://10.0.0.1/v1"}},
                   headers=AUTH)
    assert r.status_code == 403 and r.json()["detail"].startswith("inference.base_url host '10.0.0.1' is not allowed")


def test_the_server_bodies_are_the_request_types_a_remote_agent_sends():
    from dataclasses import asdict
    from types import SimpleNamespace
    from typing import get_type_hints

    from pydantic import TypeAdapter

    from asyncrl.agents import api
    from asyncrl.agents.server import create_app
    from asyncrl.inference.protocol import Endpoint
    from asyncrl.types import SamplingSpec

    app = create_app(SimpleNamespace(agents={}), TOKEN).app
    bodies = {r.path: get_type_hints(r.endpoint)["body"] for r in app.routes if r.methods == {"POST"}}
    assert bodies == {"/problems/": api.ProblemsRequest, "/rollouts/": api.RolloutRequest,
                      "/grouped_rollouts/": api.GroupedRolloutRequest, "/evaluation/": api.EvaluationRequest}

    # A server fills in the defaults a client builds with (one definition: pass@k is [1, 8] on both sides).
    for body in bodies.values():
        given = {"env_id": "e"} if body is api.ProblemsRequest else {"env_id": "e", "inference": INFERENCE}
        client = body(**{**given, **({"inference": Endpoint(**INFERENCE)} if "inference" in given else {})})
        assert asdict(TypeAdapter(body).validate_python(given)) == asdict(client), body.__name__
    assert api.EvaluationRequest("e", Endpoint(**INFERENCE)).pass_k == [1, 8]

    # What a remote agent sends (every field, nested ones included) is what the server reads.
    sampling = SamplingSpec(16, 0.7, 0.9, ["\n"], True, [7])
    sent = api.GroupedRolloutRequest("e", Endpoint(**INFERENCE, model="m", api_key="k"), problem_ids=["p"],
                                     group_size=4, group_ids=["g"], sampling=sampling)
    read = TypeAdapter(api.GroupedRolloutRequest).validate_json(httpx.Request("POST", "/", json=asdict(sent)).content)
    assert asdict(read) == asdict(sent)
    assert isinstance(read.inference, Endpoint) and isinstance(read.sampling, SamplingSpec)


def test_a_remote_agent_is_served_problems_groups_and_a_greedy_only_evaluation(server, monkeypatch):
    from types import SimpleNamespace

    from asyncrl.agents.api import AgentSettings
    from asyncrl.agents.remote import RemoteAgent, RemoteParams
    from asyncrl.config.schema import AgentConfig, Config
    from asyncrl.inference.protocol import Endpoint

    monkeypatch.setenv("ASYNCRL_ENV_TOKEN", TOKEN)
    remote = RemoteAgent(AgentConfig(env_id="words", type="remote"),
                         RemoteParams(url=server, remote_env_id="word_problems"), AgentSettings.of(Config()))
    heldout = remote.problems("heldout")
    assert len(heldout) == 200 and heldout[0].prompt_id.startswith("words:word_problems/")
    nowhere = SimpleNamespace(endpoint=Endpoint(**INFERENCE))  # the server's loops fail, the requests do not
    group = asyncio.run(remote.grouped_rollout(remote.problems("train")[0], 2, nowhere))
    assert [t.status.value for t in group.trajectories] == ["failed", "failed"]
    # eval.periodic_pass_k=false evaluates with n_samples=0 and eval.pass_k=[1, 8]: no pass@k, not a 422
    response = asyncio.run(remote.evaluate(heldout[:2], nowhere, 0, 1.0, [1, 8]))
    assert [r.prompt_id for r in response.results] == [p.prompt_id for p in heldout[:2]]
    assert not any(m.startswith("pass@") for m in response.metrics())
    # more than one request's worth of rollouts: split into requests under the server's cap, in order
    monkeypatch.setattr("asyncrl.agents.remote.MAX_ROLLOUTS_PER_REQUEST", 3 * (1 + 2))
    response = asyncio.run(remote.evaluate(heldout[:7], nowhere, 2, 1.0, [1, 8]))
    assert [r.prompt_id for r in response.results] == [p.prompt_id for p in heldout[:7]]
    assert response.pass_k == [1] and all(len(r.sampled_rewards) == 2 for r in response.results)


def test_the_server_refuses_to_start_without_a_token_or_with_an_unregistered_type(tmp_path):
    out = subprocess.run([*ASYNCRL, "serve-env", "--config", str(CONFIG)], capture_output=True, text=True,
                         env={k: v for k, v in os.environ.items() if k != "ASYNCRL_ENV_TOKEN"}, timeout=120)
    assert out.returncode != 0 and "$ASYNCRL_ENV_TOKEN must hold a bearer token" in out.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text(CONFIG.read_text().replace("type: reward_only", "type: subprocess.run"))
    out = subprocess.run([*ASYNCRL, "serve-env", "--config", str(bad)], capture_output=True, text=True,
                         env={**os.environ, "ASYNCRL_ENV_TOKEN": TOKEN}, timeout=120)
    assert out.returncode != 0
    assert "agent type 'subprocess.run' is not registered; registered types: dataset, reward_only, remote" \
           in out.stderr
    out = subprocess.run([*ASYNCRL, "serve-env", "--config", str(CONFIG), "--allow-inference-host", "*.example.com"],
                         capture_output=True, text=True, env={**os.environ, "ASYNCRL_ENV_TOKEN": TOKEN}, timeout=120)
    assert out.returncode != 0
    assert "allowed inference host '*.example.com': not a host name, IP address or network" in out.stderr
