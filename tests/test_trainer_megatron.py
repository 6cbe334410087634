"""Megatron trainer ranks on CPU (gloo) in Ray actors: HF <-> Megatron conversion,
tensor parallelism, and distributed checkpoints across tensor-parallel sizes."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import pytest
import ray
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncrl.algorithm.plan import AdvantagePlan
from asyncrl.config.schema import LossConfig
from asyncrl.run_config import load_config
from tests.conftest import BASE_MODEL
from tests.trainer_data import make_groups
from tests.trainer_probes import ReusedRanks

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tokenizer(base_model):
    return AutoTokenizer.from_pretrained(base_model)


@pytest.fixture(scope="module")
def run_trainer(ray_cluster) -> Iterator[Callable]:
    """`run_trainer(overrides, fn)`: `fn` of a set-up trainer of `overrides`; two rank processes serve
    the module's trainers in turn (trainer_probes.ReusedRanks: megatron-core imported once each)."""
    ranks = ReusedRanks(2)

    def run(overrides, fn):
        with ranks.trainer(load_config(overrides)) as group:
            return fn(group)

    yield run
    ranks.kill()


def exported_state(group, path) -> dict[str, torch.Tensor]:
    return load_file(f"{group.export_hf(str(path))}/model.safetensors")


def test_export_without_training_is_the_hf_checkpoint_and_logits_match(run_trainer, base_model, tmp_path):
    """HF -> Megatron -> HF is exact, and Megatron's logits equal HF's (fp32, tolerance 1e-4)."""
    hf_model = AutoModelForCausalLM.from_pretrained(base_model).eval()
    ids = [[5, 17, 42, 99, 7, 3, 250, 11], [100, 200, 300, 400, 5, 6, 7, 8]]

    def check(group):
        logits = group.on_ranks(lambda r: r.forward_logits.remote(ids))
        with torch.no_grad():
            ref = hf_model(torch.tensor(ids)).logits
        assert logits.shape == ref.shape
        assert torch.allclose(logits, ref, atol=1e-4), (logits - ref).abs().max()
        return exported_state(group, tmp_path / "hf")

    state = run_trainer([], check)
    original = load_file(f"{base_model}/model.safetensors")
    assert set(state) == set(original)
    assert all(torch.equal(state[k], original[k]) for k in original)


def check_world_store(group) -> None:
    """The trainer world's store (torch's TCPStore, rank 0's) listens on loopback only, not on every
    interface, and an outsider who finds it lists only names sealed with the formation's secret
    (asyncrl/sync/group_store.py): the trainer's own rendezvous, as the weight group's."""
    from datetime import timedelta

    from asyncrl.sync.group_store import LOOPBACK, NAME_PREFIX
    from tests.test_security_weight_sync import _listening

    port = ray.get(group.ranks[0].__ray_call__.remote(lambda r: r._world_store.store.port))
    assert _listening(port) == [LOOPBACK]
    outsider = torch.distributed.TCPStore(LOOPBACK, port, None, is_master=False, timeout=timedelta(seconds=30))
    names = outsider.list_keys()
    assert names and all(re.fullmatch(re.escape(NAME_PREFIX) + "[0-9a-f]{32}", n) for n in names), names


def test_tensor_parallel_2_trains_like_1_and_checkpoints_load_across_sizes(run_trainer, tokenizer, tmp_path):
    """Same data, TP=1 vs TP=2 (two gloo processes, their world's store sealed on loopback), PPO with a
    critic (gae): same losses, grad norms, weights and critic metrics; a TP=2 distributed checkpoint then
    loads into a TP=1 trainer unchanged, its critic and both optimizers too (the next step is TP=2's next step)."""
    steps = [make_groups(tokenizer, seed=s) for s in range(3)]
    overrides = ["trainer.lr=1e-3", "trainer.micro_batch_size=4", "algorithm.advantage=gae",
                 "algorithm.critic.lr=3e-3", "algorithm.critic.lam=0.9"]

    def train(group):
        metrics = [group.train_step(groups, 0).metrics for groups in steps[:2]]
        return metrics, exported_state(group, tmp_path / f"hf{group.world_size}")

    m1, w1 = run_trainer(overrides, train)

    def train_and_save(group):
        check_world_store(group)
        result = train(group)
        group.save_checkpoint(str(tmp_path / "ckpt_tp2"))
        values = group.on_ranks(lambda r: r.critic_values.remote(steps[2]))
        return result, values, group.train_step(steps[2], 0).metrics

    (m2, w2), values2, next2 = run_trainer([*overrides, "trainer.tensor_parallel_size=2"], train_and_save)
    for a, b in zip(m1, m2):
        assert a["train/loss"] == pytest.approx(b["train/loss"], rel=1e-4, abs=1e-6)
        assert a["train/grad_norm"] == pytest.approx(b["train/grad_norm"], rel=1e-4)
        assert a["train/tokens"] == b["train/tokens"]
        for name in ("critic/value_loss", "critic/grad_norm", "critic/values_mean", "critic/explained_variance"):
            assert a[name] == pytest.approx(b[name], rel=1e-4, abs=1e-6), name
    # the critic starts at 0 (zero head) and learns: the second step's values move, its loss falls
    assert m1[0]["critic/values_mean"] == 0 and m1[1]["critic/values_mean"] != 0
    assert m1[1]["critic/value_loss"] < m1[0]["critic/value_loss"]
    # Adam normalises each gradient element, so an element whose gradient is near zero takes
    # a step of any size from float-rounding noise alone (seen: 2% of the movement on one
    # element). Compare the weights as a whole: TP=2 must move them where TP=1 did.
    base = load_file(f"{BASE_MODEL}/model.safetensors")
    moved = torch.cat([(w1[k] - base[k]).flatten() for k in w1]).norm()
    differs = torch.cat([(w1[k] - w2[k]).flatten() for k in w1]).norm()
    assert moved > 1e-2
    worst = sorted(((float((w1[k] - w2[k]).abs().max()), k) for k in w1), reverse=True)[:4]
    assert differs < 1e-3 * moved, (float(differs), float(moved), worst)

    def load(group):
        step = group.load_checkpoint(str(tmp_path / "ckpt_tp2"))
        values = group.on_ranks(lambda r: r.critic_values.remote(steps[2]))
        return step, exported_state(group, tmp_path / "hf_loaded"), values, group.train_step(steps[2], 0).metrics

    step, w_loaded, values_loaded, next_loaded = run_trainer(overrides, load)
    assert step == 2
    assert all(torch.equal(w_loaded[k], w2[k]) for k in w2)
    assert torch.allclose(values_loaded, values2, atol=1e-5), (values_loaded - values2).abs().max()
    for name in ("train/loss", "train/grad_norm", "critic/value_loss", "critic/grad_norm"):
        assert next_loaded[name] == pytest.approx(next2[name], rel=1e-4, abs=1e-6), name


def test_decoupled_ppo_with_several_updates_clips_against_the_policy_before_the_step(run_trainer, tokenizer):
    """With two updates per step, the second one's ratio pi_theta / pi_prox moves away from 1
    (pi_prox is the policy before the step), so clipping can act; with one update it is exactly 1."""
    groups = make_groups(tokenizer, seed=3)
    base = ["algorithm.loss.type=decoupled_ppo", "trainer.lr=3e-3"]
    one = run_trainer(base, lambda g: g.train_step(groups, 0).metrics)
    two = run_trainer([*base, "trainer.mini_batches_per_step=2"], lambda g: g.train_step(groups, 0).metrics)
    assert one["train/ratio_max"] == pytest.approx(1.0, abs=1e-5) and one["train/clip_fraction_mean"] == 0
    assert two["train/ratio_max"] > 1.01


def reference_loss_hf(model, samples) -> torch.Tensor:
    """The GRPO loss of asyncrl/algorithm/losses.py written out per token on an HF model."""
    total = torch.zeros(())
    for s in samples:
        logp_all = torch.log_softmax(model(torch.tensor([s.tokens])).logits[0], -1)
        for j, token in enumerate(s.tokens[s.prompt_len:]):
            ratio = torch.exp(logp_all[s.prompt_len - 1 + j, token] - s.mu[j])
            objective = torch.minimum(ratio * s.advantage, ratio.clamp(1 - 0.2, 1 + 0.28) * s.advantage)
            total = total - s.weights[j] * s.mask[j] * objective
    return total


def reference_gspo_loss_hf(model, samples, lo: float, hi: float) -> torch.Tensor:
    """GSPO written out per sequence on an HF model: the mean over sequences of the clipped
    objective of s = exp(mean token log-ratio)."""
    total = torch.zeros(())
    for s in samples:
        logp_all = torch.log_softmax(model(torch.tensor([s.tokens])).logits[0], -1)
        log_r = [logp_all[s.prompt_len - 1 + j, token] - s.mu[j] for j, token in enumerate(s.tokens[s.prompt_len:])]
        ratio = torch.exp(torch.stack(log_r).mean())
        total = total - torch.minimum(ratio * s.advantage, ratio.clamp(1 - lo, 1 + hi) * s.advantage)
    return total / len(samples)


def test_loss_gradient_equals_a_per_token_reference_on_hf(run_trainer, base_model, tokenizer):
    """The whole path (packing, masks, logprob indexing, loss, megatron's backward) gives the
    gradient that the formula gives on the HF model, token by token: with micro-batches of 5
    samples; of at most 100 tokens (a token budget: 4 x 3 samples of 30-31 tokens, the same gradient); and with
    the loss's fp32 logits taken 3 tokens at a time (chunks recomputed in backward). GSPO's
    sequence ratio too, over sequences packed together (a band wide enough for both sides)."""
    from asyncrl.trainer.batch import assign_weights, build_samples

    groups = make_groups(tokenizer, n_groups=3, n=4, seed=7)
    hf = AutoModelForCausalLM.from_pretrained(base_model)
    for g in groups:  # behaviour logprobs slightly off the policy, so ratios are not all 1
        for t in g.trajectories:
            with torch.no_grad():
                lp = torch.log_softmax(hf(torch.tensor([t.prompt_token_ids + t.response_token_ids])).logits[0], -1)
            n0 = len(t.prompt_token_ids)
            t.segments[0].logprobs = [lp[n0 - 1 + j, x].item() - 0.1 * (j % 3) for j, x in
                                      enumerate(t.response_token_ids)]
    vocab = hf.config.vocab_size
    gspo = LossConfig(type="gspo", aggregation="sequence", seq_clip_eps_low=0.02, seq_clip_eps_high=0.03)
    *grads, gspo_grad = run_trainer(["trainer.micro_batch_size=5"], lambda group: [
        group.on_ranks(lambda r: r.embedding_grad.remote(groups)),
        group.on_ranks(lambda r: r.embedding_grad.remote(groups, max_tokens=100)),
        group.on_ranks(lambda r: r.embedding_grad.remote(groups, logit_chunk=3 * vocab)),
        group.on_ranks(lambda r: r.embedding_grad.remote(groups, loss=gspo))])
    samples = build_samples(groups, AdvantagePlan.of(load_config([]).algorithm)).samples
    assign_weights(samples, "token")
    hf.zero_grad()
    reference_loss_hf(hf, samples).backward()
    ref = hf.model.embed_tokens.weight.grad
    assert ref.norm() > 0.1 and sorted({len(s.tokens) for s in samples}) == [30, 31]
    assert grads[0][1] == [5, 5, 2] and grads[1][1] == [3, 3, 3, 3]
    for grad, _ in grads:
        assert grad.shape == ref.shape
        assert torch.allclose(grad, ref, atol=1e-5, rtol=1e-4), (grad - ref).abs().max()
    assign_weights(samples, "sequence")
    hf.zero_grad()
    reference_gspo_loss_hf(hf, samples, 0.02, 0.03).backward()
    ref = hf.model.embed_tokens.weight.grad
    assert ref.norm() > 0.01
    assert torch.allclose(gspo_grad[0], ref, atol=1e-5, rtol=1e-4), (gspo_grad[0] - ref).abs().max()


def test_lora_at_tensor_parallel_2_trains_like_1_and_its_checkpoint_restores_the_adapters(run_trainer, tokenizer,
                                                                                        tmp_path):
    """LoRA adapters split like their layers (docs/lora.md): TP=2 gives TP=1's losses, gradient
    norms and exported adapters; a TP=2 checkpoint restores adapters and Adam state, so the step
    after it is the same step again."""
    steps = [make_groups(tokenizer, seed=s) for s in range(2)]
    overrides = ["trainer.lora.rank=8", "trainer.lr=1e-2", "trainer.micro_batch_size=4"]

    def train(group):
        metrics = [group.train_step(groups, i).metrics for i, groups in enumerate(steps)]
        path = group.export_hf(str(tmp_path / f"hf{group.world_size}"))
        return metrics, load_file(f"{path}/adapter/adapter_model.safetensors"), load_file(f"{path}/model.safetensors")

    m1, a1, w1 = run_trainer(overrides, train)

    def train_save_and_restore(group):
        result = train(group)
        group.save_checkpoint(str(tmp_path / "ckpt"))
        after = group.train_step(make_groups(tokenizer, seed=5), 2).metrics["train/loss"]
        assert group.load_checkpoint(str(tmp_path / "ckpt")) == len(steps)
        again = group.train_step(make_groups(tokenizer, seed=5), 2).metrics["train/loss"]
        return (*result, after, again)

    m2, a2, w2, after, again = run_trainer([*overrides, "trainer.tensor_parallel_size=2"], train_save_and_restore)
    for a, b in zip(m1, m2):
        assert a["train/loss"] == pytest.approx(b["train/loss"], rel=1e-4, abs=1e-6)
        assert a["train/grad_norm"] == pytest.approx(b["train/grad_norm"], rel=1e-4)
    assert after == again
    # B starts at 0, so the adapters are what training made; Adam's steps of ~lr where a
    # gradient is ~0 leave single elements up to ~1e-3 apart (docs/lora.md): compare the whole
    assert set(a1) == set(a2) and all(torch.count_nonzero(a1[k]) for k in a1)
    moved = torch.cat([a1[k].flatten() for k in a1 if "lora_B" in k]).norm()
    differs = torch.cat([(a1[k] - a2[k]).flatten() for k in a1]).norm()
    assert moved > 1e-2 and differs < 1e-2 * moved, (float(differs), float(moved))
    base = load_file(f"{BASE_MODEL}/model.safetensors")
    assert set(w1) == set(w2) == set(base)
    assert max(float((w1[k] - w2[k]).abs().max()) for k in w1) < 1e-3
    assert any(not torch.equal(w1[k], base[k]) for k in base)


def test_a_non_finite_gradient_skips_the_update_and_the_next_step_trains(run_trainer, tokenizer, tmp_path):
    """The trainer's last guard (docs/security.md): a NaN that reaches the loss (here a behaviour
    logprob) never reaches the weights: the update is skipped and counted; the next step trains."""
    poisoned = make_groups(tokenizer, seed=3)
    poisoned[0].trajectories[0].segments[0].logprobs[0] = float("nan")

    def steps(group):
        before = exported_state(group, tmp_path / "before")
        skipped = group.train_step(poisoned, 0).metrics
        after_skip = exported_state(group, tmp_path / "skipped")
        trained = group.train_step(make_groups(tokenizer, seed=4), 0).metrics
        return before, skipped, after_skip, trained, exported_state(group, tmp_path / "trained")

    before, skipped, after_skip, trained, after = run_trainer([], steps)
    assert skipped["train/updates_skipped_nonfinite"] == 1 and trained["train/updates_skipped_nonfinite"] == 1
    assert all(torch.equal(before[k], after_skip[k]) for k in before)
    assert all(torch.isfinite(after[k]).all() for k in after) and any(not torch.equal(before[k], after[k])
                                                                       for k in before)
