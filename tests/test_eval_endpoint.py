"""`asyncrl eval eval.endpoint=...` against a real OpenAI-compatible server (`vllm serve` on
CPU, in its own process): the same greedy results as vLLM in process, and the client reads
vLLM's token ids and logprobs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import pytest

from tests.conftest import run_cli
from tests.test_env_server import free_port

pytestmark = pytest.mark.slow

EVAL = ["recipe=arith", "eval.num_problems=32", "eval.n_samples=2", "eval.pass_k=[1,2]"]


@pytest.fixture(scope="module")
def vllm_server(base_model, tmp_path_factory):
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1"}
    log = open(tmp_path_factory.mktemp("vllm") / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(base_model),
                             "--served-model-name", "tiny", "--port", str(port), "--host", "127.0.0.1",
                             "--dtype", "float32", "--max-model-len", "128", "--enforce-eager",
                             "--logprobs-mode", "processed_logprobs"], env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 300
        while time.time() < deadline:
            assert proc.poll() is None, open(log.name).read()[-3000:]
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(1)
        yield url + "/v1"
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_eval_through_an_openai_compatible_endpoint_matches_in_process(vllm_server, tmp_path):
    out = run_cli("eval", *EVAL, f"eval.endpoint={vllm_server}", "eval.endpoint_model=tiny",
                  f"run.output_dir={tmp_path / 'endpoint'}", cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    out = run_cli("eval", *EVAL, f"run.output_dir={tmp_path / 'local'}", cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    remote, local = (json.loads((tmp_path / d / "eval.json").read_text()) for d in ("endpoint", "local"))
    assert remote["model"] == vllm_server and remote["num_problems"] == 32
    assert remote["greedy_accuracy"] == local["greedy_accuracy"]  # greedy: the same weights, the same answers
    assert 0 < remote["mean_response_tokens"]


def test_the_client_reads_vllm_token_ids_and_logprobs(vllm_server, base_model):
    from transformers import AutoTokenizer

    from asyncrl.agents.openai_inference import OpenAIInference
    from asyncrl.inference.protocol import Endpoint
    from asyncrl.types import SamplingSpec

    tok = AutoTokenizer.from_pretrained(base_model)
    client = OpenAIInference(Endpoint(vllm_server, "tiny"), tokenizer=tok)
    result = client.generate(tok.encode("Calculate 5 - 3 + 2.\nAnswer: "), SamplingSpec(8, temperature=1.0), "r0")
    assert client.returns_token_ids and client.returns_logprobs
    assert result.token_ids and all(lp <= 0 for lp in result.logprobs) and len(result.logprobs) == len(result.token_ids)
    assert result.versions == [-1] * len(result.token_ids)  # a plain server knows no policy versions
