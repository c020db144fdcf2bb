"""Timed requests to an OpenAI-compatible server, plus the side endpoints bench reads.

Every generation request is sent at temperature 0. Timing is the client's wall clock
around the whole request (``clock`` is injectable so tests can use a virtual clock).
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import httpx

from specserve.bench.suites import Prompt
from specserve.errors import SpecserveError

Clock = Callable[[], float]


@dataclass
class RequestResult:
    """One measured request: what the server said, how long it took, or why it failed."""

    config: str
    suite: str
    prompt_id: str
    run: int = 0
    round: int = 0
    ok: bool = False
    error: str | None = None
    http_status: int | None = None
    wall_s: float | None = None
    ttft_s: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    tok_s: float | None = None
    finish_reason: str | None = None
    sha256: str | None = None
    text: str | None = None
    speculative: dict[str, Any] | None = None
    timings: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for the JSON results file."""
        return asdict(self)


def sha256_text(text: str) -> str:
    """Hex SHA-256 of UTF-8 text."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def normalize_url(url: str) -> str:
    """Server root without a trailing slash or ``/v1``."""
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        url = "http://" + url
    return url[:-3] if url.endswith("/v1") else url


def build_request(endpoint: str, model: str, prompt: Prompt, max_tokens: int,
                  stream: bool = False) -> tuple[str, dict[str, Any]]:
    """(path, JSON body) of a greedy generation request."""
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": 0,
                            "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if endpoint == "chat":
        body["messages"] = prompt.as_messages()
        return "/v1/chat/completions", body
    body["prompt"] = prompt.as_text()
    return "/v1/completions", body


def _choice_text(choice: dict[str, Any], endpoint: str, key: str) -> str:
    if endpoint != "chat":
        return choice.get("text") or ""
    msg = choice.get(key) or {}
    reasoning = msg.get("reasoning_content") or msg.get("reasoning") or ""
    return reasoning + (msg.get("content") or "")


def apply_usage(res: RequestResult, data: dict[str, Any]) -> None:
    """Copy usage, speculative stats and llama.cpp timings from a response body."""
    usage = data.get("usage") or {}
    res.prompt_tokens = usage.get("prompt_tokens", res.prompt_tokens)
    res.completion_tokens = usage.get("completion_tokens", res.completion_tokens)
    details = usage.get("prompt_tokens_details") or {}
    if details.get("cached_tokens") is not None:
        res.cached_tokens = details["cached_tokens"]
    if isinstance(usage.get("speculative"), dict):
        res.speculative = usage["speculative"]
    timings = data.get("timings")
    if isinstance(timings, dict) and ("draft_n" in timings or "draft_n_accepted" in timings):
        res.timings = {k: timings.get(k) for k in ("draft_n", "draft_n_accepted")}


def finish(res: RequestResult, text: str, wall: float, need_usage: bool = True) -> RequestResult:
    """Fill the derived fields (hash, rate) once the answer and wall time are known.

    A non-streaming answer without ``usage.completion_tokens`` is an error: its rate
    cannot be measured, and bench never guesses a token count.
    """
    res.text, res.sha256, res.wall_s = text, sha256_text(text), wall
    if res.completion_tokens is None:
        if not need_usage:
            res.ok = True
            return res
        res.ok, res.error = False, "response has no usage.completion_tokens"
        return res
    res.ok = True
    res.tok_s = res.completion_tokens / wall if wall > 0 else None
    return res


def parse_response(res: RequestResult, data: dict[str, Any], endpoint: str, wall: float) -> RequestResult:
    """Fill a result from a non-streaming response body."""
    choice = (data.get("choices") or [{}])[0]
    res.finish_reason = choice.get("finish_reason")
    apply_usage(res, data)
    return finish(res, _choice_text(choice, endpoint, "message"), wall)


def transport_error(exc: httpx.HTTPError, timeout: float) -> str:
    """A request that got no response: its timeout, or the transport's exception."""
    if isinstance(exc, httpx.TimeoutException):
        return f"timeout after {timeout:g} s"
    return f"{exc.__class__.__name__}: {exc}"


def read_response(res: RequestResult, resp: httpx.Response, endpoint: str, wall: float) -> RequestResult:
    """A non-streaming response into ``res``: its status, and its error or its parsed body."""
    res.http_status = resp.status_code
    if resp.status_code != 200:
        res.error, res.wall_s = http_error(resp), wall
        return res
    try:
        return parse_response(res, resp.json(), endpoint, wall)
    except ValueError:
        res.error, res.wall_s = "response is not JSON", wall
        return res


def http_error(resp: httpx.Response) -> str:
    """Short text for a non-200 response."""
    body = resp.text.strip().replace("\n", " ")
    return f"HTTP {resp.status_code}: {body[:200]}"


class BenchClient:
    """Synchronous client for one server under test."""

    def __init__(self, url: str, *, api_key: str | None = None, timeout: float = 600.0,
                 endpoint: str = "chat", model: str | None = None, clock: Clock = time.perf_counter):
        self.root = normalize_url(url)
        self.endpoint = endpoint
        self.model = model
        self.clock = clock
        self.timeout = timeout
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=self.root, headers=self.headers, timeout=timeout)
        self._tokenize_ok: bool | None = None

    def close(self) -> None:
        """Close the connection pool."""
        self.http.close()

    def __enter__(self) -> "BenchClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def get_json(self, path: str) -> tuple[int | None, Any]:
        """(status, parsed JSON or None); status None when the server did not answer."""
        try:
            resp = self.http.get(path, timeout=min(self.timeout, 30.0))
        except httpx.HTTPError:
            return None, None
        try:
            return resp.status_code, resp.json()
        except ValueError:
            return resp.status_code, None

    def list_models(self) -> list[dict[str, Any]]:
        """Entries of GET /v1/models (raises SpecserveError if unreachable)."""
        try:
            resp = self.http.get("/v1/models", timeout=min(self.timeout, 30.0))
        except httpx.HTTPError as exc:
            raise SpecserveError(f"GET {self.root}/v1/models failed: {type(exc).__name__}: "
                                 f"{exc or 'no answer'}") from exc
        try:
            data = resp.json()
        except ValueError:
            data = None
        if resp.status_code != 200 or not isinstance(data, dict):
            raise SpecserveError(f"GET {self.root}/v1/models failed (status {resp.status_code})")
        return [m for m in data.get("data") or [] if isinstance(m, dict)]

    def resolve_model(self) -> str:
        """The --model name, else the first id from /v1/models."""
        if not self.model:
            models = self.list_models()
            if not models:
                raise SpecserveError(f"{self.root}/v1/models lists no model; pass --model")
            self.model = str(models[0]["id"])
        return self.model

    def context_length(self) -> int | None:
        """Context length advertised by /v1/models (vLLM, llama.cpp spellings), if any."""
        try:
            models = self.list_models()
        except SpecserveError:
            return None
        for m in models:
            if m.get("id") != self.model and self.model:
                continue
            meta = m.get("meta") or {}
            for value in (m.get("max_model_len"), m.get("context_length"), meta.get("n_ctx_train")):
                if isinstance(value, int) and value > 0:
                    return value
        return None

    def version(self) -> Any:
        """Body of GET /version, or None."""
        status, data = self.get_json("/version")
        return data if status == 200 else None

    def metrics_text(self) -> tuple[str | None, str]:
        """(text of /metrics or None, reason when None)."""
        try:
            resp = self.http.get("/metrics", timeout=min(self.timeout, 30.0))
        except httpx.HTTPError as exc:
            return None, f"request failed: {exc.__class__.__name__}"
        if resp.status_code != 200:
            return None, f"HTTP {resp.status_code}"
        return resp.text, ""

    def tokenize(self, text: str) -> list[int] | None:
        """Token ids from the server's /tokenize (vLLM or llama.cpp shape), or None."""
        if self._tokenize_ok is False:
            return None
        body = {"model": self.model, "prompt": text, "content": text,
                "add_special_tokens": False, "add_special": False}
        try:
            resp = self.http.post("/tokenize", json=body)
            tokens = resp.json().get("tokens") if resp.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError):
            tokens = None
        if not isinstance(tokens, list):
            self._tokenize_ok = False
            return None
        self._tokenize_ok = True
        return [t["id"] if isinstance(t, dict) else int(t) for t in tokens]

    def complete(self, prompt: Prompt, max_tokens: int, res: RequestResult) -> RequestResult:
        """Send one non-streaming request and fill ``res``; errors are recorded, not raised."""
        path, body = build_request(self.endpoint, self.resolve_model(), prompt, max_tokens)
        t0 = self.clock()
        try:
            resp = self.http.post(path, json=body)
        except httpx.HTTPError as exc:
            res.error, res.wall_s = transport_error(exc, self.timeout), self.clock() - t0
            return res
        return read_response(res, resp, self.endpoint, self.clock() - t0)

    def stream(self, prompt: Prompt, max_tokens: int, res: RequestResult) -> RequestResult:
        """Streaming request: TTFT = time to the first content chunk; errors recorded."""
        path, body = build_request(self.endpoint, self.resolve_model(), prompt, max_tokens, True)
        t0 = self.clock()
        parts: list[str] = []
        try:
            with self.http.stream("POST", path, json=body) as resp:
                res.http_status = resp.status_code
                if resp.status_code != 200:
                    resp.read()
                    res.error, res.wall_s = http_error(resp), self.clock() - t0
                    return res
                for line in resp.iter_lines():
                    self._stream_line(line, parts, res, t0)
        except httpx.HTTPError as exc:
            res.error, res.wall_s = transport_error(exc, self.timeout), self.clock() - t0
            return res
        return finish(res, "".join(parts), self.clock() - t0, need_usage=False)

    def _stream_line(self, line: str, parts: list[str], res: RequestResult, t0: float) -> None:
        if not line.startswith("data:"):
            return
        payload = line[5:].strip()
        if not payload or payload == "[DONE]":
            return
        try:
            data = json.loads(payload)
        except ValueError:
            return
        for choice in data.get("choices") or []:
            piece = _choice_text(choice, self.endpoint, "delta")
            if piece and res.ttft_s is None:
                res.ttft_s = self.clock() - t0
            parts.append(piece)
            res.finish_reason = choice.get("finish_reason") or res.finish_reason
        if data.get("usage") or data.get("timings"):
            apply_usage(res, data)
