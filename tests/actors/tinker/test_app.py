"""The Tinker server's sessions, capabilities, SDK version and API key, through the tinker SDK
(postrain.actors.tinker.app, sessions.py, errors.py)."""
import httpx
import pytest
import tinker

from postrain.actors.tinker import SUPPORTED_SDK_VERSION
from tinker_server import API_KEY

KEY = {"X-API-Key": API_KEY}


def test_the_sdk_is_the_version_the_server_speaks():
    assert tinker.__version__ == SUPPORTED_SDK_VERSION == "0.38.0"


def test_a_service_client_opens_a_session_and_sees_the_models_held(served):
    url, service = served
    client = tinker.ServiceClient(base_url=url, api_key=API_KEY)
    models = tinker.RestClient(base_url=url, api_key=API_KEY).get_server_capabilities().result().supported_models
    assert [(m.model_name, m.max_context_length, m.trainable, m.sampleable) for m in models] == [
        ("tiny", 1024, True, True)]
    session_id = client.holder.get_session_id()
    assert service.sessions.get(session_id).session_id == session_id
    client.close("success").result(timeout=30)
    with pytest.raises(Exception, match="has finished"):
        service.sessions.get(session_id)


def test_heartbeat_telemetry_and_finish_answer_in_the_sdks_shapes(served):
    url, _ = served
    with httpx.Client(base_url=url, headers=KEY) as http:
        created = http.post("/api/v1/create_session", json={"tags": [], "user_metadata": {},
                                                            "sdk_version": "0.38.0"}).json()
        sid = created["session_id"]
        assert http.post("/api/v1/session_heartbeat", json={"session_id": sid}).json() == {"type": "session_heartbeat"}
        assert http.post("/api/v1/telemetry", json={"events": [1, 2]}).json() == {"status": "accepted"}
        assert http.post(f"/api/v1/sessions/{sid}/finish", json={"reason": {"type": "success"}}).status_code == 200
        gone = http.post("/api/v1/session_heartbeat", json={"session_id": sid})
        assert gone.status_code == 410      # the SDK stops its heartbeat loop on 410
        assert http.get("/api/v1/healthz").json() == {"status": "ok"}


@pytest.mark.parametrize("path", ["/api/v1/client/config", "/api/v1/create_session"])
def test_another_sdk_version_is_refused_naming_the_supported_one(served, path):
    url, _ = served
    body = {"sdk_version": "0.26.0", "tags": [], "user_metadata": {}}
    reply = httpx.post(url + path, json=body, headers=KEY)
    assert reply.status_code == 400
    assert "tinker SDK '0.26.0' is not supported" in reply.json()["detail"]
    assert "pip install tinker==0.38.0" in reply.json()["detail"]


def test_a_wrong_or_missing_api_key_is_refused_by_the_sdk_and_raw(served):
    url, _ = served
    with pytest.raises(tinker.AuthenticationError, match="not this server's"):
        tinker.RestClient(base_url=url, api_key="tml-wrong").get_server_capabilities().result()
    reply = httpx.get(url + "/api/v1/get_server_capabilities")
    assert reply.status_code == 401 and "no API key was sent" in reply.json()["detail"]


def test_bad_requests_get_one_clear_error_each_and_the_server_stays_up(served):
    url, _ = served
    with httpx.Client(base_url=url, headers=KEY) as http:
        unknown = http.post("/api/v1/get_info", json={"model_id": "model-nope"})
        assert unknown.status_code == 404 and "unknown model_id 'model-nope'" in unknown.json()["detail"]
        not_json = http.post("/api/v1/create_model", content=b"{not json")
        assert not_json.status_code == 400 and "not valid JSON" in not_json.json()["detail"]
        malformed = http.post("/api/v1/forward_backward", content=b"\xff\xff\xff garbage",
                              headers={"Content-Type": "application/x-protobuf"})
        assert malformed.status_code == 400
        assert "not a ForwardBackwardRequest protobuf" in malformed.json()["detail"]
        missing = http.post("/api/v1/create_model", json={"session_id": "s"})
        assert missing.status_code == 400 and "model_seq_id" in missing.json()["detail"]
        assert http.get("/api/v1/get_server_capabilities").status_code == 200
