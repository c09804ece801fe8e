"""Typed job configuration: one dataclass per TOML section, parsed from TOML + CLI overrides.

This package imports nothing from the rest of torchtrain (tests/test_architecture.py): a model's
arguments are checked by the model registry in preflight, and dataset names by the data package.
"""

from torchtrain.config.fields import ConfigError
from torchtrain.config.job_config import JobConfig
from torchtrain.config.manager import format_help, job_value, parse_args, to_dict, to_toml

__all__ = ["ConfigError", "JobConfig", "format_help", "job_value", "parse_args", "to_dict", "to_toml"]
