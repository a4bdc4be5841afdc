"""The alias follower and the HTTP front in-process, on the real transformers engine and a real registry: what the
pipeline registers passes the serving checks, and the front answers OpenAI's shapes and refuses what it must."""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import httpx
import mlflow

from tasks.config import load_config
from tasks.models import resolve_model_source
from tasks.models.precision import resolved_precision
from tasks.registry import CHAMPION, alias_version, client_for, move_champion
from tasks.registry.packaging import adapter_in, base_fingerprint
from tasks.serving import (
    DIGEST_TAG,
    AliasFollower,
    ServingMetrics,
    TransformersEngine,
    adapter_digest,
    build_app,
    read_smoke_record,
)

REPO = Path(__file__).resolve().parents[3]


class InProcessClient:
    """The app called in-process through httpx's ASGI transport (Starlette's test client wants httpx2)."""

    def __init__(self, app) -> None:
        self.app = app

    def request(self, method: str, path: str, **kwargs) -> httpx.Response:
        async def call() -> httpx.Response:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://serve") as c:
                response = await c.request(method, path, **kwargs)
                await response.aread()
                return response

        return anyio.run(call)

    def get(self, path: str, **kwargs) -> httpx.Response:
        return self.request("GET", path, **kwargs)

    def post(self, path: str, **kwargs) -> httpx.Response:
        return self.request("POST", path, **kwargs)


def follower_for(config, alias: str, workdir: Path) -> AliasFollower:
    base_dir = resolve_model_source(config.model.source)
    engine = TransformersEngine(base_dir, resolved_precision(config.model.precision))
    client = client_for(config.resolved_tracking_uri())
    name = config.tracking.registered_model_name
    fingerprint = base_fingerprint(base_dir)
    return AliasFollower(
        client, name, alias, engine, config.serving, workdir, ServingMetrics(), fingerprint, config.data.system_prompt
    )


def test_a_version_the_pipeline_registered_carries_what_serving_checks_and_passes(registered_tiny, tmp_path) -> None:
    config, _ = registered_tiny
    client = client_for(config.resolved_tracking_uri())
    name = config.tracking.registered_model_name
    alias = CHAMPION if alias_version(client, name, CHAMPION) else "challenger"
    version = alias_version(client, name, alias)  # other tests sharing the store may have registered more runs
    number = str(version.version)
    local = Path(
        mlflow.artifacts.download_artifacts(
            version.source, dst_path=str(tmp_path / "v"), tracking_uri=client.tracking_uri
        )
    )
    assert version.tags[DIGEST_TAG] == adapter_digest(adapter_in(local))
    record = read_smoke_record(local)
    assert record is not None and len(record.answers) == config.serving.smoke_prompts
    assert record.engine == "transformers" and record.precision == resolved_precision(config.model.precision)
    assert record.system_prompt == config.data.system_prompt and all(record.answers)

    follower = follower_for(config, alias, tmp_path / "served")
    assert follower.poll() == number
    assert follower.current.checks.startswith("digest verified; 3 smoke answers identical to the recorded ones")
    assert follower.poll() is None  # the alias did not move: nothing is fetched again


def test_the_front_speaks_openai_and_refuses_bad_requests_and_missing_keys(tmp_path, register_version) -> None:
    config = load_config(
        REPO / "configs" / "tiny.yaml",
        {"output_dir": str(tmp_path / "out"), "tracking.registered_model_name": "front-tiny"},
    )
    first = register_version(config, 11)
    follower = follower_for(config, CHAMPION, tmp_path / "served")
    metrics = ServingMetrics()
    app = build_app(follower, follower.engine, metrics, 16, api_key="s3cret")
    http = InProcessClient(app)
    assert http.get("/health").status_code == 503  # nothing served yet
    move_champion(follower.client, "front-tiny", first, "test")
    assert follower.poll() == first and http.get("/health").json()["serving"] == f"front-tiny@champion:v{first}"

    key = {"Authorization": "Bearer s3cret"}
    chat = {"messages": [{"role": "user", "content": "2+2?"}], "temperature": 0, "max_tokens": 4}
    assert http.post("/v1/chat/completions", json=chat).status_code == 401
    assert http.post("/v1/chat/completions", json=chat, headers={"Authorization": "Bearer nope"}).status_code == 401
    assert http.get("/metrics").status_code == 401
    answer = http.post("/v1/chat/completions", json=chat, headers=key)
    assert answer.status_code == 200 and answer.headers["x-grpoflow-version"] == first
    body = answer.json()
    assert body["object"] == "chat.completion" and body["usage"]["completion_tokens"] <= 4
    assert (
        http.post("/v1/completions", json={"prompt": "1+1=", "max_tokens": 3, "n": 2}, headers=key).json()["choices"][
            1
        ]["index"]
        == 1
    )
    streamed = http.post("/v1/chat/completions", json=chat | {"stream": True}, headers=key).text
    events = [line.removeprefix("data: ") for line in streamed.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[0])["choices"][0]["delta"]["content"] == body["choices"][0]["message"]["content"]
    for bad, status in (
        ({"messages": []}, 400),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 17}, 400),
        ({"messages": [{"role": "user", "content": "x"}], "temperature": -1}, 400),
        ({"messages": [{"role": "user", "content": "x"}], "model": "someone-else"}, 404),
    ):
        response = http.post("/v1/chat/completions", json=bad, headers=key)
        assert response.status_code == status and response.json()["error"]["message"]
    listed = http.get("/v1/models", headers=key).json()["data"][0]
    assert listed["id"] == "front-tiny@champion" and listed["grpoflow"]["version"] == first
    assert (
        'grpoflow_serve_requests_total{version="' + first + '",status="200"} 3'
        in http.get("/metrics", headers=key).text
    )
