"""RewardModelActor: one replica of a discriminative reward model, scoring finished samples for the
rollout workers (asyncrl/reward/clients.py); a served model of kind HF_MODEL
(asyncrl/reward/services.py). Two kinds of checkpoint, each a Hugging Face classifier with one output:

- an outcome reward model (`reward.model`), `*ForSequenceClassification`: one score per sample,
  the head's output at its last token;
- a process reward model (`reward.prm`), `*ForTokenClassification`: the response is cut into
  steps at `step_separator`; a step's score is the head's output at the step's last token, and
  the sample's score the steps' `aggregate` (min: a chain is as good as its worst step, as PRM
  papers rank; mean; last). A response with no step scores 0.

Each sample is read as the reward model reads text: the conversation (the prompt's messages, or
its text as one user turn) and the response as the assistant's turn, through the reward model's
own chat template where its tokenizer has one, else the prompt's text followed by the response
(the policy's view). Tokens past `max_length` are cut on the left, so the response is kept.

Requests from every worker are batched: a request waits while a forward pass runs, and the
next pass takes up to `max_batch` of the samples waiting. The forward passes run in a thread, so
health checks and new requests are answered meanwhile. Plain transformers: a reward model of
a few billion parameters on one GPU is what verl and OpenRLHF serve this way too.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass

import numpy as np

from asyncrl.config.schema import ProcessRewardConfig, RewardModelConfig
from asyncrl.messages import RewardRequest

AGGREGATES = {"min": min, "mean": lambda xs: sum(xs) / len(xs), "last": lambda xs: xs[-1]}


@dataclass(frozen=True)
class RewardModelSettings:
    """What a reward model replica reads of the run's config (its section, cluster.device)."""

    path: str
    max_batch: int
    max_length: int
    device: str = "cpu"
    # CPU: torch's intra-op threads, its share of the cores (num_cpus_per_actor); 0: torch's default
    threads: int = 0
    step_separator: str = ""  # a process reward model's ("": an outcome reward model)
    aggregate: str = "min"  # of its steps' scores

    @classmethod
    def of(cls, section: RewardModelConfig | ProcessRewardConfig, device: str) -> RewardModelSettings:
        steps = (section.step_separator, section.aggregate) if isinstance(section, ProcessRewardConfig) else ("", "min")
        return cls(section.path, section.max_batch, section.max_length, device, max(1, int(section.num_cpus_per_actor)),
                   *steps)


@dataclass(frozen=True)
class Sample:
    text: str
    step_ends: tuple[int, ...] = ()  # a process reward model's: where each step ends in `text`


class RewardModelActor:
    def __init__(self, settings: RewardModelSettings):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification, AutoTokenizer

        self.settings = settings
        if settings.device == "cpu" and settings.threads:  # torch would take every core, beside the engines
            torch.set_num_threads(settings.threads)
        self.tokenizer = AutoTokenizer.from_pretrained(settings.path)
        if settings.step_separator and not self.tokenizer.is_fast:
            raise ValueError(f"{settings.path}: a process reward model needs a fast tokenizer (tokenizer.json): "
                             "its steps are placed by the tokens' character offsets")
        self.tokenizer.truncation_side = "left"  # keep the response
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        dtype = torch.float32 if settings.device == "cpu" else torch.bfloat16
        head = AutoModelForTokenClassification if settings.step_separator else AutoModelForSequenceClassification
        self.model = head.from_pretrained(settings.path, dtype=dtype)
        # HF's classifiers score the last token that is not padding: they must know the padding id
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.model.to(settings.device).eval()
        self._waiting: list[tuple[list[Sample], asyncio.Future]] = []
        self._worker: asyncio.Task | None = None
        self.samples = self.passes = 0  # scored so far, and the forward passes that scored them

    @staticmethod
    def _turns(request: RewardRequest) -> list[dict]:
        """The conversation before the response: the prompt's messages, or its text as one user turn."""
        return request.messages or [{"role": "user", "content": request.prompt}]

    def text(self, request: RewardRequest) -> str:
        """The sample as the reward model reads it."""
        if self.tokenizer.chat_template:
            return self.tokenizer.apply_chat_template(
                [*self._turns(request), {"role": "assistant", "content": request.response}], tokenize=False)
        return request.prompt + request.response

    def sample(self, request: RewardRequest) -> Sample:
        """The text, and for a process reward model where each step of the response ends in it.
        ValueError (the sample's score fails, counted) where the chat template rewrote the response."""
        text = self.text(request)
        if not self.settings.step_separator:
            return Sample(text)
        # the response starts after the prompt as the model reads it: a template's generation prompt
        before = request.prompt
        if self.tokenizer.chat_template:
            before = self.tokenizer.apply_chat_template(self._turns(request), tokenize=False,
                                                        add_generation_prompt=True)
        start = text.find(request.response, len(before)) if text.startswith(before) else -1
        if start < 0:
            raise ValueError("the process reward model's chat template rewrites the response (not found in the "
                             "text it reads): its steps cannot be placed")
        ends, at = [], start
        for step in request.response.split(self.settings.step_separator):
            at += len(step)
            if step.strip():
                ends.append(at)
            at += len(self.settings.step_separator)
        return Sample(text, tuple(ends))

    async def score(self, requests: list[RewardRequest]) -> list[float]:
        """One score per request (batched with other callers' requests)."""
        future = asyncio.get_running_loop().create_future()
        self._waiting.append(([self.sample(r) for r in requests], future))
        if self._worker is None or self._worker.done():
            self._worker = asyncio.get_running_loop().create_task(self._serve())
        return await future

    async def _serve(self) -> None:
        """Forward passes until nothing waits: each takes the requests waiting, up to max_batch
        samples (a larger request is scored in several passes)."""
        while self._waiting:
            take, n = [], 0
            while self._waiting and (not take or n + len(self._waiting[0][0]) <= self.settings.max_batch):
                part, future = self._waiting.pop(0)
                take.append((part, future))
                n += len(part)
            batch = [s for part, _ in take for s in part]
            try:
                scores = await asyncio.to_thread(self._forward, batch)
            except Exception as e:  # every caller of this pass hears of it; the replica goes on
                for _, future in take:
                    if not future.done():  # (a caller that gave up has cancelled its own)
                        future.set_exception(e)
                continue
            i = 0
            for part, future in take:
                if not future.done():
                    future.set_result(scores[i:i + len(part)])
                i += len(part)

    def _forward(self, samples: list[Sample]) -> list[float]:
        import torch

        scores: list[float] = []
        for i in range(0, len(samples), self.settings.max_batch):
            batch = samples[i:i + self.settings.max_batch]
            enc = self.tokenizer([s.text for s in batch], return_tensors="pt", padding=True, truncation=True,
                                 max_length=self.settings.max_length,
                                 return_offsets_mapping=bool(self.settings.step_separator))
            offsets = enc.pop("offset_mapping", None)
            with torch.inference_mode():
                logits = self.model(**enc.to(self.settings.device)).logits[..., 0].float().cpu()
            if offsets is None:
                scores += logits.tolist()
            else:
                scores += [self._steps_score(s, logits[k], offsets[k], enc["attention_mask"][k].cpu())
                           for k, s in enumerate(batch)]
            self.passes += 1
        self.samples += len(samples)
        return scores

    def _steps_score(self, sample: Sample, logits, offsets, mask) -> float:
        """A process reward model's score of one sample: its steps' outputs at each step's last token
        (the last token that starts before the step's end), aggregated. Steps cut off on the left
        (past max_length) are not scored."""
        kept = (mask.numpy() == 1) & (offsets[:, 1].numpy() > 0)  # special tokens have empty offsets
        positions = np.flatnonzero(kept)
        starts = offsets[:, 0].numpy()[positions]
        last = np.searchsorted(starts, np.asarray(sample.step_ends), side="left") - 1
        steps = [float(logits[positions[j]]) for j in last if j >= 0]
        return AGGREGATES[self.settings.aggregate](steps) if steps else 0.0

    def health(self) -> bool:
        return True

    def pid(self) -> int:
        """Its process (the faults bench kills it by this)."""
        return os.getpid()
