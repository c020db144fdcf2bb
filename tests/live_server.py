"""A live HTTP server for the server tests: create_app over a FakeEngine, served by uvicorn on a free
loopback port in a thread, with the request bodies and templates several test modules share."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import openai
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from fake_engine import FakeEngine
from specserve.server.app import create_app
from specserve.server.config import ServerConfig


class LiveServer:
    """create_app(engine, cfg) served by uvicorn on 127.0.0.1:<free port> in a background thread."""

    def __init__(self, engine: FakeEngine, cfg: ServerConfig):
        self.engine = engine
        self.app = create_app(engine, cfg)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(self.app, log_level="warning", lifespan="on", timeout_graceful_shutdown=1)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            assert self.thread.is_alive(), "uvicorn exited during startup"
            time.sleep(0.01)
        self.http = httpx.Client(base_url=self.url, timeout=10)

    def client(self, api_key: str = "none") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=10)

    def metrics(self) -> dict[tuple, float]:
        text = self.http.get("/metrics").text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return out

    def close(self) -> None:
        self.http.close()
        self.server.should_exit = True
        self.thread.join(timeout=5)


def make_server(engine: FakeEngine | None = None, **cfg) -> LiveServer:
    return LiveServer(engine or FakeEngine(), ServerConfig(**cfg))


def extra(obj, name):
    return (obj.model_extra or {}).get(name)


def wait_for(cond, timeout=5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


MSGS = [{"role": "user", "content": "Hi"}]

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
# renders tools and a history's calls the way Qwen2.5's template does (arguments | tojson)
TOOL_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>\n{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}</tool_call>{% endfor %}\n{% endfor %}assistant:"
)
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
