"""RewardModelActor: one replica of a discriminative reward model (`reward.model`), a Hugging Face
sequence-classification checkpoint with one output, scoring finished samples for the rollout
workers (asyncrl/rollout/reward_client.py).

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
from dataclasses import dataclass

from asyncrl.config.schema import Config
from asyncrl.messages import RewardRequest


@dataclass(frozen=True)
class RewardModelSettings:
    """What a reward model replica reads of the run's config (reward.model, cluster.device)."""

    path: str
    max_batch: int
    max_length: int
    device: str = "cpu"
    # CPU: torch's intra-op threads, its share of the cores (reward.model.num_cpus_per_actor); 0: torch's default
    threads: int = 0

    @classmethod
    def of(cls, cfg: Config) -> RewardModelSettings:
        m = cfg.reward.model
        return cls(m.path, m.max_batch, m.max_length, cfg.cluster.device, max(1, int(m.num_cpus_per_actor)))


class RewardModelActor:
    def __init__(self, settings: RewardModelSettings):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.settings = settings
        if settings.device == "cpu" and settings.threads:  # torch would take every core, beside the engines
            torch.set_num_threads(settings.threads)
        self.tokenizer = AutoTokenizer.from_pretrained(settings.path)
        self.tokenizer.truncation_side = "left"  # keep the response
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        dtype = torch.float32 if settings.device == "cpu" else torch.bfloat16
        self.model = AutoModelForSequenceClassification.from_pretrained(settings.path, dtype=dtype)
        # HF's classifiers score the last token that is not padding: they must know the padding id
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.model.to(settings.device).eval()
        self._waiting: list[tuple[list[str], asyncio.Future]] = []
        self._worker: asyncio.Task | None = None
        self.samples = self.passes = 0  # scored so far, and the forward passes that scored them

    def text(self, request: RewardRequest) -> str:
        """The sample as the reward model reads it."""
        if self.tokenizer.chat_template:
            turns = request.messages or [{"role": "user", "content": request.prompt}]
            return self.tokenizer.apply_chat_template(
                [*turns, {"role": "assistant", "content": request.response}], tokenize=False)
        return request.prompt + request.response

    async def score(self, requests: list[RewardRequest]) -> list[float]:
        """One score per request (batched with other callers' requests)."""
        future = asyncio.get_running_loop().create_future()
        self._waiting.append(([self.text(r) for r in requests], future))
        if self._worker is None or self._worker.done():
            self._worker = asyncio.get_running_loop().create_task(self._serve())
        return await future

    async def _serve(self) -> None:
        """Forward passes until nothing waits: each takes the requests waiting, up to max_batch
        samples (a larger request is scored in several passes)."""
        while self._waiting:
            take, n = [], 0
            while self._waiting and (not take or n + len(self._waiting[0][0]) <= self.settings.max_batch):
                texts, future = self._waiting.pop(0)
                take.append((texts, future))
                n += len(texts)
            texts = [t for batch, _ in take for t in batch]
            try:
                scores = await asyncio.to_thread(self._forward, texts)
            except Exception as e:  # every caller of this pass hears of it; the replica goes on
                for _, future in take:
                    if not future.done():  # (a caller that gave up has cancelled its own)
                        future.set_exception(e)
                continue
            i = 0
            for batch, future in take:
                if not future.done():
                    future.set_result(scores[i:i + len(batch)])
                i += len(batch)

    def _forward(self, texts: list[str]) -> list[float]:
        import torch

        scores: list[float] = []
        for i in range(0, len(texts), self.settings.max_batch):
            enc = self.tokenizer(texts[i:i + self.settings.max_batch], return_tensors="pt", padding=True,
                                 truncation=True, max_length=self.settings.max_length).to(self.settings.device)
            with torch.inference_mode():
                scores += self.model(**enc).logits[:, 0].float().tolist()
            self.passes += 1
        self.samples += len(texts)
        return scores

    def health(self) -> bool:
        return True
