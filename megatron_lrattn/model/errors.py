"""The model configuration's error, importable without megatron-core (the command lines
name it before their heavy imports)."""


class ConfigError(ValueError):
    """A configuration value or combination is not allowed; the message says which and why."""
