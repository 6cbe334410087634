"""The config a command runs with: composed by Hydra, checked against the schema
(asyncrl.config) and against the registries above it (agent loops, agent types and
their params), every problem reported at once.

    cfg = load_config(["recipe=arith", "algorithm.max_staleness=2"])   # tests, scripts
    cfg = validate_or_exit(dict_cfg)                                    # a Hydra app's main
    validate_shown_config("config")                                     # before it, for `--cfg job`
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from asyncrl.agents.registry import check_registered
from asyncrl.config import Config, ConfigError, compose, validate
from asyncrl.config.models import trainable_model_problems


def validate_config(raw: DictConfig | dict[str, Any], trains: bool = False) -> Config:
    """The typed config, or a `ConfigError` naming every bad value. `trains`: for a command that
    trains, the model must be one the trainer loads (asyncrl eval serves any vLLM runs)."""
    return validate(raw, checks=[check_registered, *([trainable_model_problems] if trains else [])])


def load_config(overrides: list[str] | None = None) -> Config:
    """Compose (as `asyncrl train` would, for these overrides) and validate."""
    return validate_config(compose(overrides))


def load_config_file(path: str, overrides: list[str] | None = None) -> Config:
    """A recipe-style YAML file (any sections) over the defaults, then `key=value` overrides;
    validated. For commands that take `--config FILE` (asyncrl serve-env)."""
    if not Path(path).is_file():
        raise OSError(f"config file {path!r} not found")
    return validate_config(OmegaConf.merge(compose([]), OmegaConf.load(path),
                                           OmegaConf.from_dotlist(list(overrides or []))))


def validate_or_exit(raw: DictConfig, trains: bool = False) -> Config:
    """For CLI entry points: the typed config, or the problems on stderr and exit status 2."""
    try:
        return validate_config(raw, trains)
    except ConfigError as e:
        print(f"asyncrl: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def validate_shown_config(config_name: str, argv: Sequence[str] | None = None, trains: bool = False) -> None:
    """For a Hydra app's `main()`, before Hydra takes over: with `--cfg job` (or `all`) Hydra prints
    the config and never calls the app, so validate it here, as a run would, and exit with status 2
    and the same problems; a config that `--cfg job` shows is one a run accepts. Without those flags,
    or when composition itself fails (an unknown key, a wrong type: Hydra reports those next, as for
    a run), nothing happens."""
    from hydra._internal.utils import get_args_parser  # the parser hydra.main uses: the same flags

    args = get_args_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.cfg not in ("job", "all") or args.config_path is not None:  # --config-path: Hydra resolves it
        return
    overrides = list(args.overrides)
    if args.config_dir is not None:
        overrides.append(f"hydra.searchpath=[file://{Path(args.config_dir).resolve()}]")
    try:
        raw = compose(overrides, config_name=args.config_name or config_name)
    except Exception:  # Hydra composes again and reports the error its own way
        return
    validate_or_exit(raw, trains)
