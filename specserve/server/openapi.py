"""/openapi.json: the API described for clients, fuzzers and /docs.

The routes read their bodies themselves (``protocol.parse_body``: strict types, OpenAI-style
errors naming the field), so FastAPI sees no body parameters and would describe none. The
document is built here from the app's routes instead, with each request body's schema taken
from the same pydantic model that validates it; validation itself is unchanged.
"""

from __future__ import annotations

import re
from typing import Any

from fastapi import FastAPI
from fastapi.routing import APIRoute
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from specserve.server.middleware import OPEN_PATHS
from specserve.server.protocol import (ApplyTemplateRequest, ChatCompletionRequest, CompletionRequest,
                                      DetokenizeRequest, InfillRequest, NativeCompletionRequest, TokenizeRequest)
from specserve.server.responses_protocol import ResponsesRequest

BODIES: dict[tuple[str, str], type[BaseModel]] = {
    ("POST", "/v1/chat/completions"): ChatCompletionRequest,
    ("POST", "/v1/completions"): CompletionRequest,
    ("POST", "/v1/responses"): ResponsesRequest,
    ("POST", "/infill"): InfillRequest,
    ("POST", "/completion"): NativeCompletionRequest,
    ("POST", "/tokenize"): TokenizeRequest,
    ("POST", "/detokenize"): DetokenizeRequest,
    ("POST", "/apply-template"): ApplyTemplateRequest,
}
SUMMARIES = {
    "/v1/chat/completions": "Chat completion (OpenAI); server-sent events with stream: true",
    "/v1/completions": "Text completion (OpenAI legacy); server-sent events with stream: true",
    "/v1/responses": "Create a response (OpenAI Responses API); typed server-sent events with stream: true",
    "/v1/responses/{response_id}": "A stored response",
    "/v1/responses/{response_id}/input_items": "A stored response's input items (OpenAI's list: after, limit, order)",
    "/v1/models": "The served model",
    "/v1/models/{model}": "One model by id",
    "/health": "Liveness", "/v1/health": "Liveness (llama-server's alias)",
    "/version": "Server version", "/metrics": "Prometheus metrics (vLLM's names)",
    "/props": "Server properties (llama-server's): context size, chat template, default sampling",
    "/tokenize": "Prompt or messages (or llama-server's content) to token ids", "/detokenize": "Token ids to text",
    "/apply-template": "Messages to the chat prompt they render to (llama-server's)",
    "/infill": "Code infill at a cursor (llama-server's); its server-sent events with stream: true",
    "/completion": "Text completion in llama-server's own format; its server-sent events with stream: true",
}
# a valid request per body: /docs fills "Try it out" with it, and fuzzers start from it
EXAMPLES = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 16},
    "/v1/completions": {"prompt": "Once upon a time", "max_tokens": 16},
    "/v1/responses": {"input": "Hi!", "instructions": "Answer briefly.", "max_output_tokens": 16},
    "/tokenize": {"prompt": "Hello world"},
    "/detokenize": {"tokens": [1, 2, 3]},
    "/apply-template": {"messages": [{"role": "user", "content": "Hi!"}]},
    "/infill": {"input_prefix": "def add(a, b):\n    return ", "input_suffix": "\n", "n_predict": 16},
    "/completion": {"prompt": "Once upon a time", "n_predict": 16},
}
STREAMING = {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/infill", "/completion"}
ERROR_SCHEMA = {
    "type": "object", "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
}
_PATH_PARAM = re.compile(r"\{(\w+)\}")


def install_openapi(app: FastAPI, api_key: bool) -> None:
    """Make ``app.openapi()`` (served at /openapi.json and read by /docs) return this module's document."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build_openapi(app, api_key)
        return app.openapi_schema

    app.openapi = openapi


def build_openapi(app: FastAPI, api_key: bool) -> dict[str, Any]:
    models = list(dict.fromkeys(BODIES.values()))
    refs, top = models_json_schema([(m, "validation") for m in models], ref_template="#/components/schemas/{model}")
    schemas: dict[str, Any] = {**top.get("$defs", {}), "Error": ERROR_SCHEMA}
    paths: dict[str, dict] = {}
    for route in app.routes:
        if isinstance(route, APIRoute):
            for method in sorted(route.methods - {"HEAD"}):  # HEAD: implied by GET
                body = BODIES.get((method, route.path))
                schema = refs[(body, "validation")] if body is not None else None
                op = _operation(route.path_format, method, schema)
                if api_key and route.path not in OPEN_PATHS:
                    op["security"] = [{"bearer": []}, {"apiKeyHeader": []}]  # either one
                paths.setdefault(route.path_format, {})[method.lower()] = op
    components: dict[str, Any] = {"schemas": schemas}
    if api_key:
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"},
                                         "apiKeyHeader": {"type": "apiKey", "in": "header", "name": "X-Api-Key"}}
    return {"openapi": "3.1.0", "info": {"title": app.title, "version": app.version}, "paths": paths,
            "components": components}


def _operation(path: str, method: str, body: dict | None) -> dict[str, Any]:
    slug = re.sub(r"[^a-z0-9]+", "_", path.lower()).strip("_")
    ok: dict[str, Any] = {"application/json": {"schema": {"type": "object"}}}
    if path == "/metrics":
        ok = {"text/plain": {"schema": {"type": "string"}}}
    elif path in STREAMING:
        ok["text/event-stream"] = {"schema": {"type": "string"}}
    op: dict[str, Any] = {
        "operationId": f"{method.lower()}_{slug}",
        "summary": SUMMARIES.get(path, path),
        "responses": {"200": {"description": "OK", "content": ok},
                      "default": {"description": "OpenAI-style error",
                                  "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}},
    }
    params = [{"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
              for name in _PATH_PARAM.findall(path)]
    if params:
        op["parameters"] = params
    if body is not None:
        media = {"schema": body}
        if path in EXAMPLES:
            media["example"] = EXAMPLES[path]
        op["requestBody"] = {"required": True, "content": {"application/json": media}}
    return op
