"""Embedding models (the pooling runner) in the engine: the pooled, normalized hidden state equals transformers'
AutoModel output for every architecture and pooling type, whatever the scheduling (batched, chunked prefill,
prefix-cache hits, preemption), with every KV block free afterwards; and the limits (dimensions, runner,
max_model_len) refuse with clear messages. The HTTP side is in test_embeddings_gateway.py."""
from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Iterator

import pytest
import torch
from tiny_models import assert_engine_idle, build_tiny_embedding_model, hf_embeddings, one_thread, random_prompts

from kvgate.engine import LLM, PoolingParams, SamplingParams
from kvgate.engine.async_engine import AsyncEngineArgs, AsyncLLMEngine
from kvgate.engine.outputs import PoolingRequestOutput

PROMPTS = random_prompts(7, seed=5, min_len=1, max_len=70)
PROMPTS.append(PROMPTS[6][:40] + [11, 12, 13])  # shares a 40-token prefix with another prompt (lengths 3..64)
EMBEDDING_ARCHS = ("llama", "qwen2", "qwen3", "mistral")  # saved as LlamaModel, Qwen2Model, Qwen3Model, MistralModel
TOL = dict(atol=1e-5, rtol=1e-5)


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    with one_thread():
        yield


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """arch -> a sentence-transformers LAST/normalized embedding model; "mrl": a matryoshka one (16, 32, 64)."""
    root = tmp_path_factory.mktemp("embedding_models")
    dirs = {arch: build_tiny_embedding_model(root / arch, arch, seed=1) for arch in EMBEDDING_ARCHS}
    dirs["mrl"] = build_tiny_embedding_model(root / "mrl", "qwen3", seed=2, sentence_transformers=False,
                                             matryoshka_dimensions=[16, 32, 64])
    return dirs


def embeddings(outs: list[PoolingRequestOutput]) -> torch.Tensor:
    assert all(o.finished for o in outs)
    return torch.tensor([o.outputs.embedding for o in outs])


@pytest.mark.parametrize("arch", EMBEDDING_ARCHS)
def test_every_architecture_matches_transformers(models: dict[str, str], arch: str) -> None:
    llm = LLM(models[arch], kv_cache_memory_bytes=1 << 24)  # *Model + modules.json: the pooling runner, LAST
    assert llm.engine.config.runner == "pooling"
    outs = llm.embed(PROMPTS)  # all batched in one step
    assert [o.prompt_token_ids for o in outs] == PROMPTS
    got = embeddings(outs)
    torch.testing.assert_close(got, hf_embeddings(models[arch], PROMPTS, "LAST", normalize=True), **TOL)
    assert torch.allclose(got.norm(dim=-1), torch.ones(len(PROMPTS)))
    assert_engine_idle(llm)


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_embeddings_split_over_ranks_are_transformers(models: dict[str, str], tp: int, pp: int) -> None:
    """The pooling runner under tensor and pipeline parallelism: the last stage's hidden states reach rank 0."""
    llm = LLM(models["qwen3"], kv_cache_memory_bytes=1 << 24, tensor_parallel_size=tp, pipeline_parallel_size=pp,
              max_num_batched_tokens=7, pooler_config={"pooling_type": "MEAN", "normalize": False})
    try:
        got = embeddings(llm.encode(PROMPTS))
        torch.testing.assert_close(got, hf_embeddings(models["qwen3"], PROMPTS, "MEAN", False), **TOL)
        assert_engine_idle(llm)
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("pooling", ["LAST", "MEAN", "CLS"])
@pytest.mark.parametrize("normalize", [True, False])
def test_pooling_types_with_chunked_prefill(models: dict[str, str], pooling: str, normalize: bool) -> None:
    llm = LLM(models["qwen3"], kv_cache_memory_bytes=1 << 24, max_num_batched_tokens=7,
              pooler_config={"pooling_type": pooling, "normalize": normalize})
    got = embeddings(llm.encode(PROMPTS))
    assert llm.engine.num_steps >= 64 // 7  # the longest prompt alone took 10 chunks of <= 7 tokens
    torch.testing.assert_close(got, hf_embeddings(models["qwen3"], PROMPTS, pooling, normalize), **TOL)
    assert_engine_idle(llm)


def test_last_pooling_takes_prefix_cache_hits(models: dict[str, str]) -> None:
    llm = LLM(models["qwen3"], kv_cache_memory_bytes=1 << 24, enable_prefix_caching=True)
    ref = hf_embeddings(models["qwen3"], PROMPTS, "LAST", normalize=True)
    torch.testing.assert_close(embeddings(llm.embed(PROMPTS)), ref, **TOL)
    bm = llm.engine.block_manager
    hits = bm.prefix_cache_hits
    torch.testing.assert_close(embeddings(llm.embed(PROMPTS)), ref, **TOL)  # the same prompts: served from the cache
    assert bm.prefix_cache_hits - hits == sum((len(p) - 1) // 16 * 16 for p in PROMPTS)
    assert_engine_idle(llm)


@pytest.mark.parametrize("pooling", ["MEAN", "CLS"])
def test_mean_and_cls_never_read_the_prefix_cache(models: dict[str, str], pooling: str) -> None:
    llm = LLM(models["qwen3"], kv_cache_memory_bytes=1 << 24, enable_prefix_caching=True,
              pooler_config={"pooling_type": pooling})
    ref = hf_embeddings(models["qwen3"], PROMPTS, pooling, normalize=True)
    for _ in range(2):  # the second time the prefix blocks are cached, but these requests need every token
        torch.testing.assert_close(embeddings(llm.embed(PROMPTS)), ref, **TOL)
    assert llm.engine.block_manager.prefix_cache_hits == 0
    assert_engine_idle(llm)


@pytest.mark.parametrize("pooling", ["MEAN", "CLS", "LAST"])
def test_preemption_recomputes_from_scratch(models: dict[str, str], pooling: str) -> None:
    """An urgent request takes the only seat of a half-prefilled one, whose partial state must start over."""
    llm = LLM(models["qwen3"], kv_cache_memory_bytes=1 << 24, max_num_seqs=1, max_num_batched_tokens=8,
              pooler_config={"pooling_type": pooling, "normalize": False})
    engine, done = llm.engine, {}
    low, high = [PROMPTS[6][:20], PROMPTS[1]], PROMPTS[4:]
    for i, p in enumerate(low):
        engine.add_request(f"low{i}", p, PoolingParams(), priority=10)
    for _ in range(2):
        assert engine.step() == []  # 16 of low0's 20 tokens: the last 4 leave budget for an urgent admission
    for i, p in enumerate(high):
        engine.add_request(f"high{i}", p, PoolingParams(), priority=90)
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step())
    assert engine.scheduler.num_preemptions >= 1
    got = embeddings([done[f"low{i}"] for i in range(len(low))] + [done[f"high{i}"] for i in range(len(high))])
    torch.testing.assert_close(got, hf_embeddings(models["qwen3"], low + high, pooling, normalize=False), **TOL)
    assert_engine_idle(llm)


def test_causal_lm_checkpoint_with_pooling_runner(tiny_model_dirs: dict[str, str]) -> None:
    path = tiny_model_dirs["llama3"]  # LlamaForCausalLM with its own lm_head: ignored by the pooling runner
    assert LLM(path, num_gpu_blocks_override=8).engine.config.runner == "generate"  # auto: it has an LM head
    llm = LLM(path, runner="pooling", kv_cache_memory_bytes=1 << 24, max_num_batched_tokens=16)
    assert llm.engine.runner.model.lm_head is None
    got = embeddings(llm.embed(PROMPTS))
    torch.testing.assert_close(got, hf_embeddings(path, PROMPTS, "LAST", normalize=True), **TOL)
    assert_engine_idle(llm)


def test_a_pooling_prompt_may_fill_max_model_len(models: dict[str, str]) -> None:
    llm = LLM(models["qwen3"], max_model_len=48, num_gpu_blocks_override=3, max_num_batched_tokens=16)
    prompt = PROMPTS[6][:48]
    got = embeddings(llm.embed([prompt]))  # no room for an output token is needed
    torch.testing.assert_close(got, hf_embeddings(models["qwen3"], [prompt], "LAST", True), **TOL)
    with pytest.raises(ValueError, match="the prompt has 49 tokens, but this model's maximum context length is 48"):
        llm.embed([prompt, prompt + [5]])  # the good one of the batch is rolled back
    with pytest.raises(ValueError, match=r"out of range: ids must be in \[0, "):
        llm.embed([[5, 10**6]])
    with pytest.raises(ValueError, match="empty"):
        llm.embed([[]])
    assert_engine_idle(llm)


def test_dimensions_and_normalize_per_request(models: dict[str, str]) -> None:
    llm = LLM(models["mrl"], kv_cache_memory_bytes=1 << 24)  # no modules.json: LAST, normalized (the defaults)
    assert llm.engine.config.pooler_config.matryoshka_dimensions == [16, 32, 64]
    outs = llm.embed(PROMPTS, PoolingParams(dimensions=16))
    assert all(len(o.outputs.embedding) == 16 for o in outs)  # cut first, then normalized
    torch.testing.assert_close(embeddings(outs), hf_embeddings(models["mrl"], PROMPTS, "LAST", True, 16), **TOL)
    raw = embeddings(llm.embed(PROMPTS, [PoolingParams(normalize=False)] * len(PROMPTS)))
    torch.testing.assert_close(raw, hf_embeddings(models["mrl"], PROMPTS, "LAST", False), **TOL)
    with pytest.raises(ValueError, match="dimensions must be one of 16, 32, 64 for this model"):
        llm.embed(PROMPTS[:1], PoolingParams(dimensions=20))
    with pytest.raises(ValueError, match="dimensions must be a positive integer, got 0"):
        PoolingParams(dimensions=0)
    plain = LLM(models["qwen3"], num_gpu_blocks_override=8)
    with pytest.raises(ValueError, match="dimensions is not supported by this model.*always have 64 dimensions"):
        plain.embed(PROMPTS[:1], PoolingParams(dimensions=16))
    assert_engine_idle(llm)
    assert_engine_idle(plain)


def test_any_length_matryoshka_allows_up_to_hidden_size(tmp_path: Path) -> None:
    path = build_tiny_embedding_model(tmp_path, "qwen3", seed=3, sentence_transformers=False,
                                      matryoshka_dimensions=[])
    llm = LLM(path, num_gpu_blocks_override=16)
    assert len(llm.embed(PROMPTS[:1], PoolingParams(dimensions=7))[0].outputs.embedding) == 7
    with pytest.raises(ValueError, match=r"dimensions must be in \[1, 64\] for this model, got 65"):
        llm.embed(PROMPTS[:1], PoolingParams(dimensions=65))
    assert_engine_idle(llm)


def test_each_runner_refuses_the_other_kind_of_request(models: dict[str, str], tiny_llama: str) -> None:
    pooling = LLM(models["qwen3"], num_gpu_blocks_override=8)
    with pytest.raises(ValueError, match="runner='pooling'.*cannot generate.*--runner generate"):
        pooling.generate(PROMPTS[:2], SamplingParams(max_tokens=2))
    generate = LLM(tiny_llama, num_gpu_blocks_override=8)
    with pytest.raises(ValueError, match="runner='generate'.*cannot make embeddings.*--runner pooling"):
        generate.embed(PROMPTS[:2])
    with pytest.raises(ValueError, match="runner generate needs an LM head, and Qwen3Model has none.*runner pooling"):
        LLM(models["qwen3"], runner="generate", num_gpu_blocks_override=8)
    assert_engine_idle(pooling)
    assert_engine_idle(generate)


def test_abort_mid_prefill_frees_blocks(models: dict[str, str]) -> None:
    llm = LLM(models["qwen3"], kv_cache_memory_bytes=1 << 24, max_num_batched_tokens=8,
              pooler_config={"pooling_type": "MEAN"})
    engine = llm.engine
    engine.add_request("a", PROMPTS[6], PoolingParams())
    engine.add_request("b", PROMPTS[0], PoolingParams())
    assert engine.step() == []  # the first chunk of "a": nothing finishes yet
    assert engine.requests["a"].seqs[0].pooled is not None
    (out,) = engine.abort_request("a")
    assert out.finished and out.outputs.embedding == []
    while engine.has_unfinished_requests():
        engine.step()
    assert_engine_idle(llm)


def core_state(e) -> tuple[list[str], int, int]:
    return list(e.requests), e.block_manager.num_free_blocks, e.block_manager.num_blocks


def test_async_encode_across_the_core_process(models: dict[str, str]) -> None:
    """AsyncLLMEngine.encode with the engine core in its own process: outputs cross the pipe (pickled)."""
    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(
        model=models["llama"], engine_core_process=True, num_gpu_blocks_override=32, max_num_batched_tokens=32))

    async def one(k: int, prompt: list[int]) -> PoolingRequestOutput:
        outs = [o async for o in engine.encode(prompt, PoolingParams(), f"e{k}")]
        assert len(outs) == 1 and outs[0].finished
        return outs[0]

    async def main() -> tuple[list[PoolingRequestOutput], tuple]:
        await engine.wait_until_ready(timeout=120)
        outs = await asyncio.gather(*(one(k, p) for k, p in enumerate(PROMPTS)))
        with pytest.raises(ValueError, match="cannot generate"):
            async for _ in engine.generate(PROMPTS[0], SamplingParams(max_tokens=2), "g"):
                pass
        return outs, await engine.call(core_state)

    try:
        outs, (live, free, total) = asyncio.run(main())
    finally:
        engine.shutdown()
    assert [o.prompt_token_ids for o in outs] == PROMPTS
    torch.testing.assert_close(embeddings(outs), hf_embeddings(models["llama"], PROMPTS, "LAST", True), **TOL)
    assert live == [] and free == total
