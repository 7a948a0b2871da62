"""Errors that mean bad input: the CLI prints them as one `error:` line and exits 2 (CONTRACT.md)."""


class UserError(Exception):
    """Invalid input from the user: configuration, data files, checkpoints."""


class ConfigError(UserError):
    pass


class DataError(UserError):
    pass


class CheckpointError(UserError):
    pass
