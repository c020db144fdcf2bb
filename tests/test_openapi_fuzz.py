"""Schemathesis from /openapi.json against the server (FakeEngine, real HTTP): bounded examples per
operation, generated from the documented request bodies and mutated from them; no request may get
a 5xx (bad input is a 4xx and the server keeps serving)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings

schemathesis = pytest.importorskip("schemathesis")
from schemathesis.checks import not_a_server_error  # noqa: E402

from live_server import TOOL_TEMPLATE, make_server  # noqa: E402


@pytest.fixture(scope="module")
def live_schema():
    server = make_server(chat_template=TOOL_TEMPLATE, reasoning_parser="qwen3")
    try:
        yield schemathesis.openapi.from_url(server.url + "/openapi.json")
    finally:
        server.close()


schema = schemathesis.pytest.from_fixture("live_schema")


@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
          database=None)
def test_no_request_gets_a_5xx(case):
    case.call_and_validate(checks=[not_a_server_error])
