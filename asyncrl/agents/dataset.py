"""The dataset agent: problems from reasoning-gym generators or local files, one prompt
template, the recipe's answer extraction and the task's scorer.

    agents:
      - env_id: gsm8k
        type: dataset
        params: {source: file, path: /data/gsm8k/train.jsonl, heldout_path: /data/gsm8k/test.jsonl,
                 question_field: question, answer_field: answer, answer_regex: "####\\s*(.+)$",
                 prompt_template: "{question}\\nAnswer: "}

JSON files (.jsonl: one object a line; .json: the same, or one array of objects) are parsed
here; .parquet, .arrow and `save_to_disk` directories are read with Hugging Face `datasets`;
nothing is downloaded. A row without a question or an answer is skipped and counted (logged
once per file). A malformed row (not JSON, not an object, a question or answer of the wrong
type) fails the load with an error naming the env, the file and the line (or row).

`format: verl` reads verl's RL layout instead (docs/agents.md): `prompt` (chat messages) is the
conversation, `reward_model.ground_truth` the answer, `data_source` and `extra_info` go with the
problem to `reward_function` (verl's compute_score signature, asyncrl/reward/reward_function.py). The
same two rules hold: no prompt or no ground truth -> skipped and counted; a field of the wrong
type -> the load fails naming the row.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from agent_loops.tools.schemas import tool_schemas
from asyncrl.agents.api import Agent, AgentSettings
from asyncrl.config.schema import AgentConfig, DataConfig
from asyncrl.reward.recipe_hooks import RecipeHooks, load_recipe_hooks
from asyncrl.reward.reward_function import call_reward_function, load_reward_function
from asyncrl.tasks import Problem, TaskSource

logger = logging.getLogger(__name__)

FILE_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}


@dataclass
class DatasetParams(DataConfig):
    # Python module with extract_answer (and optionally reward); empty: recipe.module.
    module: str = ""


class DatasetAgent(Agent):
    params_class = DatasetParams

    def __init__(self, spec: AgentConfig, params: DatasetParams, settings: AgentSettings):
        super().__init__(spec, params, settings)
        self.hooks: RecipeHooks = load_recipe_hooks(params.module or settings.recipe_module)  # may register tools
        try:
            self.tool_schemas = tool_schemas(params.tools) if params.tools else []
        except KeyError as e:
            raise ValueError(f"env {self.env_id!r}: {e.args[0]}") from None
        self.skipped_rows = 0
        try:  # validation loaded it already (cached); a worker loads it here
            self.reward_function = load_reward_function(params.reward_function) if params.reward_function else None
        except ValueError as e:
            raise ValueError(f"env {self.env_id!r}: reward_function={params.reward_function!r}: {e}") from None

    def reward(self, problem: Problem, response: str) -> float:
        return self.reward_and_metrics(problem, response)[0]

    def reward_and_metrics(self, problem: Problem, response: str) -> tuple[float, dict[str, float]]:
        if self.reward_function is None:
            return self.hooks.reward(problem, response), {}
        # verl's arguments: a verl row's own ground truth (any JSON value), else the answer text
        truth = problem.entry["reward_model"]["ground_truth"] if self.params.format == "verl" else problem.answer
        return call_reward_function(self.reward_function, problem.data_source or self.env_id, response, truth,
                                    copy.deepcopy(problem.extra_info))  # a call may not change the next one's

    def load_splits(self) -> dict[str, list[Problem]]:
        p = self.params
        if p.source == "file":
            return self._file_splits()
        source = TaskSource(p)
        splits = {"train": source.train, "heldout": source.heldout}
        for problem in splits["train"] + splits["heldout"]:  # ids unique across envs
            problem.prompt_id, problem.env_id = f"{self.env_id}/{problem.prompt_id}", self.env_id
            self._as_chat(problem)
        return splits

    def _as_chat(self, problem: Problem, messages: list[dict[str, Any]] | None = None) -> Problem:
        """With a system prompt, tools or a row's own messages, the problem is a conversation."""
        if messages:
            problem.messages = messages
        elif self.params.system_prompt or self.tool_schemas:
            system = [{"role": "system", "content": self.params.system_prompt}] if self.params.system_prompt else []
            problem.messages = [*system, {"role": "user", "content": problem.prompt}]
        problem.tools = list(self.tool_schemas) if problem.messages else []
        return problem

    def _file_splits(self) -> dict[str, list[Problem]]:
        p = self.params
        rows = self._read(p.path)
        if p.heldout_path:
            heldout_rows = self._read(p.heldout_path)[: p.heldout_size]
        else:  # hold out the last heldout_size rows of a seeded shuffle
            random.Random(p.heldout_seed).shuffle(rows)
            if len(rows) <= p.heldout_size:
                raise ValueError(f"env {self.env_id!r}: {p.path} has {len(rows)} usable rows, not more than "
                                 f"heldout_size={p.heldout_size}; give heldout_path or a smaller heldout_size")
            rows, heldout_rows = rows[: -p.heldout_size], rows[-p.heldout_size:]
        heldout = [self._problem("heldout", i, r) for i, r in enumerate(heldout_rows)]
        seen = {q.question for q in heldout}
        train = [self._problem("train", i, r) for i, r in enumerate(rows[: p.train_size]) if r.question not in seen]
        return {"train": train, "heldout": heldout}

    def _problem(self, split: str, index: int, row: Row) -> Problem:
        entry = row.entry
        verl = self.params.format == "verl"
        problem = Problem(prompt_id=f"{self.env_id}/{split}/{index}", task="", question=row.question,
                          prompt=row.question if verl else self.params.prompt_template.format(question=row.question),
                          answer=row.answer, entry=entry, agent_loop=str(entry.get("agent_loop") or ""),
                          env_id=self.env_id, data_source=str(entry.get("data_source") or "") if verl else "",
                          extra_info=dict(entry.get("extra_info") or {}) if verl else {})
        return self._as_chat(problem, row.messages)

    def _read(self, path: str) -> list[Row]:
        """Every usable row of a local file."""
        p = self.params
        verl = p.format == "verl"
        pattern = re.compile(p.answer_regex, re.S | re.M) if p.answer_regex and not verl else None
        rows: list[Row] = []
        skipped = total = 0
        first: Any = None
        try:
            for where, row in _rows(Path(path)):
                total += 1
                first = row if total == 1 else first
                usable = (_usable_verl(row, where, self.reward_function is not None) if verl
                          else _usable(row, where, p.question_field, p.answer_field, pattern))
                if usable is None:
                    skipped += 1
                elif verl:
                    rows.append(usable)
                else:
                    _check_messages(row.get("messages"), where)
                    rows.append(Row(*usable, dict(row), row.get("messages")))
        except MalformedRow as e:
            raise ValueError(f"env {self.env_id!r}: {path}, {e.where}: {e}") from None
        except UnsupportedFile as e:
            raise ValueError(f"env {self.env_id!r}: {path}: {e}") from None
        fields = ("prompt", "reward_model.ground_truth") if verl else (p.question_field, p.answer_field)
        if skipped:
            logger.warning("env %s: skipped %d of %d rows of %s without a usable %r or %r%s", self.env_id, skipped,
                           total, path, *fields, f" (matching answer_regex {p.answer_regex!r})" if pattern else "")
        self.skipped_rows += skipped
        if not rows:
            looks_verl = not verl and isinstance(first, dict) and {"prompt", "reward_model"} <= first.keys()
            raise ValueError(f"env {self.env_id!r}: {path} has no usable rows (fields {fields[0]!r}, {fields[1]!r})"
                             + ("; its rows have verl's columns (prompt, reward_model): set format: verl"
                                if looks_verl else ""))
        return rows


class Row(NamedTuple):
    """A usable row: the question (a verl row: its last user message), the reference answer as
    text, the row itself and its conversation (None: a plain prompt)."""

    question: str
    answer: str
    entry: dict[str, Any]
    messages: list[dict[str, Any]] | None


class MalformedRow(ValueError):
    """A row that cannot be a problem; `where` is its line ("line 7") or, in a binary file, its row."""

    def __init__(self, where: str, problem: str):
        super().__init__(problem)
        self.where = where


class UnsupportedFile(ValueError):
    """A file that is not one of FILE_FORMATS, or that its reader rejects as a whole."""


def _usable(row: Any, where: str, question_field: str, answer_field: str,
            pattern: re.Pattern[str] | None) -> tuple[str, str] | None:
    """(question, reference answer) of a row; None when one is missing or empty (the row is
    skipped and counted); MalformedRow when the row or a field has the wrong type."""
    if not isinstance(row, dict):
        raise MalformedRow(where, f"a row must be a JSON object, not {_json_type(row)}")
    question, answer = row.get(question_field), row.get(answer_field)
    if question is not None and not isinstance(question, str):
        raise MalformedRow(where, f"field {question_field!r} must be a string, not {_json_type(question)}")
    # numbers are common reference answers (42); lists and objects are not answers
    if answer is not None and (not isinstance(answer, str | int | float)
                               or isinstance(answer, float) and not math.isfinite(answer)):
        raise MalformedRow(where, f"field {answer_field!r} must be a string or a number, not {_json_type(answer)}")
    if pattern is not None and answer is not None:
        match = pattern.search(str(answer))
        answer = match.group(1) if match else None
    if question is None or not question.strip() or answer is None or not str(answer).strip():
        return None
    return question, str(answer).strip()


def _usable_verl(row: Any, where: str, any_truth: bool) -> Row | None:
    """A row in verl's layout; None when its prompt or ground truth is missing or empty (skipped and
    counted); MalformedRow when a field has the wrong type. `any_truth`: a reward function takes the
    ground truth as it is, so it may be any JSON value; else it must be a string or a number."""
    if not isinstance(row, dict):
        raise MalformedRow(where, f"a row must be a JSON object, not {_json_type(row)}")
    prompt, reward_model = row.get("prompt"), row.get("reward_model")
    if prompt is not None:
        if not isinstance(prompt, list):
            raise MalformedRow(where, f"field 'prompt' must be an array of chat messages (verl's layout), "
                                      f"not {_json_type(prompt)}")
        # parquet and arrow give every message every key of the column's struct: drop the nulls
        prompt = [{k: v for k, v in m.items() if v is not None} if isinstance(m, dict) else m for m in prompt]
        _check_messages(prompt, where, "prompt")
    if reward_model is not None and not isinstance(reward_model, dict):
        raise MalformedRow(where, f"field 'reward_model' must be an object such as "
                                  f'{{"style": "rule", "ground_truth": ...}}, not {_json_type(reward_model)}')
    truth = (reward_model or {}).get("ground_truth")
    if isinstance(truth, float) and not math.isfinite(truth):
        raise MalformedRow(where, f"field 'reward_model.ground_truth' must be finite, not {_json_type(truth)}")
    if truth is not None and not any_truth and not isinstance(truth, str | int | float):
        raise MalformedRow(where, f"field 'reward_model.ground_truth' must be a string or a number, not "
                                  f"{_json_type(truth)} (a reward_function gets it as it is)")
    for name, kind, wanted in (("data_source", str, "a string"), ("extra_info", dict, "an object")):
        if row.get(name) is not None and not isinstance(row[name], kind):
            raise MalformedRow(where, f"field {name!r} must be {wanted}, not {_json_type(row[name])}")
    if prompt is None or truth is None or isinstance(truth, str) and not truth.strip():
        return None
    users = [m["content"] for m in prompt if m["role"] == "user" and isinstance(m.get("content"), str)]
    question = users[-1] if users else str(prompt[-1].get("content") or "")
    if not question.strip():
        return None
    if isinstance(truth, str):
        answer = truth.strip()
    elif isinstance(truth, int | float):
        answer = str(truth)
    else:  # a structured ground truth (only with a reward function, which gets it as it is): text for logs
        answer = json.dumps(truth, default=repr)
    return Row(question, answer, dict(row), prompt)


ROLES = ("system", "user", "assistant", "tool")


def _check_messages(messages: Any, where: str, name: str = "messages") -> None:
    """A row's `messages` (or a verl row's `prompt`), when it has them: OpenAI chat messages, each a
    role and text content."""
    if messages is None:
        return
    if not isinstance(messages, list):
        raise MalformedRow(where, f"field {name!r} must be an array of messages, not {_json_type(messages)}")
    if not messages:
        raise MalformedRow(where, f"field {name!r} is empty")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise MalformedRow(where, f"{name}[{i}] must be an object with a role of {', '.join(ROLES)}")
        if not isinstance(m.get("content"), str) and not (m["role"] == "assistant" and m.get("tool_calls")):
            raise MalformedRow(where, f"{name}[{i}].content must be a string")


def _json_type(value: Any) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    return names.get(type(value), "a number" if isinstance(value, int | float) else type(value).__name__)


def _rows(file: Path) -> Iterator[tuple[str, Any]]:
    """(where, row) for every row of a local dataset file or directory."""
    if file.suffix in (".jsonl", ".json") and not file.is_dir():
        yield from _json_rows(file)
        return
    import datasets

    datasets.disable_progress_bars()
    if not file.is_dir() and file.suffix not in FILE_FORMATS:
        raise UnsupportedFile("not a .jsonl, .json, .parquet or .arrow file or a datasets directory")
    try:
        if file.is_dir():
            data = datasets.load_from_disk(str(file))
        else:
            data = datasets.load_dataset(FILE_FORMATS[file.suffix], data_files=str(file), split="train")
    except Exception as e:  # whatever the reader raises, say which file it could not read
        raise UnsupportedFile(f"cannot be read: {type(e).__name__}: {e}") from None
    if isinstance(data, datasets.DatasetDict):
        data = data[next(iter(data))]
    for i, row in enumerate(data):
        yield f"row {i + 1}", row


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


_DECODER = json.JSONDecoder(parse_constant=_refuse_constant)


def _json_rows(file: Path) -> Iterator[tuple[str, Any]]:
    """(where, row) of a JSON Lines file, or of a file holding one JSON array; blank lines are skipped."""
    data = file.read_bytes()
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise MalformedRow(f"line {line}", "not UTF-8 text") from None
    if text.lstrip().startswith("["):
        yield from _json_array_rows(text)
        return
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            yield f"line {n}", _decode(line.strip(), f"line {n}")


def _json_array_rows(text: str) -> Iterator[tuple[str, Any]]:
    """The elements of a JSON array document, each with the line it starts on."""
    ws = re.compile(r"\s*")
    counted, line = 0, 1

    def line_at(i: int) -> int:  # positions only grow: count the newlines once
        nonlocal counted, line
        line, counted = line + text.count("\n", counted, i), i
        return line

    pos = ws.match(text, text.index("[") + 1).end()
    if text.startswith("]", pos):
        return
    while True:
        where = f"line {line_at(pos)}"
        try:
            row, end = _DECODER.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            raise MalformedRow(f"line {e.lineno}", f"not valid JSON: {e.msg} (column {e.colno})") from None
        except (ValueError, RecursionError) as e:
            raise MalformedRow(where, _decode_problem(e)) from None
        yield where, row
        after = ws.match(text, end).end()
        if text.startswith("]", after):
            if text[after + 1:].strip():
                raise MalformedRow(f"line {line_at(after)}", "not valid JSON: text after the closing ']'")
            return
        if not text.startswith(",", after):
            raise MalformedRow(f"line {line_at(after)}", "not valid JSON: expected ',' or ']' after an array element")
        pos = ws.match(text, after + 1).end()


def _decode(text: str, where: str) -> Any:
    try:
        return _DECODER.decode(text)
    except json.JSONDecodeError as e:
        raise MalformedRow(where, f"not valid JSON: {e.msg} (column {e.colno})") from None
    except (ValueError, RecursionError) as e:
        raise MalformedRow(where, _decode_problem(e)) from None


def _decode_problem(e: Exception) -> str:
    return "not valid JSON: nested too deeply" if isinstance(e, RecursionError) else f"not valid JSON: {e}"
