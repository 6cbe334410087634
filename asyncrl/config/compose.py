"""Composing the Hydra config outside a Hydra app (tests, scripts, the model builder).

`asyncrl train` and `asyncrl eval` are Hydra apps over the same `conf/` directory;
`compose()` gives the same result for the same overrides without taking over the CLI.
"""

from __future__ import annotations

from pathlib import Path

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from asyncrl.config.schema import Config

REPO_ROOT = Path(__file__).resolve().parents[2]
CONF_DIR = REPO_ROOT / "conf"

# `${asyncrl_root:}` in a YAML file is the repository root, so shipped paths (the
# tiny base model) work from any working directory and under `ray job submit`.
OmegaConf.register_new_resolver("asyncrl_root", lambda: str(REPO_ROOT), replace=True)

# The schema is the first entry of conf/config.yaml's defaults list: every key exists
# with its default and type, so Hydra rejects unknown keys and wrong types at once and
# `--cfg job` prints the complete config.
ConfigStore.instance().store(name="asyncrl_schema", node=Config)


def compose(overrides: list[str] | None = None, config_name: str = "config") -> DictConfig:
    """The composed config for these command-line style overrides (e.g. ["recipe=arith"])."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose(config_name=config_name, overrides=list(overrides or []))
