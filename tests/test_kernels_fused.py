"""The fused Triton kernels (RMSNorm + residual, rotary, SiLU-and-mul) against their torch twins in
engine/models/layers.py, on the CPU through Triton's interpreter (TRITON_INTERPRET=1 is set before the first
import of kvgate.kernels.triton_fused; see test_kernels_triton.py). bf16 math is wrong in triton 3.6's
interpreter, so fp32 and fp16 are checked here and bf16 on the GPU (benchmarks/match_hf.py).
"""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
from tiny_models import random_prompts  # noqa: E402

from kvgate.engine import LLM, SamplingParams  # noqa: E402
from kvgate.engine.models.layers import RMSNorm, RotaryEmbedding, silu_and_mul, use_fused_ops  # noqa: E402
from kvgate.kernels import triton_fused  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

TOL = {torch.float32: 1e-5, torch.float16: 2e-3}
DTYPES = [torch.float32, torch.float16]


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype
    torch.testing.assert_close(a.float(), b.float(), atol=TOL[dtype], rtol=TOL[dtype])


def norm(dim: int, dtype: torch.dtype) -> RMSNorm:
    m = RMSNorm(dim, 1e-6)
    with torch.no_grad():
        m.weight.copy_(torch.randn(dim) * 0.5 + 1)
    return m.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,dim", [(1, 64), (5, 96), (3, 1024), (70, 96)])  # 70: several programs
def test_rms_norm_with_and_without_residual(dtype: torch.dtype, rows: int, dim: int) -> None:
    torch.manual_seed(rows * dim)
    m = norm(dim, dtype)
    x, res = torch.randn(rows, dim, dtype=dtype), torch.randn(rows, dim, dtype=dtype)
    close(triton_fused.rms_norm(x, m.weight, m.eps), m(x), dtype)
    out, new_res = triton_fused.rms_norm(x, m.weight, m.eps, res)
    want_out, want_res = m(x, res)
    close(out, want_out, dtype)
    close(new_res, want_res, dtype)
    assert torch.equal(res, res.clone()) and new_res.data_ptr() != res.data_ptr()  # the input stays as it was


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_of_strided_head_views(dtype: torch.dtype) -> None:
    """q/k norms run on [tokens, heads, head_dim] views of the fused qkv projection."""
    torch.manual_seed(0)
    tokens, heads, kv_heads, d = 37, 4, 2, 16  # a program (64 head rows) ends inside a token
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, dtype=dtype)
    q = qkv[:, : heads * d].view(tokens, heads, d)
    k = qkv[:, heads * d:(heads + kv_heads) * d].view(tokens, kv_heads, d)
    m = norm(d, dtype)
    for x in (q, k):
        assert not x.is_contiguous()
        close(triton_fused.rms_norm(x, m.weight, m.eps), m(x), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,d", [(4, 2, 16), (3, 1, 64), (8, 8, 32)])
def test_rotary_in_place_on_qkv_views(dtype: torch.dtype, heads: int, kv_heads: int, d: int) -> None:
    torch.manual_seed(heads * d)
    rope = RotaryEmbedding(d, 512, 10000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                             "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    tokens = 9
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, dtype=dtype)
    v_before = qkv[:, (heads + kv_heads) * d:].clone()
    q = qkv[:, : heads * d].view(tokens, heads, d)
    k = qkv[:, heads * d:(heads + kv_heads) * d].view(tokens, kv_heads, d)
    positions = torch.randint(0, 512, (tokens,))
    # the twin rounds cos/sin to the activation dtype; fp32 twin math is the reference
    want_q, want_k = (t.to(dtype) for t in rope(positions, q.float(), k.float()))
    got_q, got_k = triton_fused.rotary(positions, q, k, rope.cos, rope.sin)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()  # rotated in place
    close(got_q, want_q, dtype)
    close(got_k, want_k, dtype)
    assert torch.equal(qkv[:, (heads + kv_heads) * d:], v_before)  # v untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,d", [(4, 2, 16), (3, 1, 64), (16, 8, 128)])
def test_qk_norm_rotary_is_the_norms_then_rotary(dtype: torch.dtype, heads: int, kv_heads: int, d: int) -> None:
    """Qwen3's q/k head norms and the rotary embedding in one kernel, in place on the qkv projection's views: what
    the separate kernels give, and what the torch layers give."""
    torch.manual_seed(heads * d)
    rope = RotaryEmbedding(d, 512, 1e6, None)
    tokens = 7
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, dtype=dtype) * 3
    v_before = qkv[:, (heads + kv_heads) * d:].clone()
    q = qkv[:, : heads * d].view(tokens, heads, d)
    k = qkv[:, heads * d:(heads + kv_heads) * d].view(tokens, kv_heads, d)
    qn, kn = norm(d, dtype), norm(d, dtype)
    positions = torch.randint(0, 512, (tokens,))
    want_q, want_k = (t.to(dtype) for t in rope(positions, qn(q).float(), kn(k).float()))
    sep_q, sep_k = triton_fused.rotary(positions, triton_fused.rms_norm(q, qn.weight, qn.eps),
                                       triton_fused.rms_norm(k, kn.weight, kn.eps), rope.cos, rope.sin)
    got_q, got_k = triton_fused.qk_norm_rotary(positions, q, k, qn.weight, kn.weight, qn.eps, rope.cos, rope.sin)
    assert got_q.data_ptr() == qkv.data_ptr() and got_k.data_ptr() == k.data_ptr()  # in place
    close(got_q, sep_q, dtype)
    close(got_k, sep_k, dtype)
    close(got_q, want_q, dtype)
    close(got_k, want_k, dtype)
    assert torch.equal(qkv[:, (heads + kv_heads) * d:], v_before)  # v untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,inter", [(1, 16), (6, 100), (2, 3000)])
def test_silu_and_mul(dtype: torch.dtype, tokens: int, inter: int) -> None:
    torch.manual_seed(inter)
    x = torch.randn(tokens, 2 * inter, dtype=dtype) * 3
    want = silu_and_mul(x.float()).to(dtype)
    close(triton_fused.silu_and_mul(x), want, dtype)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_engine_with_fused_ops_matches_torch(tiny_model_dirs: dict[str, str], arch: str) -> None:
    """The whole model with the fused kernels (as on the GPU) gives the same greedy tokens as the torch ops."""
    prompts = random_prompts(4, seed=5, min_len=1, max_len=40)
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(tiny_model_dirs[arch], kv_cache_memory_bytes=1 << 24)
            .generate(prompts, sp)]
    llm = LLM(tiny_model_dirs[arch], kv_cache_memory_bytes=1 << 24)
    use_fused_ops(llm.engine.runner.model)
    calls: list[str] = []
    real = {name: getattr(triton_fused, name) for name in ("rms_norm", "qk_norm_rotary", "rotary")}
    for name, fn in real.items():
        setattr(triton_fused, name, lambda *a, name=name, fn=fn, **kw: calls.append(name) or fn(*a, **kw))
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    finally:
        for name, fn in real.items():
            setattr(triton_fused, name, fn)
    assert "rms_norm" in calls, "the fused kernels were not used"
    # Qwen3's q/k norms go with the rotary embedding in one kernel; Llama has no q/k norms
    assert ("qk_norm_rotary" in calls, "rotary" in calls) == ((True, False) if arch == "qwen3" else (False, True))
    assert got == want
