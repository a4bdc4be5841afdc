from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_ALLOW_EPHEMERAL_MODE, temporary_settings

from tasks.speedups.prefect_server import start_early


def test_no_early_server_where_the_run_reports_elsewhere_or_may_not_start_one() -> None:
    with temporary_settings(updates={PREFECT_API_URL: "http://127.0.0.1:9/api"}):
        assert start_early() is None  # a configured API (or `grpoflow up`): nothing to start
    with temporary_settings(updates={PREFECT_SERVER_ALLOW_EPHEMERAL_MODE: False}):
        assert start_early() is None


def test_the_early_server_is_the_one_prefect_then_uses() -> None:
    import httpx
    from prefect.client.orchestration import get_client
    from prefect.server.api.server import SubprocessASGIServer

    early = start_early()
    assert early is not None
    early.join()
    assert early.error is None
    server = SubprocessASGIServer()  # Prefect's own first API call asks for this one
    assert server.running and httpx.get(f"{server.api_url}/health").status_code == 200
    with get_client(sync_client=True) as client:
        assert client.api_url.host == "127.0.0.1" and client.api_url.port == server.port
