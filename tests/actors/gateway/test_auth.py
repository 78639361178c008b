"""The gateway's API key (actors/gateway/auth.py): the app with a key, on the builtin server over a
real socket, answers a `/v1/` call without the key, or with another, 401 in the OpenAI API's error
shape (the openai client raises its AuthenticationError); the key, or an open episode's key,
admits; `/health` stays open. The key is required off loopback: the gateway's options refuse to
validate without one, and `postrain serve --host 0.0.0.0` refuses in one line, before it starts.

The app's generator pool holds a stand-in generator that no call here reaches (`/v1/models`
needs none)."""
from __future__ import annotations

import types

import httpx
import openai
import pytest

from postrain.actors.gateway import GatewayActor
from postrain.actors.gateway.app import build_app
from postrain.actors.gateway.auth import ApiKeyError, is_loopback, read_api_key_file
from postrain.actors.gateway.episodes import EpisodeStore
from postrain.actors.gateway.pool import GeneratorPool
from postrain.actors.gateway.service import GatewayService
from postrain.actors.models.tokenizer import byte_tokenizer
from postrain.cli.main import Parser, main as postrain_main
from postrain.cli import serve as serve_cli
from postrain.core.errors import ConfigError
from postrain.core.options import validate_options
from threaded_server import served  # tests/actors/threaded_server.py

KEY = "test-key-0123456789abcdef"


@pytest.fixture(scope="module")
def gateway():
    """(base URL, the app's EpisodeStore) of the app with KEY, served on loopback from a thread."""
    tokenizer = byte_tokenizer()
    episodes = EpisodeStore(tokenizer)
    service = GatewayService(tokenizer, GeneratorPool([types.SimpleNamespace(name="generator")], 4),
                             ("tiny",), 64, "hermes", episodes)
    with served(build_app(service, KEY)) as port:
        yield f"http://127.0.0.1:{port}", episodes


def test_a_call_without_the_key_gets_401_in_the_openai_error_shape(gateway):
    base_url, _ = gateway
    for headers, message in [({}, "You didn't provide an API key"),
                             ({"Authorization": "Bearer wrong"}, "Incorrect API key provided"),
                             ({"Authorization": f"Basic {KEY}"}, "You didn't provide an API key")]:
        response = httpx.get(base_url + "/v1/models", headers=headers, timeout=30)
        assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer"
        error = response.json()["error"]
        assert error == {"message": error["message"], "type": "invalid_request_error", "param": None,
                         "code": "invalid_api_key"} and error["message"].startswith(message)
    with pytest.raises(openai.AuthenticationError, match="Incorrect API key"):
        openai.OpenAI(base_url=base_url + "/v1", api_key=KEY[:-1], max_retries=0).models.list()
    assert httpx.get(base_url + "/health", timeout=30).status_code == 200


def test_the_key_and_an_open_episodes_key_are_admitted(gateway):
    base_url, episodes = gateway
    client = openai.OpenAI(base_url=base_url + "/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in client.models.list()] == ["tiny"]
    episodes.open("episode-1")
    agent = openai.OpenAI(base_url=base_url + "/v1", api_key="episode-1", max_retries=0)
    assert [m.id for m in agent.models.list()] == ["tiny"]
    episodes.close("episode-1")
    with pytest.raises(openai.AuthenticationError):
        agent.models.list()


def test_serve_off_loopback_without_a_key_is_refused_in_one_line(capsys, monkeypatch):
    monkeypatch.delenv(serve_cli.API_KEY_ENV, raising=False)
    assert postrain_main(["serve", "--model", "tiny", "--host", "0.0.0.0", "--port", "0"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith("postrain serve: --host 0.0.0.0 is reachable beyond this machine")
    assert "fix: add --api-key-file PATH (or --api-key KEY, or set POSTRAIN_API_KEY)" in captured.err
    assert postrain_main(["serve", "--model", "tiny", "--api-key-file", "/no/such/key"]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_serve_takes_the_key_from_its_file_its_flag_or_the_environment(tmp_path, monkeypatch):
    parser = Parser(prog="postrain serve")
    serve_cli.add_arguments(parser)
    (tmp_path / "key").write_text(f"  {KEY}  \nignored\n")
    monkeypatch.setenv(serve_cli.API_KEY_ENV, "from-env")
    key_file = str(tmp_path / "key")
    assert serve_cli.api_key(parser.parse_args(["--model", "tiny", "--api-key-file", key_file])) == KEY
    assert serve_cli.api_key(parser.parse_args(["--model", "tiny", "--api-key", "flag"])) == "flag"
    assert serve_cli.api_key(parser.parse_args(["--model", "tiny"])) == "from-env"
    monkeypatch.delenv(serve_cli.API_KEY_ENV)
    assert serve_cli.api_key(parser.parse_args(["--model", "tiny"])) is None
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ApiKeyError, match="the first line of .*empty' must be 1 or more visible ASCII"):
        read_api_key_file(tmp_path / "empty")


def test_the_gateway_options_need_a_key_off_loopback(tmp_path):
    with pytest.raises(ConfigError, match="host '0.0.0.0' is not loopback, so the gateway needs an API key; "
                                          "fix: set api_key_file"):
        validate_options(GatewayActor, {"host": "0.0.0.0"})
    with pytest.raises(ConfigError, match="set api_key or api_key_file, not both"):
        validate_options(GatewayActor, {"api_key": KEY, "api_key_file": "k"})
    with pytest.raises(ConfigError, match="api_key must be 1 or more visible ASCII characters"):
        validate_options(GatewayActor, {"api_key": "two words"})
    (tmp_path / "key").write_text(KEY)
    options = validate_options(GatewayActor, {"host": "0.0.0.0", "api_key_file": str(tmp_path / "key")})
    assert options.read_api_key() == KEY and KEY not in repr(validate_options(GatewayActor, {"api_key": KEY}))
    assert validate_options(GatewayActor, {"host": "::1"}).read_api_key() is None


@pytest.mark.parametrize("host, loopback", [("127.0.0.1", True), ("127.0.0.2", True), ("::1", True),
                                            ("[::1]", True), ("localhost", True), ("0.0.0.0", False),
                                            ("::", False), ("", False), ("10.0.0.5", False),
                                            ("example.com", False)])
def test_is_loopback(host, loopback):
    assert is_loopback(host) is loopback
