"""The text model of a vision-language checkpoint, as a checkpoint of its own:

    asyncrl text-model SRC DST

Qwen3.5 and Gemma 3 4B-27B are published as vision-language models (`Qwen3_5ForConditionalGeneration`,
`Qwen3_5MoeForConditionalGeneration`, `Gemma3ForConditionalGeneration`); the trainer and the engine
take their text model (`Qwen3_5ForCausalLM`, `Qwen3_5MoeForCausalLM`, `Gemma3ForCausalLM`;
docs/models.md). DST gets the language model's tensors under the text model's names (read and
written one shard at a time), the text config with the text model's model_type and architecture,
and the tokenizer's files; the vision tower, its projector and Qwen3.5's multi-token-prediction
layers are left out, and so is the vision processor's config. On text alone the text model computes
what the vision-language model computes (tests/test_model_families.py).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

# The vision-language model_type -> its text model's (model_type, architecture)
TEXT_MODELS = {
    "qwen3_5": ("qwen3_5_text", "Qwen3_5ForCausalLM"),
    "qwen3_5_moe": ("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
}
# Where each layout keeps the language model's tensors -> where the text model keeps them: Qwen3.5's
# (and transformers 5's) names, and the names Gemma 3's checkpoints were published with.
PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
            ("language_model.lm_head.", "lm_head."), ("lm_head.", "lm_head."))
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
                   "generation_config.json")


def text_name(name: str) -> str | None:
    """The text model's name of a vision-language checkpoint's tensor (None: not the language model's)."""
    for source, target in PREFIXES:
        if name.startswith(source):
            return target + name[len(source):]
    return None


def text_config(raw: dict, tied: bool) -> dict:
    """The text model's config.json from the vision-language one's; `tied`: the checkpoint has no
    output layer of its own (its weights decide, not the two configs' flags)."""
    model_type, architecture = TEXT_MODELS[raw["model_type"]]
    text = dict(raw.get("text_config") or {})
    text.update(model_type=model_type, architectures=[architecture], tie_word_embeddings=tied)
    for key in ("dtype", "torch_dtype", "transformers_version"):
        if key in raw and key not in text:
            text[key] = raw[key]
    rope = text.get("rope_parameters")
    if isinstance(rope, dict):
        # Qwen3.5's 3-D rope (time, height, width sections) is plain rope for text, whose three position
        # streams are one: the text model gets plain rope
        text["rope_parameters"] = {k: v for k, v in rope.items() if not k.startswith("mrope")}
    return text


def write_text_model(source: str | Path, target: str | Path) -> Path:
    """Write the text model of the vision-language checkpoint at `source` into `target` (module
    docstring); returns `target`. A ValueError names what is not such a checkpoint."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    source, target = Path(source), Path(target)
    if target.resolve() == source.resolve():  # its shards would be overwritten while read
        raise ValueError(f"{target}: the text model goes into another directory than its source")
    raw = json.loads((source / "config.json").read_text())
    if raw.get("model_type") not in TEXT_MODELS:
        raise ValueError(f"{source}: model_type {raw.get('model_type')!r} is not a vision-language model whose text "
                         f"model asyncrl takes ({', '.join(TEXT_MODELS)})")
    index_file = source / "model.safetensors.index.json"
    shards = (sorted(set(json.loads(index_file.read_text())["weight_map"].values())) if index_file.exists()
              else ["model.safetensors"])
    renamed = {}  # shard -> {its name: the text model's}, from the shards' headers, before anything is written
    for shard in shards:
        with safe_open(str(source / shard), framework="pt") as f:
            renamed[shard] = {n: text_name(n) for n in f.keys() if text_name(n) is not None}
    if not any(new.startswith("model.embed_tokens.") for names in renamed.values() for new in names.values()):
        raise ValueError(f"{source}: no language model's tensors under {', '.join(p for p, _ in PREFIXES)}")
    target.mkdir(parents=True, exist_ok=True)
    weight_map, total = {}, 0
    for shard, names in renamed.items():
        if not names:
            continue
        with safe_open(str(source / shard), framework="pt") as f:
            tensors = {new: f.get_tensor(n) for n, new in names.items()}
        save_file(tensors, str(target / shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, shard))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    if index_file.exists():
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (target / index_file.name).write_text(json.dumps(index, indent=2) + "\n")
    config = text_config(raw, tied="lm_head.weight" not in weight_map)
    (target / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy(source / name, target / name)
    return target


def main() -> None:
    parser = argparse.ArgumentParser(prog="asyncrl text-model", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", help="a vision-language checkpoint directory (Qwen3.5, Qwen3.5-MoE, Gemma 3)")
    parser.add_argument("target", help="the directory to write its text model into")
    args = parser.parse_args()
    try:
        out = write_text_model(args.source, args.target)
    except (ValueError, OSError) as e:
        raise SystemExit(f"asyncrl text-model: {e}") from None
    model_type = json.loads((out / "config.json").read_text())["model_type"]
    print(f"{out}: the text model ({model_type}); train it with model.path={out}")


if __name__ == "__main__":
    main()
