"""Property-based fuzzing of sandgate's whole REST API (docs/openapi.yaml)
with schemathesis against the live server of conftest.py.

Every operation of the spec gets the spec's examples, schemathesis'
coverage cases and a bounded number of generated requests, valid and
invalid (deterministic: derandomized hypothesis). Each response must be
one the spec documents for that operation (status, content type, headers,
body schema), an invalid request must be refused with a 4xx, no response
may be a 5xx beyond the documented 503 of the model proxy with no upstream
configured, none may take longer than RESPONSE_LIMIT_S, and the server must
still be running after every request.

Sandbox ids: a generated {sandboxID} is replaced, for one request in
two (chosen from the generated value, so replays are the same), by the
id of a live sandbox of the fuzz tenant, so pause, connect, resume,
timeout, network, metrics, events and delete run on real sandboxes in
whatever state earlier requests left them. A sandbox a create made is
killed right after the check, so the 3-sandbox quota of the fuzz tenant
is what bounds the machine's load. Template ids and names: one in three
is replaced by base, the server's own template, so its reads answer 200
and the owner's routes refuse it (400).
"""

import collections
import os
import zlib
from pathlib import Path

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi import checks as oc

SPEC = Path(__file__).resolve().parents[2] / "docs" / "openapi.yaml"
# Generated requests per operation (besides examples and coverage cases);
# SANDGATE_FUZZ_EXAMPLES raises it for a longer hunt by hand.
MAX_EXAMPLES = int(os.environ.get("SANDGATE_FUZZ_EXAMPLES", "50"))
RESPONSE_LIMIT_S = 10.0

schema = schemathesis.pytest.from_fixture("api_schema")

# (method, path template) -> statuses seen, for test_fuzzing_reached_the_routes.
SEEN = collections.defaultdict(collections.Counter)


class Pool:
    """One live sandbox of the fuzz tenant, made again when the fuzzer has
    killed it."""

    def __init__(self, srv):
        self.srv = srv
        self.http = requests.Session()
        self.http.headers["X-API-KEY"] = srv.fuzz_key
        self.id = None

    def live_id(self) -> str:
        if self.id:
            r = self.http.get(f"{self.srv.url}/sandboxes/{self.id}", timeout=30)
            if r.status_code == 200:
                return self.id
            assert r.status_code == 404, f"GET /sandboxes/{self.id}: {r.status_code} {r.text}"
        r = self.http.post(f"{self.srv.url}/v2/sandboxes", json={"templateID": "base", "timeout": 600}, timeout=60)
        assert r.status_code == 201, f"pool create: {r.status_code} {r.text}"
        self.id = r.json()["sandboxID"]
        return self.id

    def kill(self, sandbox_id: str) -> None:
        r = self.http.delete(f"{self.srv.url}/sandboxes/{sandbox_id}", timeout=30)
        assert r.status_code in (204, 404), f"kill {sandbox_id}: {r.status_code} {r.text}"


@pytest.fixture(scope="session")
def api_schema(server):
    loaded = schemathesis.openapi.from_path(str(SPEC))
    loaded.config.update(base_url=server.url)
    return loaded


@pytest.fixture(scope="session")
def pool(server):
    return Pool(server)


def _picks(value: str, mod: int) -> int:
    return zlib.crc32(value.encode("utf-8", "surrogatepass")) % mod


def no_undocumented_5xx(ctx, response, case):
    """not_a_server_error, less the model proxy's documented 503 (no upstream
    is configured in this test) in the provider's error shape."""
    if case.path.startswith("/v1/") and response.status_code == 503:
        body = response.json()
        assert "error" in body, f"503 without a provider error body: {response.text}"
        return None
    return not_a_server_error(ctx, response, case)


def invalid_data_refused(ctx, response, case):
    """negative_data_rejection, with 413 (body over the limit) counted as a
    refusal, less requests whose only fault is a query parameter the spec
    does not name: sandgate ignores those, as E2B's API does
    (docs/openapi.yaml says so)."""
    if response.status_code == 413:
        return None
    known = {p.name for p in case.operation.query}
    if case.query and set(case.query) - known:
        return None
    return oc.negative_data_rejection(ctx, response, case)


def bounded_time(ctx, response, case):
    elapsed = response.elapsed
    assert elapsed < RESPONSE_LIMIT_S, f"response took {elapsed:.1f} s (limit {RESPONSE_LIMIT_S} s)"


CHECKS = [
    no_undocumented_5xx,
    bounded_time,
    oc.status_code_conformance,
    oc.content_type_conformance,
    oc.response_headers_conformance,
    oc.response_schema_conformance,
    invalid_data_refused,
    oc.ignored_auth,
]


@schema.parametrize()
# No example database: a run depends on the code and the spec alone, and
# writes nothing into the source tree.
@settings(max_examples=MAX_EXAMPLES, derandomize=True, database=None, deadline=None,
          suppress_health_check=list(HealthCheck))
def test_api(case, server, pool):
    path_params = case.path_parameters or {}
    if "sandboxID" in path_params and isinstance(path_params["sandboxID"], str):
        if _picks(path_params["sandboxID"], 2) != 0:
            path_params["sandboxID"] = pool.live_id()
    # Templates: one in three requests names base, the server's own.
    for name in ("templateID", "alias"):
        if isinstance(path_params.get(name), str) and _picks(path_params[name], 3) == 0:
            path_params[name] = "base"

    headers = {}
    if case.path.startswith("/v1/"):
        # The model proxy: a model key, either way it is accepted.
        if _picks(case.operation.label + repr(case.body), 2):
            headers["Authorization"] = f"Bearer {server.model_key}"
        else:
            headers["x-api-key"] = server.model_key
    elif case.path not in ("/health", "/metrics"):
        headers["X-API-KEY"] = server.fuzz_key

    response = case.call(headers=headers, timeout=60)
    SEEN[(case.method.upper(), case.path)][response.status_code] += 1
    assert server.proc.poll() is None, f"sandgate exited ({server.proc.returncode}) on {case.as_curl_command()}"
    created = None
    if case.method.upper() == "POST" and case.path in ("/sandboxes", "/v2/sandboxes") and response.status_code == 201:
        created = response.json().get("sandboxID")
    try:
        case.validate_response(response, checks=CHECKS, headers=headers)
    finally:
        if created:
            pool.kill(created)


# Statuses the fuzzing above must have met at least once, so that a run
# that only ever got 401s or 404s (a broken key, a pool that never made a
# sandbox) fails instead of passing on nothing.
MUST_SEE = {
    ("GET", "/health"): {200},
    ("POST", "/sandboxes"): {201, 400},
    ("POST", "/v2/sandboxes"): {201, 400},
    ("GET", "/sandboxes"): {200},
    ("GET", "/v2/sandboxes"): {200, 400},
    ("GET", "/sandboxes/{sandboxID}"): {200, 404},
    ("DELETE", "/sandboxes/{sandboxID}"): {204, 404},
    ("POST", "/sandboxes/{sandboxID}/pause"): {204, 404},
    ("POST", "/sandboxes/{sandboxID}/connect"): {200, 404},
    ("POST", "/v2/sandboxes/{sandboxID}/connect"): {404},
    ("POST", "/sandboxes/{sandboxID}/resume"): {404},
    ("POST", "/sandboxes/{sandboxID}/timeout"): {204, 400},
    ("PUT", "/sandboxes/{sandboxID}/network"): {204, 400},
    ("GET", "/sandboxes/{sandboxID}/metrics"): {200},
    ("GET", "/sandboxes/{sandboxID}/events"): {200},
    ("POST", "/sandboxes/{sandboxID}/snapshots"): {400, 404},
    ("POST", "/sandboxes/{sandboxID}/fork"): {400, 404},
    ("GET", "/snapshots"): {200},
    ("GET", "/llm/usage"): {200},
    ("GET", "/templates"): {200},
    ("GET", "/v2/templates"): {200},
    ("GET", "/templates/{templateID}"): {200, 404},
    ("DELETE", "/templates/{templateID}"): {400, 404},
    ("PATCH", "/templates/{templateID}"): {400, 404},
    ("PATCH", "/v2/templates/{templateID}"): {400, 404},
    ("GET", "/templates/aliases/{alias}"): {200, 404},
    ("GET", "/templates/{templateID}/tags"): {200, 404},
    ("POST", "/templates/tags"): {400, 404},
    ("DELETE", "/templates/tags"): {400, 404},
    ("GET", "/metrics"): {200},
    ("POST", "/v1/chat/completions"): {400, 503},
    ("POST", "/v1/responses"): {400, 503},
    ("POST", "/v1/completions"): {400, 503},
    ("POST", "/v1/embeddings"): {400, 503},
    ("POST", "/v1/messages"): {400, 503},
    ("POST", "/v1/messages/count_tokens"): {400, 503},
    ("GET", "/v1/models"): {503},
    ("GET", "/v1/models/{modelID}"): {503},
}


def test_fuzzing_reached_the_routes(api_schema):
    """Runs after test_api (file order): every operation of the spec was
    fuzzed and met the statuses it must have met."""
    ops = {(op.ok().method.upper(), op.ok().path) for op in api_schema.get_all_operations()}
    assert ops == set(MUST_SEE), f"spec operations differ from MUST_SEE: {ops ^ set(MUST_SEE)}"
    summary = "\n".join(f"  {m} {p}: {dict(sorted(SEEN[(m, p)].items()))}" for m, p in sorted(MUST_SEE))
    print("statuses seen:\n" + summary)
    missing = {f"{m} {p}": sorted(want - set(SEEN[(m, p)])) for (m, p), want in MUST_SEE.items()
               if not want <= set(SEEN[(m, p)])}
    assert not missing, f"statuses never met: {missing}\n{summary}"
