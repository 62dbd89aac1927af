"""The Responses and Messages APIs on a server with --api-key and --max-stored-responses 2: the
key as Anthropic's clients send it (x-api-key) or OpenAI's (Bearer), a wrong one a 401 in each
API's own error shape, and never more stored responses than the bound, least recently used first."""
from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from server_process import ServerProcess

pytestmark = pytest.mark.slow
ASK = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def keyed(smollm2_gguf):
    srv = ServerProcess("--kv-cache-size", "0.2", "--max-stored-responses", "2", "--served-model-name", "smol",
                        env={"VINOSERVE_API_KEY": "s3cret"}).wait_ready()
    yield srv
    assert srv.terminate() == 0


def test_api_key_on_both_apis(keyed):
    ok = anthropic.Anthropic(base_url=keyed.url, api_key="s3cret", max_retries=0)  # sends x-api-key
    assert ok.messages.create(model="smol", max_tokens=2, messages=ASK).usage.output_tokens >= 1
    assert ok.messages.count_tokens(model="smol", messages=ASK).input_tokens > 0
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=keyed.url, api_key="nope", max_retries=0).messages.create(
            model="smol", max_tokens=2, messages=ASK)
    assert e.value.body == {"type": "error", "error": {"type": "authentication_error", "message": e.value.body[
        "error"]["message"]}}
    bearer = httpx.post(f"{keyed.url}/v1/messages", json={"model": "smol", "max_tokens": 2, "messages": ASK},
                        headers={"Authorization": "Bearer s3cret"})
    assert bearer.status_code == 200
    with pytest.raises(openai.AuthenticationError) as e:
        openai.OpenAI(base_url=f"{keyed.url}/v1", api_key="nope", max_retries=0).responses.create(
            model="smol", input="Hi")
    assert e.value.body["type"] == "authentication_error"


def test_stored_responses_stay_within_the_bound(keyed):
    client = openai.OpenAI(base_url=f"{keyed.url}/v1", api_key="s3cret", max_retries=0)
    first, second = (client.responses.create(model="smol", input="Hi", max_output_tokens=2) for _ in range(2))
    client.responses.retrieve(first.id)  # now the most recently used: the second goes first
    third = client.responses.create(model="smol", input="Hi", max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(second.id)
    assert {client.responses.retrieve(r.id).id for r in (first, third)} == {first.id, third.id}
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="smol", input="Go on.", previous_response_id=second.id, max_output_tokens=2)
