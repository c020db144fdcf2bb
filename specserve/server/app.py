"""The FastAPI application: OpenAI-compatible routes over an AsyncEngine.

``create_app(engine, cfg)`` has no process-global state (its metrics live on
their own registry), so several apps can live in one process.
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from typing import Awaitable, Callable

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Match, Route

from specserve import __version__
from specserve.errors import RequestError, ServiceUnavailable
from specserve.server.chat import ChatRenderer
from specserve.server.config import ServerConfig
from specserve.server.fingerprint import describe, system_fingerprint
from specserve.server.drain import Drain, DrainMiddleware, unavailable_response
from specserve.server.media import MediaLoader
from specserve.server.metrics import CONTENT_TYPE, ServerMetrics
from specserve.server.middleware import GuardMiddleware
from specserve.server.openapi import install_openapi
from specserve.server.protocol import (ApiError, ApplyTemplateRequest, DetokenizeRequest, TokenizeRequest,
                                       error_response, parse_body, request_error_response, validation_error)
from specserve.server.serving import ServingContext, now
from specserve.server.serving_chat import create_chat_completion
from specserve.server.serving_completion import create_completion
from specserve.server.serving_infill import LLAMA_DEFAULTS, create_infill, create_native_completion
from specserve.server.serving_responses import ResponsesAPI, ResponseStore
from specserve.server.streaming import ClientGone
from specserve.server.tools import plan_tools, resolve_parser

logger = logging.getLogger("specserve.server")

Handler = Callable[[ServingContext, Request], Awaitable[Response | dict]]


def create_app(engine, cfg: ServerConfig, drain: Drain | None = None) -> FastAPI:
    """The app over ``engine``; with ``drain``, it refuses new requests once the drain has begun
    (``specserve serve`` starts it on SIGTERM / SIGINT)."""
    served = cfg.served_model_name or engine.model_name
    tok = engine.tokenizer
    renderer = ChatRenderer(tok.chat_template, cfg.chat_template, tok.bos_token, tok.eos_token,
                            cfg.default_chat_template_kwargs, served)
    metrics = ServerMetrics(served, engine.stats, spec_enabled=bool(getattr(engine, "spec_enabled", False)))
    source = renderer.template.source if renderer.template is not None else None
    target = getattr(getattr(engine, "engine", None), "target", None)
    vision = getattr(target, "vision", None)
    ctx = ServingContext(engine=engine, cfg=cfg, metrics=metrics, renderer=renderer, served_model_name=served,
                         tool_parser=resolve_parser(cfg.tool_call_parser, source),
                         system_fingerprint=system_fingerprint(describe(engine, source)),
                         media=MediaLoader(cfg.media, target.image_processor, vision.config.spatial_merge_size)
                         if vision is not None else None, vision_cfg=vision.config if vision is not None else None)
    logger.info("tool-call parser: %s; system_fingerprint %s", ctx.tool_parser, ctx.system_fingerprint)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        await engine.start()
        try:
            yield
        finally:
            await engine.shutdown()

    docs = cfg.enable_docs
    app = FastAPI(title="specserve", version=__version__, lifespan=lifespan, redoc_url=None,
                  docs_url="/docs" if docs else None, openapi_url="/openapi.json" if docs else None)
    app.state.ctx = ctx
    app.add_middleware(GuardMiddleware, api_keys=cfg.api_keys, max_request_bytes=cfg.max_request_bytes)
    # added last, so outermost: a preflight (which carries no API key) is answered before the key check,
    # and the guard's own 401/413 answers get the CORS headers a browser needs to read them
    app.add_middleware(CORSMiddleware, allow_origins=list(cfg.allowed_origins),
                       allow_methods=list(cfg.allowed_methods), allow_headers=list(cfg.allowed_headers),
                       allow_credentials=cfg.allow_credentials)
    if drain is not None:  # added last, so outermost: a draining server refuses before reading a body
        app.add_middleware(DrainMiddleware, drain=drain)
    _install_error_handlers(app)
    _add_routes(app, ctx, ResponsesAPI(ResponseStore(cfg.max_stored_responses)))
    install_openapi(app, api_key=bool(cfg.api_keys))
    return app


def _guard(ctx: ServingContext, handler: Handler):
    """One request's failures become OpenAI error bodies; the server keeps serving."""

    async def endpoint(request: Request) -> Response:
        try:
            result = await handler(ctx, request)
        except RequestError as exc:
            return request_error_response(exc)
        except ApiError as exc:
            return exc.response()
        except ServiceUnavailable as exc:  # ended by the shutdown drain before a response started
            return unavailable_response(exc)
        except ClientGone:
            return Response(status_code=499)  # nobody is listening any more
        except Exception as exc:  # noqa: BLE001
            logger.exception("%s %s failed", request.method, request.url.path)
            return error_response(500, f"internal server error ({type(exc).__name__})", "server_error",
                                  code="internal_error")
        return result if isinstance(result, Response) else JSONResponse(result)

    return endpoint


def _add_routes(app: FastAPI, ctx: ServingContext, responses: ResponsesAPI) -> None:
    routes: list[tuple[str, str, Handler]] = [
        ("POST", "/v1/chat/completions", create_chat_completion),
        ("POST", "/v1/completions", create_completion),
        ("POST", "/infill", create_infill),
        ("POST", "/completion", create_native_completion),
        ("POST", "/v1/responses", responses.create),
        ("GET", "/v1/responses/{response_id}", responses.retrieve),
        ("GET", "/v1/responses/{response_id}/input_items", responses.input_items),
        ("DELETE", "/v1/responses/{response_id}", responses.delete),
        ("GET", "/v1/models", list_models),
        ("GET", "/models", list_models),  # llama-server's alias
        ("GET", "/v1/models/{model:path}", retrieve_model),
        ("GET", "/health", health),
        ("GET", "/v1/health", health),  # llama-server's alias
        ("GET", "/version", version),
        ("GET", "/props", props),
        ("GET", "/metrics", metrics_page),
        ("POST", "/tokenize", tokenize),
        ("POST", "/detokenize", detokenize),
        ("POST", "/apply-template", apply_template),
    ]
    # HEAD wherever GET (RFC 9110; health checks send it), as Starlette's own routes do
    for method, path, handler in routes:
        methods = [method, "HEAD"] if method == "GET" else [method]
        app.add_api_route(path, _guard(ctx, handler), methods=methods, include_in_schema=False)


def _install_error_handlers(app: FastAPI) -> None:
    async def on_validation(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return request_error_response(validation_error(list(exc.errors())))

    async def on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        response = error_response(exc.status_code, str(exc.detail), kind)
        response.headers.update(exc.headers or {})
        if exc.status_code == 405:  # Allow: every method of the path (Starlette names the first route's only)
            response.headers["allow"] = ", ".join(allowed_methods(request))
        return response

    async def on_crash(_request: Request, exc: Exception) -> JSONResponse:  # a bug outside the routes' guard
        return error_response(500, f"internal server error ({type(exc).__name__})", "server_error",
                              code="internal_error")

    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(Exception, on_crash)


def allowed_methods(request: Request) -> list[str]:
    """The methods some route serves at the request's path."""
    return sorted({m for route in request.app.routes if isinstance(route, Route)
                   and route.matches(request.scope)[0] == Match.PARTIAL for m in route.methods or ()})


# ---------------------------------------------------------------- small routes

def model_card(ctx: ServingContext) -> dict:
    return {"id": ctx.served_model_name, "object": "model", "created": now(), "owned_by": "specserve",
            "root": ctx.engine.model_name, "parent": None, "max_model_len": ctx.engine.max_model_len}


async def list_models(ctx: ServingContext, _request: Request) -> dict:
    return {"object": "list", "data": [model_card(ctx)]}


async def retrieve_model(ctx: ServingContext, request: Request) -> dict:
    """GET /v1/models/{id}: the card under its served name or the engine's (404 for any other)."""
    ctx.check_model(request.path_params["model"])
    return model_card(ctx)


async def health(ctx: ServingContext, _request: Request) -> dict | Response:
    fatal = getattr(ctx.engine, "fatal", None)
    if fatal is not None:  # e.g. a tensor-parallel rank died: the process is about to exit
        return error_response(503, f"unhealthy: {fatal}", "server_error", code="engine_dead")
    return {"status": "ok"}


async def version(ctx: ServingContext, _request: Request) -> dict:
    return {"version": __version__, "model": ctx.served_model_name,
            "speculative": bool(getattr(ctx.engine, "spec_enabled", False))}


async def props(ctx: ServingContext, _request: Request) -> dict:
    """GET /props: llama-server's server properties, those a client reads (the context size, the
    chat template, the default sampling of /completion and /infill, what the model takes in)."""
    tmpl = ctx.renderer.template
    tok = ctx.engine.tokenizer
    params = {**LLAMA_DEFAULTS, "n_predict": -1, "seed": -1, "stream": False}
    return {"default_generation_settings": {"n_ctx": ctx.engine.max_model_len, "params": params},
            "total_slots": ctx.engine.max_num_seqs, "model_alias": ctx.served_model_name,
            "model_path": ctx.engine.model_name,
            "modalities": {"vision": ctx.media is not None, "video": False, "audio": False},
            "chat_template": tmpl.source if tmpl is not None else "",
            "bos_token": tok.bos_token or "", "eos_token": tok.eos_token or "",
            "endpoint_slots": False, "endpoint_props": False, "endpoint_metrics": True,
            "build_info": f"specserve {__version__}", "is_sleeping": False}


async def metrics_page(ctx: ServingContext, _request: Request) -> Response:
    return Response(ctx.metrics.render(), media_type=CONTENT_TYPE)


async def tokenize(ctx: ServingContext, request: Request) -> dict:
    req = parse_body(await request.body(), TokenizeRequest)
    ctx.check_model(req.model)
    if sum(x is not None for x in (req.prompt, req.messages, req.content)) != 1:
        raise RequestError("send exactly one of 'prompt' or 'messages' (or llama-server's 'content')", param="prompt")
    images = []
    if req.messages is not None:
        tools = plan_tools(req.tools, None, None, ctx.tool_parser).template_tools
        _, ids, images = await ctx.chat_prompt(req.messages, req.chat_template_kwargs, req.add_generation_prompt,
                                               tools, req.continue_final_message)
    elif req.content is not None:  # llama-server's form: BOS only with add_special
        ids = ctx.encode_prompt(req.content, add_bos=req.add_special, parse_special=req.parse_special)
    else:
        ids = ctx.encode_prompt(req.prompt, add_bos=req.add_special_tokens, parse_special=req.parse_special)
    pieces = [{"id": t, "piece": _piece(ctx.token_bytes(t))} for t in ids] if req.with_pieces else ids
    out = {"tokens": pieces, "count": len(ids), "max_model_len": ctx.engine.max_model_len}
    if images:  # the placeholder tokens each image takes (they are in count)
        out["image_tokens"] = [img.num_tokens for img in images]
    return out


def _piece(raw: bytes) -> str | list[int]:
    """A token's piece as llama-server gives it: its text, or its bytes where they are not whole
    UTF-8 characters (a piece of an emoji), so the pieces join back into the text."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


async def apply_template(ctx: ServingContext, request: Request) -> dict:
    """POST /apply-template: llama-server's; the chat prompt the messages render to, as text."""
    req = parse_body(await request.body(), ApplyTemplateRequest)
    ctx.check_model(req.model)
    if req.messages is None:
        raise RequestError("messages is required", param="messages")
    tools = plan_tools(req.tools, None, None, ctx.tool_parser).template_tools
    prompt = ctx.renderer.render(req.messages, req.chat_template_kwargs, req.add_generation_prompt, tools,
                                 req.continue_final_message)
    return {"prompt": prompt}


async def detokenize(ctx: ServingContext, request: Request) -> dict:
    req = parse_body(await request.body(), DetokenizeRequest)
    ctx.check_model(req.model)
    ctx.check_token_ids(req.tokens, "tokens")
    text = ctx.engine.tokenizer.decode(req.tokens, skip_special_tokens=False)
    return {"prompt": text, "content": text}  # vLLM's name, llama-server's
