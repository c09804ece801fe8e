"""Typed job configuration: one dataclass per TOML section, parsed from TOML + CLI overrides."""

from torchtrain.config.fields import ConfigError
from torchtrain.config.job_config import BatchPlan, JobConfig, resolve_batch
from torchtrain.config.manager import format_help, parse_args, to_toml

__all__ = ["BatchPlan", "ConfigError", "JobConfig", "format_help", "parse_args", "resolve_batch", "to_toml"]
