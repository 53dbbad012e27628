""":class:`UserError`, on its own so that raising or catching it imports nothing heavy (the CLI
imports it at start; :mod:`gpusched.userinput`, which reads files with yaml and pydantic,
re-exports it)."""


class UserError(Exception):
    """Shown to the user as is: what was wrong, which value, what is accepted."""
