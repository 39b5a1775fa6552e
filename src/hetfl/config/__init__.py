"""Typed, validated run configuration: YAML in, plain frozen records out.

Everything a run needs is checked here, before anything runs: types and ranges by the
records, names against the registries, and cross-field rules (more clients per round than
clients). Errors become one `ConfigError` whose message names each field, the value
received and what is allowed; an unknown key suggests the closest known one. Algorithms
receive only their own options (explicit constructor arguments), never this config.

- `sections`: each section's record (`DataConfig`, `ModelConfig`, `TrainConfig`, ...);
- `run`: `RunConfig`, the whole run, and the checks across sections;
- `loading`: YAML, dotted overrides, `validate`, error messages;
- `sweeps`: a `sweep:` grid expanded into named points.
"""

from hetfl.config.loading import (
    default_config_path,
    format_errors,
    load_raw,
    parse_overrides,
    set_dotted,
    validate,
)
from hetfl.config.run import RunConfig
from hetfl.config.sections import (
    AugmentConfig,
    ConfigError,
    DataConfig,
    DeployConfig,
    EvalConfig,
    GroupConfig,
    LrPlateauConfig,
    LrScheduleConfig,
    ModelConfig,
    PartitionConfig,
    ResizedCropConfig,
    StoreConfig,
    TargetConfig,
    TrainConfig,
    parse_size,
)
from hetfl.config.sweeps import expand_sweep, validate_points

__all__ = [
    "AugmentConfig",
    "ConfigError",
    "DataConfig",
    "DeployConfig",
    "EvalConfig",
    "GroupConfig",
    "LrPlateauConfig",
    "LrScheduleConfig",
    "ModelConfig",
    "PartitionConfig",
    "ResizedCropConfig",
    "RunConfig",
    "StoreConfig",
    "TargetConfig",
    "TrainConfig",
    "default_config_path",
    "expand_sweep",
    "format_errors",
    "load_raw",
    "parse_overrides",
    "parse_size",
    "set_dotted",
    "validate",
    "validate_points",
]
