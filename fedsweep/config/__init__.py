"""The experiment and sweep configuration: one typed, validated object that every layer receives.

``schema`` holds the sections, ``loading`` reads YAML and validates (every error at once),
``sweep`` the study file of ``fedsweep tune``. Both the orchestrator and the actors import
from here; nothing here imports from them.
"""

from fedsweep.config.loading import apply_override, load_config, read_yaml, validate
from fedsweep.config.schema import ExperimentConfig
from fedsweep.errors import ConfigError

__all__ = ["ConfigError", "ExperimentConfig", "apply_override", "load_config", "read_yaml", "validate"]
