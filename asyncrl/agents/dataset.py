"""The dataset agent: problems from reasoning-gym generators or local files, one prompt
template, the recipe's answer extraction and the task's scorer.

    agents:
      - env_id: gsm8k
        type: dataset
        params: {source: file, path: /data/gsm8k/train.jsonl, heldout_path: /data/gsm8k/test.jsonl,
                 question_field: question, answer_field: answer, answer_regex: "####\\s*(.+)$",
                 prompt_template: "{question}\\nAnswer: "}

Files are read with Hugging Face `datasets` (.jsonl/.json, .parquet, .arrow, or a
`save_to_disk` directory); nothing is downloaded. A row without a question or an answer
is skipped and counted (logged once per file), never a crash.
"""

from __future__ import annotations

import logging
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncrl.agents.api import Agent
from asyncrl.config.schema import AgentConfig, Config, DataConfig
from asyncrl.recipe_hooks import RecipeHooks, load_recipe_hooks
from asyncrl.tasks import Problem, TaskSource

logger = logging.getLogger(__name__)

FILE_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}


@dataclass
class DatasetParams(DataConfig):
    # Python module with extract_answer (and optionally reward); empty: recipe.module.
    module: str = ""


class DatasetAgent(Agent):
    params_class = DatasetParams

    def __init__(self, spec: AgentConfig, params: DatasetParams, cfg: Config):
        super().__init__(spec, params, cfg)
        self.hooks: RecipeHooks = load_recipe_hooks(params.module or cfg.recipe.module)
        self.skipped_rows = 0

    def reward(self, problem: Problem, response: str) -> float:
        return self.hooks.reward(problem, response)

    def load_splits(self) -> dict[str, list[Problem]]:
        p = self.params
        if p.source == "file":
            return self._file_splits()
        source = TaskSource(p)
        splits = {"train": source.train, "heldout": source.heldout}
        for problem in splits["train"] + splits["heldout"]:  # ids unique across envs
            problem.prompt_id, problem.env_id = f"{self.env_id}/{problem.prompt_id}", self.env_id
        return splits

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
        train = [self._problem("train", i, r) for i, r in enumerate(rows[: p.train_size]) if r[0] not in seen]
        return {"train": train, "heldout": heldout}

    def _problem(self, split: str, index: int, row: tuple[str, str, dict[str, Any]]) -> Problem:
        question, answer, entry = row
        return Problem(prompt_id=f"{self.env_id}/{split}/{index}", task="", question=question,
                       prompt=self.params.prompt_template.format(question=question), answer=answer,
                       entry=entry, agent_loop=str(entry.get("agent_loop") or ""), env_id=self.env_id)

    def _read(self, path: str) -> list[tuple[str, str, dict[str, Any]]]:
        """(question, reference answer, row) for every usable row of a local file."""
        import datasets

        datasets.disable_progress_bars()
        p = self.params
        file = Path(path)
        if file.is_dir():
            data = datasets.load_from_disk(str(file))
        elif file.suffix in FILE_FORMATS:
            data = datasets.load_dataset(FILE_FORMATS[file.suffix], data_files=str(file), split="train")
        else:
            raise ValueError(f"env {self.env_id!r}: {path}: not a .jsonl, .json, .parquet or .arrow file "
                             "or a datasets directory")
        if isinstance(data, datasets.DatasetDict):
            data = data[next(iter(data))]
        pattern = re.compile(p.answer_regex, re.S | re.M) if p.answer_regex else None
        rows, skipped = [], 0
        for row in data:
            question, answer = row.get(p.question_field), row.get(p.answer_field)
            if pattern is not None and answer is not None:
                match = pattern.search(str(answer))
                answer = match.group(1).strip() if match else None
            if not isinstance(question, str) or not question.strip() or answer is None or str(answer).strip() == "":
                skipped += 1
                continue
            rows.append((question, str(answer).strip(), dict(row)))
        if skipped:
            logger.warning("env %s: skipped %d of %d rows of %s without a usable %r or %r%s", self.env_id, skipped,
                           len(data), path, p.question_field, p.answer_field,
                           f" (matching answer_regex {p.answer_regex!r})" if pattern else "")
        self.skipped_rows += skipped
        if not rows:
            raise ValueError(f"env {self.env_id!r}: {path} has no usable rows (fields {p.question_field!r}, "
                             f"{p.answer_field!r})")
        return rows
