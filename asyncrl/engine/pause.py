"""What every engine (EngineActor on vLLM, SimEngine) accepts as a pause, checked in one place."""

from __future__ import annotations

from asyncrl.config.schema import PAUSE_MODES


def engines_stream(pause_mode: str) -> bool:
    """Only `keep` pauses let a request outlive its weights; otherwise vLLM need not stream."""
    return pause_mode == "keep"


def check_pause(mode: str, stream_outputs: bool, engine_id: int) -> None:
    """A pause mode the engine can honour: `keep` needs per-token versions (a streaming engine)."""
    if mode not in PAUSE_MODES or mode == "none":  # none: a sync that does not pause (LoRA adapters)
        raise ValueError(f"pause mode {mode!r}: must be one of abort, keep")
    if mode == "keep" and not stream_outputs:
        raise ValueError(f"engine-{engine_id}: pause('keep') needs per-token versions, but this engine "
                         "was started with stream_outputs=False (for algorithm.pause_mode=abort)")
