"""Images over real HTTP: ``specserve serve`` on the tiny Qwen3.5 image-text model (speculating
with ngram) answers data: and allowed http(s) image URLs with the text plain in-process greedy
decoding gives, counts image tokens in /tokenize and usage, and refuses every bad image with an
OpenAI-style 400 while it keeps serving."""

from __future__ import annotations

import base64
import functools
import http.server
import io
import json
import random
import threading
import time

import httpx
import pytest

from specserve.bench.serverproc import ManagedServer, free_port, serve_argv
from specserve.engine.config import EngineConfig
from specserve.engine.llm_engine import LLMEngine
from specserve.engine.types import SamplingParams
from specserve.models.loader import load_model
from test_vision import PAD, build, picture
from tiny_models import FP32, make_tiny_vl

SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "adaptive": False})


def png(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def noise_png() -> bytes:
    """100 x 100 random pixels: a PNG of ~30 KB, over the test server's --max-image-bytes."""
    from PIL import Image

    return png(Image.frombytes("RGB", (100, 100), random.Random(3).randbytes(30000)))


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


class Files(http.server.SimpleHTTPRequestHandler):
    """The directory's files, plus /slow.png (answers after 3 s) and /moved.png (a redirect to a.png)."""

    def do_GET(self):  # noqa: N802 (the stdlib's name)
        if self.path == "/slow.png":
            time.sleep(3)
            self.path = "/a.png"
        elif self.path == "/moved.png":
            self.send_response(302)
            self.send_header("Location", "/a.png")
            self.end_headers()
            return
        super().do_GET()

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A directory of images served over loopback HTTP: (base url, {name: bytes})."""
    d = tmp_path_factory.mktemp("images")
    blobs = {"a.png": png(picture(7, (40, 30))), "b.png": png(picture(8, (30, 50))), "noise.png": noise_png()}
    for name, data in blobs.items():
        (d / name).write_bytes(data)
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Files, directory=str(d)))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}", blobs
    srv.shutdown()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_vl_server")
    make_tiny_vl(d)
    port = free_port()
    argv = serve_argv(f"--model {d} --max-model-len 512 --quantization none --speculative-config '{SPEC}' "
                      "--limit-mm-per-prompt '{\"image\": 3}' --allowed-media-domains 127.0.0.1 --max-image-pixels 20000 "
                      "--max-image-bytes 20000 --media-fetch-timeout 1",
                      port)
    with ManagedServer(argv, port, "tiny-vl", startup_timeout=300) as srv:
        with httpx.Client(base_url=srv.url, timeout=120) as http_:
            yield d, http_


def chat(http_, content, **extra) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 16, "temperature": 0,
            "ignore_eos": True, **extra}
    return http_.post("/v1/chat/completions", json=body)


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def test_image_answers_equal_plain_greedy_and_repeat(server, files):
    d, http_ = server
    _, blobs = files
    content = [{"type": "text", "text": "what is "}, image_part(data_url(blobs["a.png"])),
               {"type": "text", "text": " and "}, image_part(data_url(blobs["b.png"]))]
    r1, r2 = chat(http_, content), chat(http_, content)
    assert r1.status_code == 200, r1.text
    text = r1.json()["choices"][0]["message"]["content"]
    assert r2.json()["choices"][0]["message"]["content"] == text  # byte-identical run to run
    tok = http_.post("/tokenize", json={"messages": [{"role": "user", "content": content}]}).json()
    assert tok["count"] == r1.json()["usage"]["prompt_tokens"] and tok["tokens"].count(PAD) == sum(tok["image_tokens"])
    assert r2.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the same images: a hit

    # the same prompt in-process, plain greedy without speculation
    from PIL import Image

    model = load_model(str(d), FP32)
    ids, images = build(model, ["<|im_start|>user\nwhat is ", Image.open(io.BytesIO(blobs["a.png"])), " and ",
                                Image.open(io.BytesIO(blobs["b.png"])), "<|im_end|>\n<|im_start|>assistant\n"])
    assert ids == tok["tokens"]
    eng = LLMEngine(model, EngineConfig(max_model_len=512))
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    out = [t for o in eng.generate(ids, params, "p", images) for t in o.new_token_ids]
    # (the server holds back a last byte that is not a whole UTF-8 character yet)
    assert len(text) >= 8 and model.tokenizer.decode(out).startswith(text)


def test_allowed_http_url_equals_the_data_url(server, files):
    _, http_ = server
    base, blobs = files
    by_url = chat(http_, [image_part(f"{base}/a.png"), {"type": "text", "text": "?"}])
    by_data = chat(http_, [image_part(data_url(blobs["a.png"])), {"type": "text", "text": "?"}])
    assert by_url.status_code == 200, by_url.text
    assert by_url.json()["choices"][0]["message"]["content"] == by_data.json()["choices"][0]["message"]["content"]


def _gif() -> bytes:
    buf = io.BytesIO()
    picture(9).save(buf, format="GIF")
    return buf.getvalue()


BAD = {
    "bad_base64": (lambda base: [image_part("data:image/png;base64,@@@not base64@@@")], "invalid_image_url"),
    "not_an_image": (lambda base: [image_part(data_url(b"hello, world"))], "invalid_image"),
    "gif": (lambda base: [image_part(data_url(_gif(), "image/gif"))], "invalid_image"),
    "other_domain": (lambda base: [image_part("https://example.com/cat.png")], "image_domain_not_allowed"),
    "file_url": (lambda base: [image_part("file:///etc/passwd")], "invalid_image_url"),
    "missing_file": (lambda base: [image_part(f"{base}/nope.png")], "image_fetch_failed"),
    "slow_download": (lambda base: [image_part(f"{base}/slow.png")], "image_fetch_failed"),  # past the timeout
    "redirect": (lambda base: [image_part(f"{base}/moved.png")], "image_fetch_failed"),  # not followed
    "no_url": (lambda base: [{"type": "image_url", "image_url": {}}], None),
    "too_many": (lambda base: [image_part(f"{base}/a.png")] * 4, "too_many_images"),
    "too_many_pixels": (lambda base: [image_part(data_url(png(picture(10, (200, 101)))))], "image_too_large"),
    "big_data_url": (lambda base: [image_part(data_url(noise_png()))], "image_too_large"),
    "big_download": (lambda base: [image_part(f"{base}/noise.png")], "image_too_large"),
    "extreme_aspect": (lambda base: [image_part(data_url(png(picture(11, (4000, 4)))))], "invalid_image"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_images_get_a_400_and_the_server_keeps_serving(server, files, case):
    _, http_ = server
    content, code = BAD[case]
    r = chat(http_, content(files[0]))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    if code:
        assert err["code"] == code
    assert err["param"].startswith("messages")  # names the part (the count: the messages)
    if case == "slow_download":
        assert "TimeoutError" in err["message"] or "Timeout" in err["message"]
    assert chat(http_, "still there?").status_code == 200
    assert http_.get("/health").status_code == 200


def test_responses_api_reads_input_images_as_chat_does(server, files):
    _, http_ = server
    _, blobs = files
    url = data_url(blobs["b.png"])
    chat_r = http_.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [
        image_part(url), {"type": "text", "text": "what?"}]}], "max_tokens": 12, "temperature": 0})
    resp = http_.post("/v1/responses", json={"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": url}, {"type": "input_text", "text": "what?"}]}],
        "max_output_tokens": 12, "temperature": 0})
    assert resp.status_code == 200, resp.text
    text = "".join(p["text"] for item in resp.json()["output"] if item["type"] == "message" for p in item["content"])
    assert text == chat_r.json()["choices"][0]["message"]["content"]
    assert resp.json()["usage"]["input_tokens"] == chat_r.json()["usage"]["prompt_tokens"]
    bad = http_.post("/v1/responses", json={"input": [{"role": "user", "content": [
        {"type": "input_image", "file_id": "file-1"}]}]})
    assert bad.status_code == 400 and "file_id" in bad.json()["error"]["message"]


def test_generate_cli_takes_images(server, tmp_path):
    """``specserve generate --image FILE`` puts the image before the prompt in the user message."""
    import subprocess
    import sys

    from PIL import Image

    d, _ = server
    f = tmp_path / "p.png"
    picture(5, (60, 40)).save(f)
    out = subprocess.run([sys.executable, "-m", "specserve", "generate", "--model", str(d), "--quantization", "none",
                          "--image", str(f), "--max-tokens", "8", "--ignore-eos", "--json", "what is this?"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])["token_ids"]
    model = load_model(str(d), FP32)
    ids, images = build(model, ["<|im_start|>user\n", Image.open(f), "what is this?<|im_end|>\n<|im_start|>assistant\n"])
    eng = LLMEngine(model, EngineConfig(max_model_len=512))
    want = [t for o in eng.generate(ids, SamplingParams(max_tokens=8, ignore_eos=True), "g", images)
            for t in o.new_token_ids]
    assert got == want
