"""Errors that reach the user as one line (CLI) or a 4xx body (server)."""


class SpecserveError(Exception):
    """A problem the user can fix: bad input, a missing file, a wrong flag.

    The CLI prints ``error: <message>`` and exits non-zero without a traceback.
    """


class ModelLoadError(SpecserveError):
    """The model file is missing, corrupt, truncated or of an unsupported kind."""


class RequestError(SpecserveError):
    """A request that cannot be served as asked (too long, bad parameter)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


class ServiceUnavailable(SpecserveError):
    """The server cannot serve or finish the request now (it is shutting down): HTTP 503 with
    Retry-After, or an error event on a stream that has started."""
