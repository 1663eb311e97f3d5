"""Typed configuration: schema, loading with overrides, and the resolved dump."""

from tuneforge.config.load import dump_config, load_config
from tuneforge.config.schema import Config

__all__ = ["Config", "dump_config", "load_config"]
