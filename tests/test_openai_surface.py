"""The rest of the OpenAI surface a client meets: one model by id, and clear OpenAI-shaped refusals for endpoints,
methods and content parts kvgate does not serve (through a real uvicorn server and the real openai client)."""
from __future__ import annotations

import httpx
import openai
import pytest
from test_gateway import running

from kvgate.engine.async_engine import AsyncEngineArgs, AsyncLLMEngine
from kvgate.gateway.app import create_app
from kvgate.gateway.router import ModelRouter
from kvgate.gateway.serving import OpenAIServing

NAME = "org/tiny-chat"  # ids may hold a slash, as Hugging Face names do


@pytest.fixture(scope="module")
def base(tiny_model_dirs: dict[str, str]):
    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=tiny_model_dirs["llama"], max_num_seqs=4,
                                                             num_gpu_blocks_override=64))
    router = ModelRouter()
    router.add_model(NAME, OpenAIServing(NAME, engine))
    router.add_route("auto", lambda request: NAME)
    with running(engine, app=create_app(router)) as url:
        yield url


@pytest.fixture
def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)


def test_one_model_by_id(client: openai.OpenAI) -> None:
    listed = {m.id: m for m in client.models.list().data}
    m = client.models.retrieve(NAME)
    assert m.id == NAME and m.object == "model" and m.owned_by == "kvgate"
    assert m.model_dump() == listed[NAME].model_dump() and m.model_extra["max_model_len"] == 512
    assert client.models.retrieve("auto").model_extra["route"] is True
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("nope")
    assert e.value.body["code"] == "model_not_found" and "The model `nope` does not exist" in e.value.body["message"]


def test_unserved_endpoints_say_so_in_openais_shape(client: openai.OpenAI, base: str) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=NAME, input="hi")
    assert e.value.body["code"] == "unsupported_endpoint"
    assert "the Responses API is not served by kvgate; use POST /v1/chat/completions" in e.value.body["message"]
    with pytest.raises(openai.NotFoundError, match="kvgate serves text models: there is no image generation"):
        client.images.generate(model=NAME, prompt="a cat")
    with pytest.raises(openai.NotFoundError, match="no speech synthesis or transcription"):
        client.audio.speech.create(model=NAME, voice="alloy", input="hi")
    for method, path, needle in (("POST", "/v1/rerank", "no reranker"), ("GET", "/v1/files", "no stored objects"),
                                 ("POST", "/v1/nonsense", "Invalid URL (POST /v1/nonsense): kvgate serves")):
        r = httpx.request(method, base + path, json={})
        assert r.status_code == 404 and needle in r.json()["error"]["message"], r.text
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_wrong_method_is_405_with_allow(base: str) -> None:
    r = httpx.get(f"{base}/v1/chat/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert r.json()["error"]["message"] == "/v1/chat/completions takes POST, not GET"
    r = httpx.post(f"{base}/v1/models")
    assert r.status_code == 405 and r.headers["allow"] == "GET"


def test_content_parts_other_than_text_are_refused_by_name(client: openai.OpenAI) -> None:
    parts = [{"type": "text", "text": "What is in this picture?"},
             {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, max_tokens=2, messages=[{"role": "user", "content": parts}])
    assert e.value.body["param"] == "messages"
    assert e.value.body["message"].startswith("messages[0].content[1] has type 'image_url': kvgate serves text models")
    r = client.chat.completions.create(model=NAME, max_tokens=2, temperature=0,  # text parts are joined
                                       messages=[{"role": "user", "content": parts[:1] * 2}])
    same = client.chat.completions.create(model=NAME, max_tokens=2, temperature=0, messages=[
        {"role": "user", "content": "What is in this picture?" * 2}])
    assert r.choices[0].message.content == same.choices[0].message.content
    assert r.usage.prompt_tokens == same.usage.prompt_tokens
