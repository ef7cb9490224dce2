"""Schemathesis fuzzes every operation of the server's own OpenAPI schema: never a 5xx."""

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

AUTH = {"Authorization": "Bearer sekret"}


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_server_errors_under_fuzzing(strict_server, mode):
    schema_json = httpx.get(strict_server.base + "/openapi.json").json()
    schema = schemathesis.openapi.from_dict(schema_json)
    failures, statuses = [], []

    @given(case=schema.as_strategy(generation_mode=mode))
    @settings(max_examples=30 if mode == GenerationMode.POSITIVE else 40, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    def check(case):
        response = case.call(base_url=strict_server.base, headers=AUTH, timeout=120)
        statuses.append(response.status_code)
        if response.status_code >= 500:
            failures.append((case.method, case.path, case.body, response.status_code, response.text[:300]))
        if response.status_code >= 400 and "application/json" in str(response.headers.get("content-type")):
            assert "error" in response.json()

    check()
    assert not failures, failures[:3]
    if mode == GenerationMode.POSITIVE:  # the fuzzing reached the engine, not only the validators
        assert statuses.count(200) >= 5, statuses
    assert httpx.get(strict_server.base + "/health").status_code == 200
