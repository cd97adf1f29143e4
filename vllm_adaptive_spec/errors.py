"""The plugin's one user-facing error type, in a module with no dependencies
so that config parsing, policies and head files can all raise it."""

from __future__ import annotations


class ConfigError(ValueError):
    """A bad `adaptive_spec` value; the message names the field and the value."""
