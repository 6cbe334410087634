"""Teach the tiny arith base model to call the calculator, by supervised fine-tuning, in two
formats: as a chat model (its own chat template, chat_template.jinja: ChatML roles, Hermes
calls) and in asyncrl's markup on a plain prompt (the partial_tool loop).

Chat, with the tool:
    <|im_start|>system\\nTools: calculator<|im_end|>\\n<|im_start|>user\\n3 + 4 - 2 =\\n<|im_end|>\\n
    <|im_start|>assistant\\n<tool_call>\\n{"name": "calculator", "arguments": {"expression": "3 + 4 - 2"}}
    \\n</tool_call><|im_end|>  +  (the template's tool turn: "\\n<|im_start|>user\\n<tool_response>\\n5\\n
    </tool_response><|im_end|>\\n<|im_start|>assistant\\n", not trained)  +  Answer: 5<|im_end|>
Markup, with the tool:
    3 + 4 - 2 =\\n<tool:calculator>3 + 4 - 2</tool><result>5</result>Answer: 5<eos>
Without the tool, the answer alone. Half the demonstrations are chat; `tool_fraction` of the
markup ones and `chat_tool_fraction` of the chat ones call the tool (chosen so that greedy
decoding answers directly: RL then has to find that calling pays). The tool's turn is
rendered with the same code that renders it in rollouts (agent_loops/chat.py), so training
and rollouts see the same tokens. Deterministic from its seed.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from agent_loops.chat import ChatFormat
from agent_loops.tools import calculate
from agent_loops.tools.schemas import tool_schemas
from asyncrl.run_config import load_config
from asyncrl.tasks import Problem, TaskSource
from recipes.arith import direct_answer

CHAT_TEMPLATE = Path(__file__).with_name("chat_template.jinja")
ROLE_TOKENS = ["<|im_start|>", "<|im_end|>"]


def demonstration(problem: Problem, with_tool: bool) -> str:
    """The markup demonstration (the response to the plain prompt)."""
    if not with_tool:
        return direct_answer(problem)
    expression = problem.entry["metadata"]["expression"]
    return f"<tool:calculator>{expression}</tool><result>{problem.answer}</result>" + direct_answer(problem)


def hermes_call(expression: str) -> str:
    call = {"name": "calculator", "arguments": {"expression": expression}}
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"


def chat_demonstration(problem: Problem, with_tool: bool, chat: ChatFormat) -> tuple[list[int], list[int]]:
    """(token ids, labels) of one chat demonstration; the prompt and the tool's turn are not trained."""
    tok = chat.tokenizer
    prompt = chat.prompt([{"role": "user", "content": problem.prompt}], tool_schemas(["calculator"]))
    end = list(chat.end_of_turn.closing[:1])  # the end-of-turn token the model writes
    answer = tok.encode(direct_answer(problem), add_special_tokens=False) + end
    if not with_tool:
        return prompt + answer, [-100] * len(prompt) + answer
    expression = problem.entry["metadata"]["expression"]
    call = tok.encode(hermes_call(expression), add_special_tokens=False) + end
    result = chat.append_ids([{"role": "tool", "name": "calculator", "content": calculate(expression)}], call)
    return prompt + call + result + answer, [-100] * len(prompt) + call + [-100] * len(result) + answer


def chat_tokenizer(path: str | Path) -> AutoTokenizer:
    """The base model's tokenizer with the role markers as special tokens and the chat template."""
    tok = AutoTokenizer.from_pretrained(path)
    tok.add_special_tokens({"additional_special_tokens": ROLE_TOKENS})
    tok.chat_template = CHAT_TEMPLATE.read_text()
    return tok


def build_tool_model(out: Path, steps: int = 200, seed: int = 0, tool_fraction: float = 1.0,
                     chat_tool_fraction: float | None = None, lr: float = 1e-3) -> Path:
    """Fine-tune the arith base model for `steps` batches of 32 demonstrations; save to `out`.
    `chat_tool_fraction` (default: `tool_fraction`) is the share of chat demonstrations that call."""
    chat_tool_fraction = tool_fraction if chat_tool_fraction is None else chat_tool_fraction
    torch.manual_seed(seed)
    cfg = load_config(["recipe=arith"])
    tok = chat_tokenizer(cfg.model.path)
    chat = ChatFormat(tok, name="the tool model's")
    model = AutoModelForCausalLM.from_pretrained(cfg.model.path)
    assert len(tok) <= model.config.vocab_size, "the role markers need rows in the embedding"
    train = TaskSource(cfg.data).train
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    rng = random.Random(seed)
    model.train()
    for _ in range(steps):
        rows = []
        for p in rng.sample(train, 32):
            draw = rng.random()
            if rng.random() < 0.5:
                rows.append(chat_demonstration(p, draw < chat_tool_fraction, chat))
            else:
                with_tool = draw < tool_fraction
                ids_p = tok.encode(p.prompt)
                ids_a = tok.encode(demonstration(p, with_tool)) + [tok.eos_token_id]
                rows.append((ids_p + ids_a, [-100] * len(ids_p) + ids_a))
        width = max(len(r[0]) for r in rows)
        ids = torch.tensor([r[0] + [tok.pad_token_id] * (width - len(r[0])) for r in rows])
        labels = torch.tensor([r[1] + [-100] * (width - len(r[1])) for r in rows])
        model(input_ids=ids, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
    Path(out).mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return Path(out)
