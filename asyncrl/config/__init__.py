"""The config: typed schema, Hydra composition and up-front validation."""

from asyncrl.config.compose import CONF_DIR, REPO_ROOT, compose, load_config, load_config_file
from asyncrl.config.schema import Config
from asyncrl.config.validate import ConfigError, validate, validate_or_exit

__all__ = ["CONF_DIR", "REPO_ROOT", "Config", "ConfigError", "compose", "load_config", "load_config_file", "validate",
           "validate_or_exit"]
