"""The one error a user can fix."""


class UsageError(Exception):
    """A mistake the user can fix: printed as one line, exit status 2."""
