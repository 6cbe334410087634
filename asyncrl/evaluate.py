"""`asyncrl eval`: a policy's accuracy on the held-out problems of every agent of a recipe.

    asyncrl eval recipe=arith                                 # the recipe's base model
    asyncrl eval runs/arith/2026-11-21_10-00-00 recipe=arith  # a run's final policy
    asyncrl eval RUN_DIR/checkpoints/step_000020 recipe=arith # a checkpoint (its hf/ export)
    asyncrl eval RUN_DIR/final_policy/adapter recipe=arith   # a LoRA run's adapter (PEFT), on its base
    asyncrl eval recipe=arith eval.endpoint=http://127.0.0.1:8000/v1   # any OpenAI-compatible server
    python -m asyncrl.evaluate recipe=arith                   # the same as the first

Each agent runs its own loop (tool calls, multi-turn, remote env servers) through vLLM in
this process (no Ray). Prints greedy accuracy and unbiased pass@k (eval.n_samples samples
per problem at eval.temperature), per env when there are several, and writes them to
eval.json in the run directory.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import asdict
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from asyncrl.config import CONF_DIR
from asyncrl.run_config import validate_or_exit, validate_shown_config
from asyncrl.trainer.safe_checkpoint import ADAPTER_CONFIG_MAX_BYTES, read_checkpoint_json


def resolve_checkpoint(path: str) -> list[str]:
    """The overrides for what a user calls a checkpoint: a Hugging Face directory, a run directory
    (its final_policy), a checkpoint directory (RUN_DIR/checkpoints/step_N: its hf/), or a PEFT
    LoRA adapter (adapter_config.json: its base model, with eval.adapter)."""
    p = Path(path)
    if (p / "adapter_config.json").is_file():
        config = read_checkpoint_json(p / "adapter_config.json", ADAPTER_CONFIG_MAX_BYTES)  # not sparse, capped
        base = config.get("base_model_name_or_path", "") if isinstance(config, dict) else ""
        return [_override("model.path", str(base), p / "adapter_config.json"),
                _override("eval.adapter", str(p.resolve()), p)]
    for candidate in (p, p / "final_policy", p / "hf"):
        if (candidate / "config.json").is_file():
            return [_override("model.path", str(candidate.resolve()), candidate)]
    raise ValueError(f"{path!r} is not a checkpoint: expected a Hugging Face directory (config.json), a run "
                     "directory with final_policy/, RUN_DIR/checkpoints/step_N with hf/, or a PEFT adapter "
                     "directory (adapter_config.json)")


# What a path or hub id taken from a file or a directory name may hold to become an override: a
# `${...}` there would be resolved by OmegaConf (an environment variable printed in an error), and
# Hydra's grammar gives meaning to quotes, commas, brackets and spaces.
_PLAIN = re.compile(r"[\w./@:+~-]+")


def _override(key: str, value: str, source: Path) -> str:
    if not _PLAIN.fullmatch(value):
        raise ValueError(f"{source}: {key} would be {value!r}, which is not a plain path or hub id (letters, "
                         "digits and ._/@:+~- only); it is never read as config syntax")
    return f"{key}={value}"


@hydra.main(config_path=str(CONF_DIR), config_name="evaluate", version_base="1.3")
def _hydra_main(dict_cfg: DictConfig) -> None:
    cfg = validate_or_exit(dict_cfg)
    from asyncrl.evaluation import evaluate

    result = evaluate(cfg)
    out = Path(cfg.run.output_dir or HydraConfig.get().runtime.output_dir) / "eval.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(asdict(result), indent=2) + "\n")
    print(result.summary())
    print(f"results: {out}")


def main() -> None:
    # `asyncrl eval CHECKPOINT key=value ...`: the first argument, when it is not an override or a
    # flag, is the policy to evaluate.
    if len(sys.argv) > 1 and "=" not in sys.argv[1] and not sys.argv[1].startswith("-"):
        try:
            model = resolve_checkpoint(sys.argv[1])
        except ValueError as e:
            sys.exit(f"asyncrl eval: {e}")
        sys.argv = [sys.argv[0], *sys.argv[2:], *model]
    validate_shown_config("evaluate")
    _hydra_main()


if __name__ == "__main__":
    main()
