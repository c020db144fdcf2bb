"""What clients expect around the main endpoints: CORS, /openapi.json and /docs, Allow on 405,
GET /v1/models/{id}, system_fingerprint, llama.cpp's timings, and tools refused (400) when the chat
template cannot render them. FakeEngine over real HTTP."""

from __future__ import annotations

import sys

import openai
import pytest
from openapi_spec_validator import validate

from fake_engine import FakeEngine
from specserve.engine.types import SamplingParams, AcceptanceStats
from specserve.errors import SpecserveError
from specserve.server.chat import ChatRenderer
from specserve.server.config import ServerConfig
from specserve.server.fingerprint import describe, system_fingerprint
from specserve.server.serving import timings
from specserve.server.streaming import Choice
from live_server import MSGS, make_server

ORIGIN = "http://app.example.com"
PREFLIGHT = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}


@pytest.fixture(scope="module")
def keyed():
    s = make_server(api_keys=("sekret",))
    yield s
    s.close()


# ---------------------------------------------------------------- CORS

def test_preflight_from_another_origin_needs_no_key(keyed):
    for path in ("/v1/chat/completions", "/v1/responses", "/v1/models"):
        r = keyed.http.options(path, headers=PREFLIGHT)
        assert r.status_code == 200, (path, r.status_code, r.text)
        assert r.headers["access-control-allow-origin"] == "*"
        assert "POST" in r.headers["access-control-allow-methods"]
        assert "authorization" in r.headers["access-control-allow-headers"].lower()
    ok = keyed.http.get("/v1/models", headers={"Origin": ORIGIN, "Authorization": "Bearer sekret"})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "*"
    denied = keyed.http.get("/v1/models", headers={"Origin": ORIGIN})  # the page can read why
    for probe in ("/health", "/v1/health"):  # probes need no key
        assert keyed.http.get(probe).status_code == 200
    assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] == "*"


def test_cors_flags_restrict_origins_and_allow_credentials():
    s = make_server(allowed_origins=[ORIGIN], allowed_methods=["POST"], allow_credentials=True)
    try:
        r = s.http.options("/v1/chat/completions", headers=PREFLIGHT)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
        assert r.headers["access-control-allow-credentials"] == "true"
        assert r.headers["access-control-allow-methods"] == "POST"
        other = s.http.options("/v1/chat/completions", headers={**PREFLIGHT, "Origin": "http://evil.example"})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
        put = s.http.options("/v1/chat/completions", headers={**PREFLIGHT, "Access-Control-Request-Method": "PUT"})
        assert put.status_code == 400
        r = s.http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers={"Origin": ORIGIN})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    finally:
        s.close()


@pytest.mark.parametrize("flag,value", [("allowed_origins", "not json"), ("allowed_headers", '{"a": 1}'),
                                        ("allowed_methods", "[1, 2]")])
def test_bad_cors_flag_fails_naming_it(flag, value):
    with pytest.raises(SpecserveError, match="--" + flag.replace("_", "-")):
        ServerConfig(**{flag: value})


def test_cors_flags_on_the_command_line():
    from specserve.commands.args import build_serve_parser

    args = build_serve_parser().parse_args(["--allowed-origins", f'["{ORIGIN}"]', "--allow-credentials",
                                            "--disable-fastapi-docs", "--max-stored-responses", "5"])
    cfg = ServerConfig.from_args(args)
    assert cfg.allowed_origins == (ORIGIN,) and cfg.allowed_methods == ("*",) and cfg.allow_credentials
    assert not cfg.enable_docs and cfg.max_stored_responses == 5
    defaults = ServerConfig.from_args(build_serve_parser().parse_args([]))
    assert defaults.allowed_origins == ("*",) and defaults.enable_docs and not defaults.allow_credentials


# ---------------------------------------------------------------- OpenAPI and /docs

def _resolve(doc: dict, ref: str) -> dict:
    node = doc
    for part in ref.removeprefix("#/").split("/"):
        node = node[part]
    return node


def _refs(node):
    if isinstance(node, dict):
        if isinstance(node.get("$ref"), str):
            yield node["$ref"]
        for v in node.values():
            yield from _refs(v)
    elif isinstance(node, list):
        for v in node:
            yield from _refs(v)


def test_openapi_describes_the_request_bodies():
    s = make_server()
    try:
        doc = s.http.get("/openapi.json").json()
        validate(doc)  # a valid OpenAPI 3.1 document
        for ref in _refs(doc):
            _resolve(doc, ref)  # every $ref resolves
        bodies = {"/v1/chat/completions": ("ChatCompletionRequest", "messages"),
                  "/v1/completions": ("CompletionRequest", "prompt"),
                  "/v1/responses": ("ResponsesRequest", "input"),
                  "/tokenize": ("TokenizeRequest", "prompt"), "/detokenize": ("DetokenizeRequest", "tokens")}
        for path, (name, field) in bodies.items():
            schema = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
            assert schema == {"$ref": f"#/components/schemas/{name}"}
            assert field in _resolve(doc, schema["$ref"])["properties"]
        chat = doc["components"]["schemas"]["ChatCompletionRequest"]
        assert chat["required"] == ["messages"] and "temperature" in chat["properties"]
        assert doc["paths"]["/v1/models/{model}"]["get"]["parameters"][0]["name"] == "model"
        assert "llama-server" in doc["paths"]["/props"]["get"]["summary"]
        assert set(doc["paths"]["/v1/responses/{response_id}"]) == {"get", "delete"}
        docs = s.http.get("/docs")
        assert docs.status_code == 200 and "swagger" in docs.text.lower() and "/openapi.json" in docs.text
    finally:
        s.close()


def test_docs_behind_the_key_and_off_with_the_flag(keyed):
    assert keyed.http.get("/openapi.json").status_code == 401
    assert keyed.http.get("/docs").status_code == 401
    auth = {"Authorization": "Bearer sekret"}
    doc = keyed.http.get("/openapi.json", headers=auth).json()
    assert doc["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    assert doc["paths"]["/v1/chat/completions"]["post"]["security"] == [{"bearer": []}, {"apiKeyHeader": []}]
    assert doc["components"]["securitySchemes"]["apiKeyHeader"] == {"type": "apiKey", "in": "header",
                                                                    "name": "X-Api-Key"}
    assert "security" not in doc["paths"]["/health"]["get"]
    assert keyed.http.get("/docs", headers=auth).status_code == 200
    s = make_server(enable_docs=False)
    try:
        for path in ("/openapi.json", "/docs"):
            r = s.http.get(path)
            assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    finally:
        s.close()


# ---------------------------------------------------------------- 405, models/{id}

def test_405_carries_allow():
    s = make_server()
    try:
        for method, path, allow in (("GET", "/v1/chat/completions", "POST"), ("DELETE", "/v1/models", "GET, HEAD"),
                                    ("PUT", "/v1/responses/resp_1", "DELETE, GET, HEAD")):
            r = s.http.request(method, path)
            assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"
            assert ", ".join(sorted(r.headers["allow"].split(", "))) == allow
    finally:
        s.close()


def test_head_wherever_get():
    """HEAD answers as GET does, without a body (RFC 9110; health checks such as curl -I send it)."""
    s = make_server()
    try:
        ids = [[m["id"] for m in s.http.get(p).json()["data"]] for p in ("/models", "/v1/models")]
        assert ids[0] == ids[1] and ids[0]  # llama-server's alias
        for path in ("/health", "/v1/models", "/props", "/metrics"):
            r = s.http.head(path)
            assert r.status_code == 200 and r.content == b"", (path, r.status_code)
        assert s.http.head("/v1/chat/completions").status_code == 405
    finally:
        s.close()


def test_served_model_names_as_vllm_takes_them():
    """--served-model-name takes several names (vLLM's): answers report the first, requests may give
    any; without it, the --model value as given (a path) is a name too, beside the model's own."""
    from specserve.commands.args import build_serve_parser
    from specserve.server.config import ServerConfig

    def cfg(*argv):
        return ServerConfig.from_args(build_serve_parser().parse_args(list(argv)))

    two = cfg("--served-model-name", "org/a", "b")
    assert two.served_model_name == "org/a" and two.model_aliases == ("b",)
    path = cfg("--model", "/models/x/model.gguf")
    assert path.served_model_name is None and path.model_aliases == ("/models/x/model.gguf",)
    s = make_server(served_model_name="org/a", model_aliases=("b",))
    try:
        c = s.client()
        for name in ("org/a", "b", "fake-model"):
            assert c.models.retrieve(name).id == "org/a"
            assert c.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}],
                                             max_tokens=2).model == "org/a"
        with pytest.raises(openai.NotFoundError):
            c.models.retrieve("c")
    finally:
        s.close()


def test_models_retrieve():
    s = make_server(served_model_name="org/my-model")
    try:
        c = s.client()
        card = c.models.retrieve("org/my-model")  # an id with a slash, as hub names have
        assert card.id == "org/my-model" and card.object == "model" and card.model_extra["root"] == "fake-model"
        assert c.models.retrieve("fake-model").id == "org/my-model"  # the engine's own name works too
        with pytest.raises(openai.NotFoundError) as info:
            c.models.retrieve("gpt-4")
        assert info.value.body["code"] == "model_not_found" and info.value.body["param"] == "model"
    finally:
        s.close()


# ---------------------------------------------------------------- system_fingerprint

def test_system_fingerprint_on_every_response_and_chunk():
    s = make_server()
    try:
        c = s.client()
        fp = c.chat.completions.create(model="fake-model", messages=MSGS, max_tokens=3).system_fingerprint
        assert fp.startswith("fp_") and len(fp) == 15
        chunks = list(c.chat.completions.create(model="fake-model", messages=MSGS, max_tokens=3, stream=True))
        assert {ch.system_fingerprint for ch in chunks} == {fp}
        assert c.completions.create(model="fake-model", prompt="x", max_tokens=2).system_fingerprint == fp
        chunks = list(c.completions.create(model="fake-model", prompt="x", max_tokens=2, stream=True))
        assert {ch.system_fingerprint for ch in chunks} == {fp}
        again = make_server()  # the same configuration: the same fingerprint
        try:
            r = again.client().completions.create(model="fake-model", prompt="x", max_tokens=1)
            assert r.system_fingerprint == fp
        finally:
            again.close()
    finally:
        s.close()


def test_fingerprint_follows_the_configuration():
    base = system_fingerprint(describe(FakeEngine()))
    assert base == system_fingerprint(describe(FakeEngine()))
    assert base != system_fingerprint(describe(FakeEngine(spec=False)))
    assert base != system_fingerprint(describe(FakeEngine(model_name="other")))
    assert base != system_fingerprint(describe(FakeEngine(max_model_len=1024)))
    assert base != system_fingerprint(describe(FakeEngine(), "{{ messages }}"))


# ---------------------------------------------------------------- timings

LLAMA_TIMINGS = ["cache_n", "prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second", "predicted_n",
                 "predicted_ms", "predicted_per_token_ms", "predicted_per_second"]


def _choice(index: int, prompt: int, cached: int, completion: int, prefill: float, decode: float,
            spec: AcceptanceStats | None) -> Choice:
    return Choice(index=index, prompt_index=0, prompt_ids=[5] * prompt, params=SamplingParams(), request_id=str(index),
                  prompt_tokens=prompt, cached_tokens=cached, completion_tokens=completion, prefill_time=prefill,
                  decode_time=decode, acceptance=spec)


def test_timings_are_llama_cpps():
    t = timings([_choice(0, 100, 64, 20, 0.018, 0.5, None)])
    assert list(t) == LLAMA_TIMINGS  # no draft fields without speculation
    assert t["cache_n"] == 64 and t["prompt_n"] == 36  # processed, not counting the cached tokens
    assert t["prompt_ms"] == 18.0 and t["prompt_per_token_ms"] == 0.5 and t["prompt_per_second"] == 2000.0
    assert t["predicted_n"] == 20 and t["predicted_ms"] == 500.0
    assert t["predicted_per_token_ms"] == 25.0 and t["predicted_per_second"] == 40.0
    spec = AcceptanceStats(steps=5, draft_tokens=20, accepted_tokens=11, accepted_per_pos=[4, 3, 2, 2])
    t = timings([_choice(0, 10, 0, 16, 0.01, 0.2, spec),
                 _choice(1, 10, 8, 4, 0.02, 0.1, AcceptanceStats(1, 4, 0, [0]))])
    assert list(t) == LLAMA_TIMINGS + ["draft_n", "draft_n_accepted"]
    assert (t["draft_n"], t["draft_n_accepted"]) == (24, 11)
    assert (t["prompt_n"], t["cache_n"], t["predicted_n"]) == (12, 8, 20)  # summed over the choices
    assert (t["prompt_ms"], t["predicted_ms"]) == (20.0, 200.0)  # concurrent: the longest
    assert t["predicted_per_token_ms"] == 10.0
    empty = timings([_choice(0, 4, 4, 0, 0.0, 0.0, None)])
    assert empty["prompt_per_token_ms"] == empty["prompt_per_second"] == empty["predicted_per_token_ms"] == 0.0


def test_timings_over_http():
    s = make_server()
    try:
        r = s.http.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 8}).json()
        t = r["timings"]
        assert list(t) == LLAMA_TIMINGS + ["draft_n", "draft_n_accepted"]
        assert t["prompt_n"] == r["usage"]["prompt_tokens"] and t["cache_n"] == 0
        assert t["predicted_n"] == 8 and t["draft_n"] == r["usage"]["speculative"]["draft_tokens"]
    finally:
        s.close()


# ---------------------------------------------------------------- can the template render tools?

@pytest.mark.parametrize("template,renders", [
    ("{% for m in messages %}{{ m.content }}{% endfor %}", False),
    ("{% if tools %}{{ tools | tojson }}{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}", True),
    # tools named only in a system turn the template builds itself
    ("{% if tools %}<|system|>{% for t in tools %}{{ t.function.name }}:{{ t.function.description }}\n"
     "{% endfor %}{% endif %}{{ messages[-1].content }}", True),
    ("{% if tools %}{{ raise_exception('no tools here') }}{% endif %}{{ messages[0].content }}", False),
    ("{% if tools %}tools are available{% endif %}{{ messages[0].content }}", False),  # says so, lists none
])
def test_renders_tools_probe(template, renders):
    r = ChatRenderer(template, None, "<s>", "</s>", {}, "m")
    assert r.renders_tools is renders
    if not renders:
        from specserve.errors import RequestError
        from specserve.server.protocol import ChatMessage

        tool = {"type": "function", "function": {"name": "f"}}
        with pytest.raises(RequestError, match="does not render tools") as info:
            r.render([ChatMessage(role="user", content="Hi")], tools=[tool])
        assert info.value.param == "tools" and info.value.code == "tools_not_supported"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
