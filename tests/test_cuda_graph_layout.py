"""The padded step layouts that the CUDA graphs replay (engine/cuda_graph.py), run eagerly on the CPU (StepGraphs with
capture=False; the Triton kernels in the interpreter): a decode step in a bucket of more rows, a mixed step with its
decodes in rows [0, D), padding, its prompt chunks from row D on and absent prompt sequences. The greedy tokens equal
those of the torch backend without graphs, through chunked prefill, prefix hits and async scheduling; every kind of
bucket and the eager fallback are met.

Small buckets (monkeypatched) make the tiny prompts meet every case: decodes padded, prompt tokens padded, steps too
large for any bucket (run eagerly). Capturing and replaying the graphs themselves needs a GPU
(tests/test_cuda_graphs.py).
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # the kernels run in Triton's interpreter here (set before their first import)
    os.environ["TRITON_INTERPRET"] = "1"

import collections  # noqa: E402

import pytest  # noqa: E402
from tiny_models import assert_engine_idle, random_prompts  # noqa: E402

from kvgate.engine import LLM, SamplingParams  # noqa: E402
from kvgate.engine import cuda_graph  # noqa: E402
from kvgate.kernels.triton_attention import triton_attention_backend  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

BASE = random_prompts(1, seed=21, min_len=36, max_len=36)[0]
PROMPTS = [BASE[:k] + p for k, p in zip((0, 36, 17, 0, 36), random_prompts(5, seed=22, min_len=1, max_len=28))]
SP = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
KW = dict(kv_cache_memory_bytes=1 << 24, max_num_seqs=8, max_num_batched_tokens=24, dtype="float32")


def greedy(llm: LLM) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, SP)]


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_padded_layouts_give_the_eager_tokens(tiny_model_dirs: dict[str, str], asynchronous: bool,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cuda_graph, "PROMPT_TOKENS", (8, 16))
    monkeypatch.setattr(cuda_graph, "MIXED_DECODES", (2,))
    monkeypatch.setattr(cuda_graph, "MAX_PREFILL_SEQS", 2)
    model = tiny_model_dirs["qwen3"]
    want = greedy(LLM(model, attention_backend="torch", **KW))

    llm = LLM(model, attention_backend="triton", async_scheduling=asynchronous, enforce_eager=True, **KW)
    runner = llm.engine.runner
    assert runner.attention_fn is triton_attention_backend and runner.graphs is None
    graphs = runner.graphs = runner.step_graphs(mixed=True, capture=False)
    graphs.capture()
    assert graphs.sizes == [1, 2, 4, 8] and graphs.mixed == [(d, t) for d in (0, 2, 8) for t in (8, 16)]
    used: collections.Counter = collections.Counter()
    bucket = graphs.bucket

    def counting(md, num_tokens):
        b = bucket(md, num_tokens)
        used["eager" if b is None else "decode" if b[1] == 0 else "mixed"] += 1
        if b is not None and (b[0] > md.num_decodes or b[1] > num_tokens - md.num_decodes):
            used["padded"] += 1
        return b

    graphs.bucket = counting
    assert greedy(llm) == want
    hits = llm.engine.block_manager.prefix_cache_hits
    assert greedy(llm) == want  # again: the shared prefixes' blocks come from the prefix cache
    assert llm.engine.block_manager.prefix_cache_hits > hits
    assert_engine_idle(llm)
    assert used["decode"] and used["mixed"] and used["eager"] and used["padded"], used


def test_bucket_choice() -> None:
    """The smallest bucket that holds the step: decode steps by rows, mixed steps by decode rows then prompt tokens;
    too many prompts or tokens: none (eager)."""
    from types import SimpleNamespace

    graphs = cuda_graph.StepGraphs(torch.nn.Identity(), None, 256, 4096, 16, 8, torch.float32, torch.device("cpu"),
                                   lambda n: 256, max_num_batched_tokens=8192, capture=False)
    md = lambda decodes, seqs: SimpleNamespace(num_decodes=decodes, num_seqs=seqs)  # noqa: E731
    assert graphs.bucket(md(3, 3), 3) == (4, 0)
    assert graphs.bucket(md(200, 200), 200) == (208, 0)
    assert graphs.bucket(md(256, 256), 256) == (256, 0)
    assert graphs.bucket(md(0, 1), 100) == (0, 128)
    assert graphs.bucket(md(200, 202), 200 + 256) == (256, 256)
    assert graphs.bucket(md(17, 19), 17 + 129) == (32, 256)
    assert graphs.bucket(md(1, 2), 1 + 2049) == (16, 4096)
    assert graphs.bucket(md(150, 200), 8192) == (256, 8192)  # a burst of 50 prompts next to running requests
    small_budget = cuda_graph.StepGraphs(torch.nn.Identity(), None, 256, 4096, 16, 8, torch.float32,
                                         torch.device("cpu"), lambda n: 256, max_num_batched_tokens=3000,
                                         capture=False)
    assert small_budget.bucket(md(1, 2), 1 + 2049) is None  # a prompt chunk above the largest bucket in the budget
    assert graphs.bucket(md(1, 1 + cuda_graph.MAX_PREFILL_SEQS + 1), 40) is None  # too many prompts
    decode_only = cuda_graph.StepGraphs(torch.nn.Identity(), None, 256, 4096, 16, 8, torch.float32,
                                        torch.device("cpu"), lambda n: 256, capture=False)
    assert decode_only.mixed == [] and decode_only.bucket(md(1, 2), 30) is None


def test_mixed_layout_buffers() -> None:
    """What a mixed step's graph reads: decodes in rows [0, D), padding rows storing nothing, prompt tokens from row D
    on, absent prompt sequences with no tokens, and the logits rows moved with them; a smaller step after a larger
    one in the same bucket leaves no stale slot behind."""
    from kvgate.engine.forward_context import get_forward_context
    from kvgate.kernels.metadata import AttentionMetadata

    class Probe(torch.nn.Module):
        def forward(self, ids, positions, inputs):
            md = get_forward_context().attn_metadata
            self.seen = {k: getattr(md, k).clone() for k in ("slot_mapping", "query_start_loc", "seq_lens")}
            self.seen["num_decodes"], self.seen["ids"] = md.num_decodes, ids.clone()
            return ids[:, None].float().expand(-1, 8)

    probe = Probe()
    graphs = cuda_graph.StepGraphs(probe, None, 64, 1024, 16, 8, torch.float32, torch.device("cpu"), lambda n: 256,
                                   max_num_batched_tokens=512, capture=False)
    graphs.capture()

    def step(decode_lens: list[int], prompt_lens: list[int]):
        q_lens = [1] * len(decode_lens) + prompt_lens
        n = sum(q_lens)
        starts = [0]
        for k in q_lens:
            starts.append(starts[-1] + k)
        md = AttentionMetadata(
            slot_mapping=torch.arange(100, 100 + n), query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor(decode_lens + [k + 3 for k in prompt_lens], dtype=torch.int32),
            block_tables=torch.ones((len(q_lens), 2), dtype=torch.int32), num_decodes=len(decode_lens),
            max_query_len=max(q_lens), max_seq_len=64, block_size=16)
        ids = torch.arange(1000, 1000 + n)
        rows = [s - 1 for s in starts[1:]]
        bucket = graphs.bucket(md, n)
        hidden, rows = graphs.run(bucket, ids, ids, md, rows)
        return bucket, hidden, rows, probe.seen

    step([9] * 10, [40, 60])  # a larger step first: its slots must not stay behind
    bucket, hidden, rows, seen = step([5, 6, 7], [4, 6])
    assert bucket == (16, 128) and seen["num_decodes"] == 16
    slots = seen["slot_mapping"].tolist()
    assert slots[:3] == [100, 101, 102] and slots[3:16] == [-1] * 13
    assert slots[16:26] == list(range(103, 113)) and slots[26:144] == [-1] * 118
    qsl = seen["query_start_loc"].tolist()
    assert qsl[16:19] == [16, 20, 26] and qsl[19:] == [26] * (cuda_graph.MAX_PREFILL_SEQS - 2)
    assert seen["seq_lens"].tolist()[:18] == [5, 6, 7] + [1] * 13 + [7, 9]
    assert rows == [0, 1, 2, 19, 25] and hidden[rows, 0].tolist() == [1000, 1001, 1002, 1006, 1012]
