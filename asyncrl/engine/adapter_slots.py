"""The LoRA adapters one engine serves, and the requests on each (held by EngineActor).

With trainer.lora the base model stays in vLLM and each weight sync brings the policy as a LoRA
adapter, registered from memory under vLLM id `lora_id(version)`; every new request then uses it.
In pause mode `none` a sync pauses nothing, so several versions' adapters are registered at
once (at most `versions`): each request finishes on the adapter it started with, a request
whose adapter leaves that window is aborted, and an adapter is removed from vLLM only once no
request uses it (vLLM's engine dies if a request's adapter is removed under it).

`asyncrl eval ADAPTER_DIR` serves a PEFT adapter from disk instead (`path`).

Plain bookkeeping, in the engine actor's process: EngineActor makes the vLLM calls it names.
"""

from __future__ import annotations

from typing import Any

from asyncrl.engine.weight_specs import TensorSpecs, adapter_problems


def lora_id(version: int) -> int:
    """vLLM's id for the adapter of policy `version`: vLLM's ids start at 1."""
    return version + 1


class AdapterSlots:
    """Which adapter new requests use, which versions are registered in vLLM, and the requests
    generating on each version's adapter."""

    def __init__(self, rank: int = 0, versions: int = 1, path: str = ""):
        self.rank = rank  # the engine's LoRA rank; 0: no LoRA, syncs bring whole weights
        self.versions = versions  # the adapters registered at once (pause mode none: max_staleness + 1)
        self.path = path  # a PEFT adapter on disk to serve (asyncrl eval)
        self.config: dict | None = None  # PEFT's adapter_config of the synced policy (expect())
        self.request: Any = None  # the vLLM LoRARequest new requests use; None: the base model
        self._registered: set[int] = set()  # the versions whose adapters are registered
        self._on: dict[int, set[str]] = {}  # adapter's version -> requests generating with it

    @property
    def enabled(self) -> bool:
        """Whether the engine runs with LoRA: each request's tokens carry its adapter's version."""
        return self.rank > 0

    def serve_path(self) -> None:
        """New requests use the adapter on disk, if one was given (vLLM loads it from the directory)."""
        if self.path:
            from vllm.lora.request import LoRARequest

            self.request = LoRARequest("asyncrl-adapter", 1, self.path)

    def expect(self, adapter_config: dict | None, checkpoint: TensorSpecs, shapes: dict[str, tuple[int, ...]],
               engine_id: int) -> None:
        """The trainer's syncs will carry an adapter (PEFT's `adapter_config`, tensors of
        `shapes`) or, with None, whole weights; refuse what this engine was not started for."""
        if (adapter_config is not None) != self.enabled:
            sends = "an adapter" if adapter_config else "whole weights"
            raise ValueError(f"engine-{engine_id}: the trainer sends {sends} but this engine was started "
                             f"{'with' if self.enabled else 'without'} LoRA")
        if adapter_config is None:
            return
        problems = adapter_problems(checkpoint, shapes, int(adapter_config["r"]))
        if problems:
            raise ValueError(f"engine-{engine_id}: refusing the adapter ({'; '.join(problems[:5])})")
        self.config = adapter_config

    def use(self, version: int) -> None:
        """New requests use the adapter of `version` (just received), if the policy is one."""
        if self.config is not None:
            from vllm.lora.request import LoRARequest

            # vLLM tells adapters apart by name (and keys its prefix cache by it): one per version.
            # The path is never read: the adapter is registered from memory (vllm_compat.register_lora).
            self.request = LoRARequest(f"asyncrl-policy-v{version}", lora_id(version),
                                       f"/asyncrl/in-memory/v{version}")
            self._registered.add(version)

    def begin(self, request_id: str, version: int) -> Any:
        """A request starts at policy `version`: the LoRARequest it generates with to its end."""
        if self.enabled:
            self._on.setdefault(version, set()).add(request_id)
        return self.request

    def end(self, request_id: str, version: int) -> None:
        """The request that began at `version` is done."""
        if self.enabled:
            self._on[version].discard(request_id)

    def outside_window(self, version: int) -> list[str]:
        """The requests whose adapter leaves the window of `versions` once `version` is the newest."""
        return [rid for v, users in self._on.items() if v <= version - self.versions for rid in users]

    def retire(self, current: int) -> list[int]:
        """Forget the registered adapters that no request uses and that no longer serve new
        requests (not `current`'s); their vLLM ids, for the engine to remove."""
        removed = []
        for version in sorted(self._registered - {current}):
            if not self._on.get(version):
                self._registered.discard(version)
                self._on.pop(version, None)
                removed.append(lora_id(version))
        return removed
