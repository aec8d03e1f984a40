"""Errors about inputs the user gave us. The CLI prints the message as one line and exits 2."""


class InputError(Exception):
    """Bad input: a missing, malformed, truncated or unsupported file, or a bad target."""
