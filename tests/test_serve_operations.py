"""The service as operators run it, over real HTTP: bearer keys, the loopback rule, settings checked before anything
loads, request ids in answers and logs, JSON logs, a generic 500, and /info without machine paths."""
from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest
from server_helpers import ROOT, ServerProcess, tiny_hf_model, write_tiny_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model_dir(tmp_path_factory.mktemp("tiny_packed"), tiny_hf_model(seed=0))


@pytest.fixture(scope="module")
def keyed(model_dir, tmp_path_factory):
    """A server with two keys: one from API_KEY, one from API_KEYS_FILE; JSON logs at info level."""
    tmp = tmp_path_factory.mktemp("keyed")
    keys_file = tmp / "keys.txt"
    keys_file.write_text("# operators' keys\nkey-from-file-2  # the second key\n\n")
    with ServerProcess(model_dir, tmp / "server.log", API_KEY="key-one-1", API_KEYS_FILE=keys_file,
                       LOG_LEVEL="info", LOG_FORMAT="json", via_serve_sh=False) as srv:
        yield srv


def _headers(key: str | None) -> dict:
    return {} if key is None else {"Authorization": f"Bearer {key}"}


@pytest.mark.parametrize("path, method", [("/draft", "post"), ("/info", "get"), ("/metrics", "get"),
                                          ("/openapi.json", "get")])
def test_every_endpoint_but_health_needs_a_key(keyed, path, method):
    body = {"json": {"tokens": [1, 2, 3]}} if method == "post" else {}
    with httpx.Client(base_url=keyed.url, timeout=30) as c:
        for bad in (None, "wrong", "key-one-", "key-one-1x"):
            r = getattr(c, method)(path, headers=_headers(bad), **body)
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", (bad, r.text)
            assert "API key" in r.json()["error"]
        r = getattr(c, method)(path, headers={"Authorization": "Basic key-one-1"}, **body)
        assert r.status_code == 401  # the key alone is not enough: the scheme is Bearer
        for good in ("key-one-1", "key-from-file-2"):
            assert getattr(c, method)(path, headers=_headers(good), **body).status_code == 200
        assert c.get("/health").status_code == 200  # a load balancer's probe needs no key


def test_keys_are_never_logged_or_shown(keyed):
    with httpx.Client(base_url=keyed.url, timeout=30) as c:
        info = c.get("/info", headers=_headers("key-one-1")).json()
        c.post("/draft", json={"tokens": [1]}, headers=_headers("wrong-key-zz"))
    text = json.dumps(info)
    assert "key-one-1" not in text and "key-from-file-2" not in text and info["server"]["auth"] == "bearer"
    log = keyed.log()
    assert "key-one-1" not in log and "key-from-file-2" not in log and "wrong-key-zz" not in log


def test_request_ids_are_returned_and_in_every_json_log_line_of_the_request(keyed):
    with httpx.Client(base_url=keyed.url, timeout=30, headers=_headers("key-one-1")) as c:
        mine = c.post("/draft", json={"tokens": [1, 2, 3]}, headers={"X-Request-ID": "client-chosen.id-42"})
        made = c.post("/draft", json={"tokens": [4, 5]})
        odd = c.post("/draft", json={"tokens": [4, 5]}, headers={"X-Request-ID": "has spaces and {braces}"})
    assert mine.headers["x-request-id"] == "client-chosen.id-42"
    assert len(made.headers["x-request-id"]) == 32  # generated: a uuid4 hex
    assert odd.headers["x-request-id"] != "has spaces and {braces}" and len(odd.headers["x-request-id"]) == 32
    lines = [json.loads(line) for line in keyed.log().splitlines() if line.startswith("{")]
    assert lines and all({"time", "level", "logger", "message", "request_id"} <= set(d) for d in lines)
    access = [d for d in lines if d["logger"] == "specdraft.access" and d["request_id"] == "client-chosen.id-42"]
    assert len(access) == 1 and access[0]["path"] == "/draft" and access[0]["status"] == 200
    assert any(d["request_id"] == made.headers["x-request-id"] for d in lines)


def test_info_shows_no_machine_paths(keyed, model_dir):
    with httpx.Client(base_url=keyed.url, timeout=30, headers=_headers("key-one-1")) as c:
        text = c.get("/info").text
    assert str(model_dir) not in text and str(ROOT) not in text and "/tmp/" not in text
    assert json.loads(text)["server"]["model"] == model_dir.name


@pytest.mark.parametrize("env, expected", [
    ({"PORT": "abc"}, "PORT='abc': Input should be a valid integer"),
    ({"PORT": "70000"}, "PORT='70000': Input should be less than or equal to 65535"),
    ({"MAX_BATCH": "0"}, "MAX_BATCH='0': Input should be greater than or equal to 1"),
    ({"ENGINE_DTYPE": "fp8"}, "ENGINE_DTYPE='fp8': Input should be 'auto', 'auto-approx'"),
    ({"LOG_FORMAT": "xml"}, "LOG_FORMAT='xml': Input should be 'text' or 'json'"),
    ({"API_KEYS_FILE": "/no/such/keys"}, "API_KEYS_FILE='/no/such/keys': no such file"),
    ({"HOST": "0.0.0.0"}, "HOST='0.0.0.0' is not a loopback address and no API_KEY / API_KEYS_FILE is set"),
])
def test_bad_settings_stop_the_server_before_anything_loads(model_dir, env, expected):
    out = subprocess.run([sys.executable, str(ROOT / "server.py")], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, env={"PATH": "/usr/bin:/bin", "MODEL_DIR": str(model_dir), **env})
    assert out.returncode == 1 and expected in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and "torch" not in out.stderr


def test_a_non_loopback_host_is_allowed_with_a_key_or_behind_an_authenticating_proxy():
    from drafter_lib.serve.settings import Settings

    assert Settings(host="0.0.0.0", api_key="k").api_keys() == ["k"]
    assert Settings(host="0.0.0.0", behind_auth_proxy=True).api_keys() == []
    for host in ("127.0.0.1", "127.8.9.1", "::1", "localhost"):
        assert Settings(host=host).host == host


def test_an_unexpected_error_answers_a_generic_500_with_the_request_id(model_dir, caplog):
    """The answer names no exception; the log has the details and the same request id."""
    import logging

    from fastapi.testclient import TestClient

    from drafter_lib.engine import DraftEngine
    from drafter_lib.serve.app import create_app
    from drafter_lib.serve.logs import RequestIdFilter
    from drafter_lib.serve.settings import Settings

    engine = DraftEngine.from_dir(model_dir)

    def broken_info():
        raise RuntimeError("secret internal detail /some/machine/path")

    app = create_app(Settings(model_dir=str(model_dir)), engine=engine)
    app.add_api_route("/boom", lambda: broken_info())  # a route that fails the way a bug would
    caplog.handler.addFilter(RequestIdFilter())
    with caplog.at_level(logging.ERROR), TestClient(app, raise_server_exceptions=False) as tc:
        r = tc.get("/boom", headers={"X-Request-ID": "trace-me-7"})
    assert r.status_code == 500 and "secret" not in r.text and "RuntimeError" not in r.text
    assert "trace-me-7" in r.json()["error"]
    records = [rec for rec in caplog.records if rec.name == "specdraft.serve"]
    assert records and records[0].request_id == "trace-me-7" and "secret internal detail" in caplog.text


def test_warm_up_caches_the_timed_choices_so_a_start_reads_them(model_dir, tmp_path):
    """`server.py --warm-up` (what setup.sh runs) times the weight formats and exits; a server started afterwards
    with the same cache reads every choice instead of timing it, and logs that it did."""
    env = {"PATH": "/usr/bin:/bin", "MODEL_DIR": str(model_dir), "SPECDRAFT_CACHE_DIR": str(tmp_path / "cache"),
           "LOG_LEVEL": "info"}
    out = subprocess.run([sys.executable, str(ROOT / "server.py"), "--warm-up"], cwd=ROOT, capture_output=True,
                         text=True, timeout=600, env=env)
    assert out.returncode == 0 and "warm-up done" in out.stderr, out.stderr[-3000:]
    assert "timing " in out.stderr and (tmp_path / "cache" / "kernels.json").is_file()
    srv = ServerProcess(model_dir, tmp_path / "server.log", env=env, via_serve_sh=False, LOG_LEVEL="info")
    with srv:
        log = srv.log()
    assert "cached choice for" in log and "timing " not in log and "ready in" in log, log[-3000:]
