"""Run configuration, at the ground of the package: every other layer reads it, it reads none.

``schema`` holds the typed sections, ``rules`` the cross-field checks, ``loader`` the YAML and
override parsing, ``block_plan`` the depth-attention state's shape derived from the model section.
"""

from attnres_dist.config.loader import config_from_dict, load_config
from attnres_dist.config.schema import (
    AttnResConfig,
    CheckpointConfig,
    Config,
    DataConfig,
    MetricsConfig,
    ModelConfig,
    MoEConfig,
    OptimConfig,
    OutputConfig,
    ParallelConfig,
    RuntimeConfig,
    TrainConfig,
)

__all__ = [
    "AttnResConfig",
    "CheckpointConfig",
    "Config",
    "DataConfig",
    "MetricsConfig",
    "ModelConfig",
    "MoEConfig",
    "OptimConfig",
    "OutputConfig",
    "ParallelConfig",
    "RuntimeConfig",
    "TrainConfig",
    "config_from_dict",
    "load_config",
]
