"""`asyncrl train`: validate the config, then run the asynchronous training driver.

    asyncrl train recipe=arith
    asyncrl train recipe=arith algorithm=sync trainer.lr=5e-5
    asyncrl train recipe=arith --cfg job        # print the resolved config (validated) and exit
    python -m asyncrl.train recipe=arith        # the same

The config is validated before any actor starts, and before `--cfg job` prints it; a bad
value exits with status 2 and one message per problem naming the key, the value and what
would be valid. The run directory (Hydra's, or run.output_dir) receives metrics.jsonl,
plots.png, checkpoints, the final policy in Hugging Face format and summary.json.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from asyncrl.config import CONF_DIR
from asyncrl.run_config import validate_or_exit, validate_shown_config

logger = logging.getLogger(__name__)


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def _hydra_main(dict_cfg: DictConfig) -> None:
    cfg = validate_or_exit(dict_cfg, trains=True)
    from asyncrl.driver import run_training
    from asyncrl.monitoring.plot import plot_run

    run_dir = Path(cfg.run.output_dir or HydraConfig.get().runtime.output_dir)
    try:
        summary = run_training(cfg, run_dir)
    except KeyboardInterrupt:
        print(f"asyncrl train: interrupted; every actor was stopped. Metrics so far: {run_dir / 'metrics.jsonl'}")
        raise SystemExit(130) from None
    except Exception as e:  # an actor died or an invariant broke: one clear line, then the details
        logger.exception("training failed")
        print(f"asyncrl train: failed: {type(e).__name__}: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    plot = plot_run(run_dir)
    print(f"base accuracy {summary['base_accuracy']:.1%} -> final accuracy {summary['final_accuracy']:.1%}  "
          f"({summary['steps']} steps, {summary['samples']} samples, {summary['wall_s']:.0f}s)")
    print(f"plots: {plot}")
    print(f"summary: {run_dir / 'summary.json'}   final policy: {summary['final_policy']}")


def main() -> None:
    validate_shown_config("config", trains=True)
    _hydra_main()


if __name__ == "__main__":
    main()
