"""Errors that mean bad input: the CLI prints them as one `error:` line and exits 2 (README.md, docs/config.md)."""


class UserError(Exception):
    """Invalid input from the user: configuration, data files, checkpoints."""


class ConfigError(UserError):
    pass


class DataError(UserError):
    pass


class CheckpointError(UserError):
    pass


def first_line(e: BaseException) -> str:
    """An exception in one short line, for messages that quote a library's error: its message's first line, or
    its type when it has none."""
    return str(e).splitlines()[0][:200] if str(e) else type(e).__name__
