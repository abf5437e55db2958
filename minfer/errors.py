"""The one exception type the CLI turns into a one-line message and exit code 2."""


class MinferError(Exception):
    """A user-facing error: bad input, missing file, unsupported model, out of memory.

    The message is one line and says what to do where there is something to do.
    """
