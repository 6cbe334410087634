"""The config: typed schema, Hydra composition and up-front validation of its values.

Checks against registries that live above the config (agent loops, agent types) are
added by asyncrl.run_config, which every command uses to load its config.
"""

from asyncrl.config.compose import CONF_DIR, REPO_ROOT, compose
from asyncrl.config.schema import Config
from asyncrl.config.validate import ConfigError, validate

__all__ = ["CONF_DIR", "REPO_ROOT", "Config", "ConfigError", "compose", "validate"]
