"""ASGI middleware in front of the API: API-key check, header and request-size limits, no
compressed bodies.

The body is read here in full (up to the limit) and replayed to the app, so a
body over the limit is refused with 413 whether or not the client sent a
Content-Length; after the replay, ``receive`` passes through to the server so
the app still sees the client's disconnect.
"""

from __future__ import annotations

import hmac
import json

from specserve.server.protocol import error_body

# paths served without an API key (as vLLM: probes and scrapers need no key)
OPEN_PATHS = frozenset({"/health", "/v1/health", "/metrics", "/version"})
# the request's header block, names and values: h11 refuses more only while the block is still
# incomplete (its buffer limit), so a block that arrived whole in one read got through at any size
MAX_HEADER_BYTES = 16 * 1024


async def send_error(send, status: int, message: str, code: str | None, headers: list | None = None) -> None:
    body = json.dumps(error_body(message, param=None, code=code)).encode()
    raw_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers + (headers or [])})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class GuardMiddleware:
    def __init__(self, app, api_keys: tuple[str, ...], max_request_bytes: int):
        self.app = app
        self.api_keys = tuple(k.encode() for k in api_keys)
        self.max_bytes = max_request_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        raw = scope.get("headers") or []
        if sum(len(k) + len(v) + 4 for k, v in raw) > MAX_HEADER_BYTES:
            return await send_error(send, 431, f"request headers over {MAX_HEADER_BYTES} bytes",
                                    "request_header_fields_too_large")
        headers = dict(raw)
        if self.api_keys and scope.get("path") not in OPEN_PATHS and not self._authorized(headers):
            return await send_error(send, 401, "missing or invalid API key: send 'Authorization: Bearer <key>' "
                                    "or 'X-Api-Key: <key>'", "invalid_api_key", [(b"www-authenticate", b"Bearer")])
        encoding = headers.get(b"content-encoding", b"identity").strip().lower()
        if encoding not in (b"", b"identity"):
            return await send_error(send, 415, f"unsupported Content-Encoding {encoding.decode('latin-1')!r}: "
                                               "send the JSON body uncompressed", "unsupported_media_type")
        declared = headers.get(b"content-length")
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                return await send_error(send, 400, "invalid Content-Length header", "invalid_request")
            if size > self.max_bytes:
                return await self._too_large(send, size)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return await self._too_large(send, size)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(b"".join(chunks), receive), send)

    def _authorized(self, headers: dict) -> bool:
        """'Authorization: Bearer KEY' (or the bare key, as llama-server takes it), else 'X-Api-Key:
        KEY' (Anthropic's header, which llama-server reads too); every key compared in constant time."""
        value = headers.get(b"authorization", b"").strip() or headers.get(b"x-api-key", b"").strip()
        scheme, _, token = value.partition(b" ")
        token = token.strip() if scheme.lower() == b"bearer" else value
        return sum(hmac.compare_digest(token, key) for key in self.api_keys) > 0

    async def _too_large(self, send, size: int) -> None:
        await send_error(send, 413, f"request body exceeds the limit of {self.max_bytes} bytes "
                                    f"(read {size}; see --max-request-bytes)", "request_too_large")


def _replay(body: bytes, receive):
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
