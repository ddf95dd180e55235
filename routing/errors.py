"""The one exception type for user-facing configuration mistakes.

Entry points catch it and print its message as a single sentence instead of a traceback.
It lives here, in the lowest package, because routing, backbones and train all raise it.
"""


class ConfigError(ValueError):
    """A bad config value; the message names the key and the fix."""


class FileError(ConfigError):
    """A file that cannot be used: missing, empty, truncated, damaged, or of another model; the message is one
    sentence naming the file and the fix (backbones/files.py writes them)."""
