"""`asyncrl train`: validate the config, then run the asynchronous training driver.

    asyncrl train recipe=arith
    asyncrl train recipe=arith algorithm=sync trainer.lr=5e-5
    asyncrl train recipe=arith --cfg job        # print the resolved config and exit
    python -m asyncrl.train recipe=arith        # the same

The config is validated before any actor starts; a bad value exits with status 2 and
one message per problem naming the key, the value and what would be valid.
"""

from __future__ import annotations

import logging

import hydra
from omegaconf import DictConfig

from asyncrl.config import CONF_DIR, validate_or_exit

logger = logging.getLogger(__name__)


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def _hydra_main(dict_cfg: DictConfig) -> None:
    cfg = validate_or_exit(dict_cfg)
    logger.info("config is valid: recipe=%s model=%s", cfg.recipe.name, cfg.model.path)
    # The driver (engines, rollout workers, queue, trainer, parameter sync) is the
    # orchestration issue's work; until it lands, say so instead of pretending to train.
    raise SystemExit("asyncrl train: the training driver is not implemented yet; "
                     "the config above is valid (use `asyncrl eval` to evaluate a policy)")


def main() -> None:
    _hydra_main()


if __name__ == "__main__":
    main()
