"""uvicorn's HTTP/1.1 protocol (h11) with OpenAI-style JSON bodies for the errors it answers itself.

A request h11 cannot parse (a non-numeric Content-Length, a broken request line or header,
headers over the size limit) never reaches the app: uvicorn answers it with a plain-text 400.
``JSONErrorH11Protocol`` answers it with ``{"error": {...}}`` instead, naming what h11 refused
(status 431 for headers over the limit, as h11 suggests; 400 otherwise). One parser for every
deployment (not httptools where it happens to be installed): the same bytes get the same answer.
"""

from __future__ import annotations

import json
import logging

import h11
from uvicorn.protocols.http.h11_impl import STATUS_PHRASES, H11Protocol

from specserve.server.protocol import error_body

logger = logging.getLogger("specserve.server")


MAX_REASON = 200  # h11's reason may quote the request line: echo a bounded part of it


def parse_error_body(reason: str) -> bytes:
    """The JSON body of a request the HTTP parser refused."""
    reason = reason if len(reason) <= MAX_REASON else reason[:MAX_REASON] + "..."
    message = f"invalid HTTP request: {reason}" if reason else "invalid HTTP request"
    return json.dumps(error_body(message, code="invalid_http_request")).encode()


class JSONErrorH11Protocol(H11Protocol):
    """H11Protocol whose parse-error answers are JSON (pass the class as uvicorn's ``http``)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._parse_error: h11.RemoteProtocolError | None = None
        next_event = self.conn.next_event

        def recording_next_event():  # keeps what h11 refused, for the error body
            try:
                return next_event()
            except h11.RemoteProtocolError as exc:
                self._parse_error = exc
                raise

        self.conn.next_event = recording_next_event

    def send_400_response(self, msg: str) -> None:
        exc = self._parse_error
        status = getattr(exc, "error_status_hint", 400) if exc is not None else 400
        status = status if 400 <= status < 500 else 400
        body = parse_error_body(str(exc) if exc is not None else "")
        if self.cycle is not None and self.cycle.response_started:
            # the app has started its response already (the body broke mid-request): nothing can be
            # sent any more but the end of the connection
            self.transport.close()
            return
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        try:
            for event in (h11.Response(status_code=status, headers=headers, reason=STATUS_PHRASES[status]),
                          h11.Data(data=body), h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
        except h11.LocalProtocolError:
            logger.debug("could not answer an unparsable request", exc_info=True)
        self.transport.close()


def uvicorn_config(app, host: str, port: int, log_level: str, graceful_s: float):
    """The uvicorn configuration ``specserve serve`` runs: JSON parse errors, and ``graceful_s``
    seconds for connections to close once the drain (specserve/server/drain.py) has ended every
    request (a last resort: a drained server has no request left to wait for)."""
    import uvicorn

    return uvicorn.Config(app, host=host, port=port, log_level=log_level, http=JSONErrorH11Protocol,
                          timeout_graceful_shutdown=graceful_s)
