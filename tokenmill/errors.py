"""The exceptions tokenmill raises. Each message says what is wrong and what to change."""


class TokenmillError(Exception):
    """Base of every error tokenmill raises on purpose."""


class ConfigError(TokenmillError, ValueError):
    """A configuration the engine cannot honour; raised at start-up, before anything is built."""


class ModelLoadError(TokenmillError):
    """A checkpoint that is missing, unreadable, corrupt or of an unsupported architecture."""


class InvalidRequestError(TokenmillError, ValueError):
    """A request the engine refuses (empty prompt, too long, bad sampling parameters)."""
