"""POST /infill: llama-server's code-infill endpoint (what llama.vim and llama.vscode call), and
POST /completion, llama-server's own completion endpoint, answered in the same native format.

The request gives the text before the cursor (``input_prefix``, then ``prompt``: the current line
up to the cursor), the text after it (``input_suffix``) and other files as context
(``input_extra``: [{filename, text}]); the answer is in llama-server's native format (``content``,
``stop_type``, ``timings``, ...), streamed as ``data:`` events when ``stream``. Sampling fields are
llama-server's (``n_predict``, ``repeat_penalty``, its defaults: temperature 0.8, top_k 40,
top_p 0.95, min_p 0.05), and its ends ``n_indent`` and ``t_max_predict_ms`` (class Limits); its
fields we do not act on (``cache_prompt``: the prefix cache is always on, ``samplers``,
``t_max_prompt_ms``, ...) are ignored, as llama-server ignores fields it does not know. Its
``grammar`` (GBNF) and ``json_schema`` constrain the output (server/structured.py), its
``logit_bias`` may be a list ([[id or text, bias or false]]), and a stop string that ended the
text is its ``stopping_word``.

The prompt is the model's repository-level format where it has one (Qwen2.5-Coder):
``<repo>myproject\\n<file_sep>{filename}\\n{text}...<file_sep>filename\\n`` and then
``<prefix>{input_prefix}{prompt}<suffix>{input_suffix}<middle>``; without those tokens each extra
file follows a plain "--- snippet ---" line. What does not fit the context (less ``n_predict``)
is cut: first whole extra files (the first ones), then the suffix's end down to a quarter of the
room, then the prefix's start.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from typing import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from specserve.errors import RequestError
from specserve.models.fim import FimTokens, fim_prompt
from specserve.models.tokenizer import Tokenizer
from specserve.server.protocol import ExtraFile, InfillRequest, NativeCompletionRequest, NativeFields, parse_body
from specserve.server.serving import (ServingContext, check_unsupported, format_logprobs, make_choices, new_id,
                                      openai_sse, resolve_max_tokens, timings)
from specserve.server.serving_completion import resolve_prompts
from specserve.server.streaming import Choice, Fanout, SSEResponse, run_or_disconnect, sse, start_fanout
from specserve.server.structured import constrain

PROJECT = "myproject"  # the repository name llama-server writes (clients send none)
SNIPPET = "\n\n--- snippet ---\n\n"  # separates extra files for a model without file tokens
LLAMA_DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}
MAX_PROBS = 20  # n_probs, as chat's top_logprobs


@dataclass(frozen=True)
class InfillPrompt:
    ids: list[int]
    truncated: bool  # something the client sent did not fit


def build_prompt(tok: Tokenizer, req: InfillRequest, fim: FimTokens, room: int) -> InfillPrompt:
    """The infill prompt, cut to at most ``room`` tokens."""
    bos = tok.bos_token_id if tok.add_bos else None
    prefix = tok.encode(req.input_prefix + req.prompt, add_special_tokens=False)
    suffix = tok.encode(req.input_suffix, add_special_tokens=False)
    fixed = 3 + (bos is not None)
    suffix_room = max((room - fixed) // 4, room - fixed - len(prefix))
    keep_suffix = suffix[:max(0, suffix_room)]
    keep_prefix = prefix[max(0, len(prefix) - max(0, room - fixed - len(keep_suffix))):]
    core = fim_prompt(fim, keep_prefix, keep_suffix, bos)
    extra = extra_context(tok, req.input_extra, fim, room - len(core))
    cut = len(keep_prefix) < len(prefix) or len(keep_suffix) < len(suffix) or extra.truncated
    return InfillPrompt(extra.ids + core, cut)


def extra_context(tok: Tokenizer, files: list[ExtraFile], fim: FimTokens, room: int) -> InfillPrompt:
    """Other files before the infill: the last ones that fit in ``room`` tokens, whole."""
    encode = tok.encode
    repo = fim.repo is not None and fim.file_sep is not None
    head = [fim.repo, *encode(PROJECT + "\n")] if repo else []
    tail = [fim.file_sep, *encode("filename\n")] if repo else []
    chunks = [([fim.file_sep, *encode(f.filename + "\n")] if repo else encode(SNIPPET)) + encode(f.text)
              for f in files]
    kept: list[list[int]] = []
    used = len(head) + len(tail)
    for chunk in reversed(chunks):
        if used + len(chunk) > room:
            break
        kept.insert(0, chunk)
        used += len(chunk)
    if used > room:
        return InfillPrompt([], bool(files))
    return InfillPrompt(head + [t for c in kept for t in c] + tail, len(kept) < len(chunks))


async def create_infill(ctx: ServingContext, request: Request) -> Response:
    req = parse_body(await request.body(), InfillRequest)
    ctx.check_model(req.model)
    if ctx.fim is None:
        raise RequestError(f"{ctx.served_model_name} has no fill-in-the-middle tokens (FIM prefix, suffix "
                           "and middle): infill needs a model trained for it", param="input_prefix")
    n_predict = check_native(req)
    limit = ctx.engine.max_model_len
    if n_predict >= limit:
        raise RequestError(f"n_predict {n_predict} leaves no room for the prompt in the model's "
                           f"{limit}-token context", param="n_predict", code="context_length_exceeded")
    reserve = n_predict if n_predict > 0 else min(512, limit // 4)
    prompt = build_prompt(ctx.engine.tokenizer, req, ctx.fim, limit - reserve)
    max_tokens = n_predict if n_predict >= 0 else limit - len(prompt.ids)
    return await respond(ctx, request, req, [prompt], [max_tokens], ctx.fim.end_ids)


async def create_native_completion(ctx: ServingContext, request: Request) -> Response:
    """POST /completion: llama-server's own completion endpoint (a text or token-id prompt, BOS added to
    a text as the model wants), answered in the same native format as /infill. Several prompts (a
    list of texts or of token-id lists) run at once, as llama-server's: an array of answers, or one
    stream whose events carry each prompt's ``index``."""
    req = parse_body(await request.body(), NativeCompletionRequest)
    ctx.check_model(req.model)
    n_predict = check_native(req)
    ids_list, _ = resolve_prompts(ctx, req.prompt)
    max_tokens = [resolve_max_tokens(ctx, None if n_predict == -1 else n_predict, None, len(ids),
                                     "prompt" if len(ids_list) == 1 else f"prompt[{i}]", param="n_predict",
                                     minimum=0) for i, ids in enumerate(ids_list)]
    return await respond(ctx, request, req, [InfillPrompt(ids, False) for ids in ids_list], max_tokens, (),
                         several=len(ids_list) > 1)


def check_native(req: NativeFields) -> int:
    """The request's n_predict (max_tokens is an alias), after the checks both endpoints share."""
    if req.n != 1:
        raise RequestError("n must be 1 here (llama-server's endpoints answer one completion)", param="n")
    check_unsupported(req)
    if not 0 <= req.n_probs <= MAX_PROBS:
        raise RequestError(f"n_probs must be in [0, {MAX_PROBS}], got {req.n_probs}", param="n_probs")
    if req.post_sampling_probs and req.n_probs:
        raise RequestError("post_sampling_probs is not supported: n_probs gives the model's own logprobs "
                           "(llama-server's default)", param="post_sampling_probs")
    # llama-server reads n_predict first, max_tokens where it is absent
    n_predict = req.max_tokens if "n_predict" not in req.model_fields_set and req.max_tokens else req.n_predict
    if n_predict < -1:  # as llama-server, -1 is "no limit" and 0 the prompt alone, into the prefix cache
        raise RequestError(f"n_predict must be -1 (until the context is full), 0 (the prompt alone, "
                           f"cached) or >= 1, got {n_predict}", param="n_predict")
    return n_predict


async def respond(ctx: ServingContext, request: Request, req: NativeFields, prompts: list[InfillPrompt],
                  max_tokens: list[int], end_ids: tuple[int, ...], several: bool = False) -> Response:
    """Run one choice per prompt and answer in llama-server's native format, streamed or not: one
    answer, or (``several``) an array of them in prompt order."""
    structured = await ctx.structured.spec_for(req)  # response_format / vLLM's structured fields, as completions
    choices = make_choices([p.ids for p in prompts], llama_sampling(req, ctx.engine.tokenizer), max_tokens,
                           req.n_probs or None, new_id("cmpl"))
    for c in choices:
        c.params = replace(c.params, stop_token_ids=c.params.stop_token_ids + end_ids)
    choices = constrain(choices, structured)
    fan = Fanout(ctx.engine, ctx.metrics, choices)
    limits = {c.index: Limits(req.n_indent, req.t_max_predict_ms) for c in choices}
    await start_fanout(request.receive, fan, drain=False, stream=bool(req.stream))
    if req.stream:
        events = infill_events(ctx, fan, prompts, limits, req)
        return SSEResponse(openai_sse(events, "infill", fan.choices[0].request_id, done=False), fan.close)
    try:
        await run_or_disconnect(request.receive, collect(fan, limits))
    finally:
        await fan.close()
    bodies = []
    for c in choices:
        body = {"index": c.index, "content": c.text, "tokens": c.token_ids if req.return_tokens else [],
                **final_fields(ctx, c, prompts[c.prompt_index])}
        if req.n_probs:  # (streamed, each event carries its tokens' instead)
            body["completion_probabilities"] = format_logprobs(ctx, c.logprobs, req.n_probs, ids=True)
        bodies.append(pick_fields(body, req.response_fields))
    return JSONResponse(bodies if several else bodies[0])


@dataclass
class Limits:
    """llama-server's ends of an infill besides EOS and n_predict, checked after each delta: a line
    indented less than ``n_indent`` (the text ends before it), and ``t_max_predict_ms`` after the
    first token once a new line is written. Either ends the request with stop_type "limit"."""

    n_indent: int
    t_max_ms: float
    first_token: float | None = None

    def reached(self, c: Choice) -> bool:
        """True when ``c`` must end now (its text cut where the rule says)."""
        now = time.perf_counter()
        if self.first_token is None and c.token_ids:
            self.first_token = now
        cut = self._dedent_at(c.text) if self.n_indent > 0 else None
        if cut is not None:
            c.text = c.text[:cut]
        late = self.t_max_ms > 0 and self.first_token is not None and "\n" in c.text and \
            (now - self.first_token) * 1000 > self.t_max_ms
        if (cut is not None or late) and c.finish_reason is None:
            c.finish_reason = "length"
            return True
        return False

    def _dedent_at(self, text: str) -> int | None:
        """Where the first complete later line indented less than n_indent starts (None: nowhere)."""
        start = text.find("\n") + 1
        while start > 0:
            end = text.find("\n", start)
            if end < 0:
                return None  # the line is still being written
            line = text[start:end]
            if line.strip() and len(line) - len(line.lstrip(" \t")) < self.n_indent:
                return start
            start = end + 1
        return None


async def collect(fan: Fanout, limits: dict[int, Limits]) -> None:
    """Run every choice to its end; one that reaches its limit stops (``Fanout.stop``) on its own."""
    async for choice, _out in fan:
        if choice.finish_reason is None and limits[choice.index].reached(choice):
            fan.stop(choice)


def native_logit_bias(tok: Tokenizer, raw: list[list]) -> dict[str, float]:
    """llama-server's logit_bias, [[token id or text, bias or false], ...], as OpenAI's {"id": bias}:
    a text biases each of its tokens, false bans (-100, the strongest bias; a later entry wins)."""
    out: dict[str, float] = {}
    for item in raw:
        key, bias = item if len(item) == 2 else (None, None)
        if bias is False:
            bias = -100.0
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or isinstance(key, bool) \
                or not isinstance(key, (int, str)) or (isinstance(key, str) and not key):
            raise RequestError("logit_bias entries must be [token id or text, bias or false], got "
                               f"{json.dumps(item)[:80]}", param="logit_bias")
        ids = [key] if isinstance(key, int) else tok.encode(key, add_special_tokens=False)
        out.update({str(t): float(bias) for t in ids})
    return out


def llama_sampling(req: NativeFields, tok: Tokenizer) -> NativeFields:
    """The request with llama-server's sampling defaults and names (repeat_penalty; seed -1: random;
    logit_bias as a list; a negative temperature: greedy, as llama-server samples it)."""
    update = {k: v for k, v in LLAMA_DEFAULTS.items() if getattr(req, k) is None}
    if req.temperature is not None and req.temperature < 0:
        update["temperature"] = 0.0
    if isinstance(req.logit_bias, list):
        update["logit_bias"] = native_logit_bias(tok, req.logit_bias)
    if req.repeat_penalty is not None and req.repetition_penalty is None:
        update["repetition_penalty"] = req.repeat_penalty
    if req.seed == -1:
        update["seed"] = None
    return req.model_copy(update=update)


def final_fields(ctx: ServingContext, c: Choice, prompt: InfillPrompt) -> dict:
    """llama-server's fields of a finished completion, after ``content``."""
    word = c.stop_reason if isinstance(c.stop_reason, str) else None  # a stop string, not an end token
    stop_type = {"length": "limit", "stop": "eos" if word is None else "word"}.get(c.finish_reason, "none")
    return {
        "id_slot": 0, "stop": True, "model": ctx.served_model_name,
        "tokens_predicted": c.completion_tokens, "tokens_evaluated": len(prompt.ids),
        "generation_settings": {"n_ctx": ctx.engine.max_model_len, "n_predict": c.params.max_tokens,
                                "temperature": c.params.temperature, "top_k": c.params.top_k,
                                "top_p": c.params.top_p, "min_p": c.params.min_p, "seed": c.params.seed},
        "prompt": ctx.engine.tokenizer.decode(prompt.ids, skip_special_tokens=False),
        "has_new_line": "\n" in c.text, "truncated": prompt.truncated,
        "stop_type": stop_type, "stopping_word": word or "",
        "tokens_cached": c.cached_tokens, "timings": timings([c]),
    }


def pick_fields(body: dict, paths: list[str]) -> dict:
    """llama-server's response_fields: only the values at these paths ("timings/prompt_n" is
    body["timings"]["prompt_n"]), each under its path as a flat key; a missing path is left out.
    No paths: the whole body."""
    if not paths:
        return body
    out = {}
    for path in paths:
        value, found = body, True
        for key in path.split("/"):
            found = found and isinstance(value, dict) and key in value
            value = value[key] if found else None
        if found:
            out[path] = value
    return out


async def infill_events(ctx: ServingContext, fan: Fanout, prompts: list[InfillPrompt], limits: dict[int, Limits],
                        req: NativeFields) -> AsyncIterator[str]:
    """llama-server's stream: one event per delta with ``content``, its token ids, ``stop`` and the
    prompt's ``index``; each choice's last one (empty content, no tokens, ``stop`` true) carries its
    finished completion's fields. No [DONE] line, as llama-server.
    A line is held back until it is complete when n_indent may cut it."""
    sent = {c.index: 0 for c in fan.choices}
    tokens: dict[int, list[int]] = {c.index: [] for c in fan.choices}  # ids not yet sent (their text may wait)
    ended: set[int] = set()
    async for choice, out in fan:
        i, lim = choice.index, limits[choice.index]
        if i in ended:
            continue  # stopped at its limit: what the engine still had is dropped
        done = lim.reached(choice) or out.finished
        end = len(choice.text) if done or not lim.n_indent else choice.text.rfind("\n") + 1
        n_probs = choice.params.logprobs
        probs = format_logprobs(ctx, out.new_logprobs or [], n_probs, ids=True) if n_probs else None
        tokens[i] += out.new_token_ids
        if end > sent[i] or probs:
            event = {"content": choice.text[sent[i]:end], "tokens": tokens[i], "stop": False, "id_slot": 0,
                     "index": i}
            yield sse(event | ({"completion_probabilities": probs} if probs else {}))
            sent[i], tokens[i] = end, []
        if done:
            yield sse(pick_fields({"content": "", "tokens": [], "index": i,
                                   **final_fields(ctx, choice, prompts[choice.prompt_index])}, req.response_fields))
            ended.add(i)
            if not out.finished:
                fan.stop(choice)
