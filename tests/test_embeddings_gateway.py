"""POST /v1/embeddings through a real uvicorn server on loopback: the real `openai` client and raw httpx, OpenAI's
shapes (float and base64 vectors, usage), dimensions, the 400s, the wrong-endpoint 400s, the remote relay, every
input of a request batched into one engine step, and no KV block left behind."""
from __future__ import annotations

import asyncio
import base64
import struct
from typing import Any, Iterator

import httpx
import openai
import pytest
import torch
from mock_upstream import serving
from tiny_models import build_tiny_embedding_model, hf_embeddings

from kvgate.engine.async_engine import AsyncEngineArgs, AsyncLLMEngine
from kvgate.gateway.app import create_app
from kvgate.gateway.router import ModelRouter
from kvgate.gateway.serving import OpenAIServing
from kvgate.gateway.serving_embedding import OpenAIServingEmbedding

MAX_MODEL_LEN = 64
TEXTS = ["Hello world", "The cat reads a book today.", "What is the capital of France? Paris.", "x"]
TOL = dict(atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory, tiny_llama: str) -> dict[str, str]:
    root = tmp_path_factory.mktemp("embedding_gateway")
    return {"emb": build_tiny_embedding_model(root / "emb", "qwen3", seed=4),
            "emb-mrl": build_tiny_embedding_model(root / "mrl", "llama", seed=5, sentence_transformers=False,
                                                  matryoshka_dimensions=[16, 32, 64]),
            "gen": tiny_llama}


@pytest.fixture(scope="module")
def server(dirs: dict[str, str]) -> Iterator[tuple[str, dict[str, AsyncLLMEngine]]]:
    """One gateway: two embedding models, the first also as "emb-batched" (prefills held up to 1 s to batch them,
    8 seats), and a generative model; a second gateway relays "relay" to the first one's "emb"."""
    common = dict(num_gpu_blocks_override=64, max_model_len=MAX_MODEL_LEN)
    engines = {"emb": AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=dirs["emb"], **common)),
               "emb-mrl": AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=dirs["emb-mrl"], **common)),
               "emb-batched": AsyncLLMEngine.from_engine_args(AsyncEngineArgs(
                   model=dirs["emb"], scheduler_delay=1.0, max_num_seqs=8, **common)),
               "gen": AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=dirs["gen"], **common))}
    try:
        for e in engines.values():
            asyncio.run(e.wait_until_ready(timeout=60))
        router = ModelRouter()
        for name, e in engines.items():
            router.add_model(name, e)
        with serving(create_app(router)) as base:
            relay = ModelRouter()
            relay.add_model("relay", f"{base}/v1", upstream_model="emb")
            with serving(create_app(relay)) as relay_base:
                yield base, engines, relay_base
    finally:
        for e in engines.values():
            e.shutdown()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0)


def token_ids(engines: dict[str, AsyncLLMEngine], texts: list[str]) -> list[list[int]]:
    return [engines["emb"].tokenizer.encode(t) for t in texts]


def post(base: str, body: dict[str, Any], path: str = "/v1/embeddings") -> httpx.Response:
    return httpx.post(base + path, json=body, timeout=60)


def test_openai_client_matches_transformers(client: openai.OpenAI, server, dirs: dict[str, str]) -> None:
    r = client.embeddings.create(model="emb", input=TEXTS)  # the SDK asks for base64 and decodes it
    assert r.object == "list" and r.model == "emb" and [d.index for d in r.data] == [0, 1, 2, 3]
    ids = token_ids(server[1], TEXTS)
    got = torch.tensor([d.embedding for d in r.data])
    torch.testing.assert_close(got, hf_embeddings(dirs["emb"], ids, "LAST", normalize=True), **TOL)
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(len(i) for i in ids)
    one = client.embeddings.create(model="emb", input=TEXTS[1], encoding_format="float")
    assert len(one.data) == 1  # batched or alone, the same vector up to float32 rounding (other GEMM shapes)
    torch.testing.assert_close(torch.tensor(one.data[0].embedding), got[1], rtol=0, atol=1e-6)
    raw = client.embeddings.create(model="emb", input=TEXTS, extra_body={"normalize": False})  # vLLM's extra
    torch.testing.assert_close(torch.tensor([d.embedding for d in raw.data]),
                               hf_embeddings(dirs["emb"], ids, "LAST", normalize=False), **TOL)


def test_float_and_base64_carry_the_same_float32_values(server) -> None:
    base = server[0]
    floats = post(base, {"model": "emb", "input": TEXTS, "encoding_format": "float"}).json()
    default = post(base, {"model": "emb", "input": TEXTS}).json()
    b64 = post(base, {"model": "emb", "input": TEXTS, "encoding_format": "base64"}).json()
    assert default["data"] == floats["data"]
    for f, b in zip(floats["data"], b64["data"]):
        assert f["object"] == b["object"] == "embedding" and f["index"] == b["index"]
        raw = base64.b64decode(b["embedding"])
        assert len(raw) == 4 * 64  # float32, the hidden size
        assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == f["embedding"]
    assert floats["usage"] == b64["usage"] and set(floats) >= {"object", "data", "model", "usage"}


def test_token_id_inputs_equal_text_inputs(server) -> None:
    base, engines = server[0], server[1]
    ids = token_ids(engines, TEXTS)
    texts = post(base, {"model": "emb", "input": TEXTS}).json()["data"]
    lists = post(base, {"model": "emb", "input": ids}).json()["data"]
    one = post(base, {"model": "emb", "input": ids[2]}).json()["data"]
    assert [d["embedding"] for d in lists] == [d["embedding"] for d in texts]
    assert one[0]["embedding"] == texts[2]["embedding"]


def test_dimensions_on_matryoshka_and_refused_elsewhere(client: openai.OpenAI, server, dirs: dict[str, str]) -> None:
    r = client.embeddings.create(model="emb-mrl", input=TEXTS, dimensions=16)
    got = torch.tensor([d.embedding for d in r.data])
    assert got.shape == (4, 16)
    ids = [server[1]["emb-mrl"].tokenizer.encode(t) for t in TEXTS]
    torch.testing.assert_close(got, hf_embeddings(dirs["emb-mrl"], ids, "LAST", True, dimensions=16), **TOL)
    with pytest.raises(openai.BadRequestError, match=r"dimensions must be one of 16, 32, 64 for this model "
                                                     r"\(its matryoshka dimensions\), got 20"):
        client.embeddings.create(model="emb-mrl", input="x", dimensions=20)
    with pytest.raises(openai.BadRequestError, match="dimensions is not supported by this model"):
        client.embeddings.create(model="emb", input="x", dimensions=16)


@pytest.mark.parametrize("body, words", [
    ({"input": ""}, "input is empty: every input needs at least one token"),
    ({"input": []}, "input must not be empty"),
    ({"input": [[]]}, "input is empty"),
    ({"input": ["a", ""]}, "input[1] is empty"),
    ({"input": ["a"] * 2049}, "input has 2049 items, more than the limit of 2048 per request"),
    ({"input": "word " * 80}, "maximum context length is 64 tokens, but input has"),
    ({"input": [[5] * 10, [5] * 65]}, "maximum context length is 64 tokens, but input[1] has 65 tokens"),
    ({"input": ["a", [5]]}, "input must be a string, a list of strings, a list of token ids or a list of lists"),
    ({"input": [5, 100000]}, "input has token id 100000, out of range: ids must be in [0, 512)"),
    ({"input": [[5], [-1]]}, "input[1] has token id -1, out of range"),
    ({"input": "x", "foo": 1}, "unsupported field 'foo'"),
    ({"input": "x", "encoding_format": "int8"}, "invalid encoding_format"),
    ({"input": "x", "dimensions": 0}, "dimensions must be a positive integer, got 0"),
    ({"input": 3}, "input must be a string, a list of strings"),
    ({"input": "x", "model": None}, "the request names no model; available: emb"),
])
def test_bad_requests_get_a_clear_400(server, body: dict, words: str) -> None:
    r = post(server[0], {"model": "emb", **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert words in err["message"] and err["type"] == "invalid_request_error", err


def test_each_endpoint_refuses_the_other_kind_of_model(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match=r"`gen` is a text-generation model: it serves "
                                                     r"/v1/chat/completions and /v1/completions, not /v1/embeddings"):
        client.embeddings.create(model="gen", input="hello")
    with pytest.raises(openai.BadRequestError, match=r"`emb` is an embedding model \(runner pooling\): it serves "
                                                     r"/v1/embeddings, not /v1/chat/completions"):
        client.chat.completions.create(model="emb", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="it serves /v1/embeddings, not /v1/completions"):
        client.completions.create(model="emb", prompt="hi")
    assert client.completions.create(model="gen", prompt="hi", max_tokens=2).usage.completion_tokens == 2


def test_models_lists_and_tokenize_serves_embedding_models(server) -> None:
    base = server[0]
    models = httpx.get(f"{base}/v1/models").json()["data"]
    card = next(m for m in models if m["id"] == "emb")
    assert card["object"] == "model" and card["max_model_len"] == MAX_MODEL_LEN
    tok = post(base, {"model": "emb", "prompt": TEXTS[0]}, "/tokenize").json()
    assert tok["tokens"] == token_ids(server[1], TEXTS[:1])[0] and tok["max_model_len"] == MAX_MODEL_LEN


def test_the_remote_relay_passes_embeddings_through(client: openai.OpenAI, server) -> None:
    relayed = openai.OpenAI(base_url=f"{server[2]}/v1", api_key="unused", max_retries=0)
    r = relayed.embeddings.create(model="relay", input=TEXTS)
    assert r.model == "emb"  # the upstream's answer, unchanged
    assert [d.embedding for d in r.data] == [d.embedding for d in client.embeddings.create(model="emb",
                                                                                           input=TEXTS).data]
    with pytest.raises(openai.BadRequestError, match="input must not be empty"):  # the upstream's 400
        relayed.embeddings.create(model="relay", input=[])


def num_steps(e) -> int:
    return e.num_steps


def in_core(engine: AsyncLLMEngine, fn: Any) -> Any:
    """fn(engine core), run between the core's steps."""
    async def main() -> Any:
        return await engine.call(fn)
    return asyncio.run(main())


def core_state(e) -> tuple[list[str], int, int, int]:
    bm = e.block_manager
    return list(e.requests), bm.num_free_blocks, bm.num_blocks, e.latency_stats.request_success["abort"]


def test_every_input_of_a_request_enters_the_engine_together(server) -> None:
    """"emb-batched" holds prefills up to 1 s to batch them unless its 8 seats fill: 8 inputs that arrive
    together run in one step, and at once (one after another, each would wait out the hold in a step of its own)."""
    base, engine = server[0], server[1]["emb-batched"]
    before = in_core(engine, num_steps)
    r = post(base, {"model": "emb-batched", "input": [f"text number {i}" for i in range(8)]})
    assert r.status_code == 200 and len(r.json()["data"]) == 8
    assert in_core(engine, num_steps) - before == 1


def test_a_cancelled_request_aborts_every_input(server) -> None:
    engine = server[1]["emb-batched"]  # 3 inputs < 8 seats: held for 1 s, cancelled meanwhile
    embedding = OpenAIServingEmbedding(OpenAIServing("emb-batched", engine))

    async def main() -> tuple[list[str], int, int, int]:
        aborted = (await engine.call(core_state))[3]
        task = asyncio.ensure_future(embedding.create({"model": "emb-batched", "input": ["a", "b", "c"]}, 50, None))
        while engine.num_requests < 3:  # the three requests are registered as soon as the task first runs
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        live, free, total, now_aborted = await engine.call(core_state)  # after the aborts: commands keep order
        return live, free - total, now_aborted - aborted, engine.num_requests

    assert asyncio.run(main()) == ([], 0, 3, 0)


def test_no_kv_block_is_left_behind(server) -> None:
    for name, engine in server[1].items():
        live, free, total, _ = in_core(engine, core_state)
        assert live == [] and free == total, name
