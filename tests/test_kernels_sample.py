"""The fused sampling kernel (kernels/triton_sample.py) against its twin, the sampler's torch path: the same
greedy tokens (first of equal maxima), and draws from the same distribution softmax(logits / T). On the CPU through
Triton's interpreter (TRITON_INTERPRET=1 before the first import of kvgate.kernels.triton_*)."""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

from collections import Counter  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from kvgate.kernels.triton_sample import row_seed, sample  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")


def test_temperature_zero_is_torch_argmax_ties_included() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 1500)  # a vocab that is not a multiple of the 256-wide blocks
    logits[1, 7] = logits[1, 1300] = logits[1].max() + 1  # a tie across blocks: the first wins
    logits[2, 1499] = 50.0  # the last token
    logits[3, :] = -1.0  # every token tied
    got = sample(logits, torch.zeros(6), 3, block=256)
    assert got.tolist() == logits.argmax(dim=-1).tolist() and got[1] == 7 and got[3] == 0


def test_draws_follow_softmax_of_logits_over_temperature() -> None:
    """2,000 rows of the same logits at T = 0.7 (and greedy rows among them): the sampled rows' tokens are spread as
    softmax(l / T) says (total variation under 0.05: about 3x the expected noise at this sample size)."""
    vocab, rows = 12, 2000
    torch.manual_seed(1)
    base = torch.randn(vocab) * 1.5
    logits = base.expand(rows, vocab).contiguous()
    inv_t = torch.full((rows,), 1 / 0.7)
    inv_t[::10] = 0.0  # every tenth row greedy
    seeds = torch.tensor([row_seed(11, 0, i) for i in range(rows)])
    got = sample(logits, inv_t, seeds, block=16)
    assert (got[::10] == base.argmax()).all()
    drawn = [t for i, t in enumerate(got.tolist()) if i % 10]
    counts = Counter(drawn)
    probs = torch.softmax(base / 0.7, dim=0)
    tv = 0.5 * sum(abs(counts.get(j, 0) / len(drawn) - float(probs[j])) for j in range(vocab))
    assert tv < 0.05, tv
    assert len(counts) >= 6  # not collapsed onto a few tokens
    some = slice(0, 100)
    assert sample(logits[some], inv_t[some], seeds[some], block=16).tolist() == got[some].tolist()  # seeds decide
    assert sample(logits[some], inv_t[some], seeds[some] + 1, block=16).tolist() != got[some].tolist()


def test_a_row_draws_from_its_own_seed_whatever_the_batch() -> None:
    """A seeded request's token depends on its row seed alone: the same rows in another order, or a row alone, draw
    the same tokens (the sampler derives the seed from the request's seed, sample index and position)."""
    torch.manual_seed(2)
    logits = torch.randn(8, 700)
    inv_t = torch.full((8,), 1.0)
    seeds = torch.tensor([row_seed(5, i % 2, 40 + i) for i in range(8)])
    got = sample(logits, inv_t, seeds, block=256)
    perm = torch.randperm(8)
    assert sample(logits[perm], inv_t[perm], seeds[perm], block=256).tolist() == got[perm].tolist()
    assert sample(logits[3:4], inv_t[3:4], seeds[3:4], block=256).tolist() == got[3:4].tolist()
    # the same logits in every row with different seeds: not one token everywhere
    flat = torch.zeros(8, 700)
    assert len(set(sample(flat, inv_t, seeds, block=256).tolist())) > 4


def test_row_seeds_differ_by_seed_sample_and_position() -> None:
    grid = [(seed, index, pos) for seed in (0, 1, 7, -3, 2**40) for index in range(3) for pos in range(200)]
    values = [row_seed(*g) for g in grid]
    assert len(set(values)) == len(values)
    assert all(0 <= v < 2**32 for v in values)
    assert row_seed(7, 1, 5) == row_seed(7, 1, 5)


def test_seeded_requests_through_the_engine_with_the_kernel(tiny_model_dirs: dict[str, str]) -> None:
    """The engine's sampler with the kernel (as on CUDA, here through the interpreter): a seeded request's tokens are
    the same alone or in a batch, and with async scheduling or without, even where a guided row's drawn token was
    replaced and its position drawn again (the noise follows the position, not a generator's state)."""
    import json

    import jsonschema
    from tiny_models import assert_engine_idle, random_prompts

    from kvgate.engine import LLM, SamplingParams
    from kvgate.engine.structured_output import StructuredOutputsParams

    schema = {"type": "object", "properties": {"t": {"type": "array", "items": {"type": "string"}, "maxItems": 4}},
              "required": ["t"]}
    guide = StructuredOutputsParams(json=schema)
    params = [SamplingParams(temperature=1.3, seed=i, max_tokens=12 + i % 5, n=1 + i % 2,
                             structured_outputs=guide if i % 3 else None, ignore_eos=not i % 3) for i in range(9)]
    prompts = random_prompts(9, seed=6, max_len=20)
    kw = dict(kv_cache_memory_bytes=1 << 24, max_num_seqs=8, max_num_batched_tokens=64, dtype="float32")

    def run(asynchronous: bool, prompts: list, params: list[SamplingParams]):
        llm = LLM(tiny_model_dirs["llama"], async_scheduling=asynchronous, **kw)
        llm.engine.sampler.fused = True
        outs = llm.generate(prompts, params)
        assert_engine_idle(llm)
        return [[c.token_ids for c in o.outputs] for o in outs], llm.engine.num_rewinds, outs

    # seeded guided rows whose budget-aware finish replaces drawn tokens (with a torch generator per row, the row
    # drawn again after a rewind took the generator's next noise, and async and sync outputs parted)
    schema2 = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}},
               "required": ["a", "b"]}
    guided = [SamplingParams(temperature=1.0, seed=i, max_tokens=40, min_tokens=6 + i,
                             structured_outputs=StructuredOutputsParams(json=schema2)) for i in range(6)]
    prompts2 = random_prompts(6, seed=11, max_len=20)
    assert run(True, prompts2, guided)[0] == run(False, prompts2, guided)[0]

    together, _, outs = run(False, prompts, params)
    assert [run(False, [prompts[i]], [params[i]])[0][0] for i in (0, 4)] == [together[0], together[4]]
    ahead, rewinds, _ = run(True, prompts, params)
    assert ahead == together and rewinds > 0
    assert len({tuple(t) for t in together[1]}) == 2  # n = 2: two samples of their own
    for o, p in zip(outs, params):
        if p.structured_outputs is not None:
            for c in o.outputs:
                jsonschema.validate(json.loads(c.text), schema)


def _bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """bool [rows, vocab] -> xgrammar's int32 bitmask rows, packed as the backend packs its UTF-8 rows."""
    from kvgate.engine.structured_output.backend import _pack

    padded = torch.zeros(allowed.shape[0], -(-allowed.shape[1] // 32) * 32, dtype=torch.bool)
    padded[:, :allowed.shape[1]] = allowed
    return torch.stack([_pack(row.numpy()) for row in padded])


def test_the_grammar_mask_in_the_kernel_is_xgrammars_then_the_kernel() -> None:
    """Guided rows: the kernel masking as it reads equals xgrammar's apply_token_bitmask_inplace followed by the plain
    kernel, token for token (greedy and sampled rows, some rows unmasked, the UTF-8 row and-ed in); no draw takes a
    token the mask forbids."""
    import xgrammar as xgr

    torch.manual_seed(3)
    rows, vocab = 6, 1000  # not a multiple of 32: the last word is partial
    logits = torch.randn(rows, vocab) * 3
    allowed = torch.rand(rows, vocab) < 0.05
    allowed[2] = False
    allowed[2, 999] = True  # one token only, in the partial last word
    allowed[4, 31] = allowed[4, 32] = True  # a sign bit (word 0, bit 31)
    valid = torch.ones(vocab, dtype=torch.bool)
    valid[::7] = False
    valid[999] = valid[31] = valid[32] = True
    bitmask, valid_row = _bitmask(allowed), _bitmask(valid[None])[0]
    inv_t = torch.tensor([0.0, 1.0, 0.5, 0.0, 2.0, 1.0])
    mask_rows = torch.tensor([0, 1, 2, -1, 4, 5], dtype=torch.int32)  # row 3 is not guided
    seeds = torch.tensor([row_seed(9, 0, i) for i in range(rows)])

    got = sample(logits, inv_t, seeds, bitmask=bitmask, mask_rows=mask_rows, valid=valid_row, block=256)
    twin = logits.clone()
    xgr.apply_token_bitmask_inplace(twin, bitmask & valid_row, vocab_size=vocab, indices=[0, 1, 2, 4, 5])
    assert got.tolist() == sample(twin, inv_t, seeds, block=256).tolist()
    ok = allowed & valid
    assert all(bool(ok[r, t]) for r, t in enumerate(got.tolist()) if r != 3)
    assert got[2] == 999 and got[3] == logits[3].argmax()
    # every row masked (mask_rows None: row r reads bitmask row r), no UTF-8 row
    all_rows = sample(logits, inv_t, seeds, bitmask=bitmask, block=256)
    twin = logits.clone()
    xgr.apply_token_bitmask_inplace(twin, bitmask, vocab_size=vocab)
    assert all_rows.tolist() == sample(twin, inv_t, seeds, block=256).tolist()
    assert all(bool(allowed[r, t]) for r, t in enumerate(all_rows.tolist()))


def test_guided_rows_masked_in_the_kernel_through_the_engine(tiny_model_dirs: dict[str, str],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's guided steps with the kernel masking as it reads (GrammarStep.apply, the torch path's mask, is
    never called): greedy guided rows give the torch path's tokens, sampled ones schema-valid documents, mixed with
    unguided rows (mask_rows) and with penalties (the mask after them)."""
    import json

    import jsonschema
    from tiny_models import assert_engine_idle, random_prompts

    from kvgate.engine import LLM, SamplingParams
    from kvgate.engine.structured_output import StructuredOutputsParams
    from kvgate.engine.structured_output.manager import GrammarStep

    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 3, "maximum": 90},
                                               "t": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
              "required": ["n", "t"]}
    guide = StructuredOutputsParams(json=schema)
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.2, seed=i, max_tokens=30, ignore_eos=i % 4 == 3,
                             structured_outputs=guide if i % 4 != 3 else None,
                             frequency_penalty=0.5 if i % 3 == 0 else 0.0) for i in range(12)]
    prompts = random_prompts(12, seed=4, max_len=20)
    llm = LLM(tiny_model_dirs["llama"], kv_cache_memory_bytes=1 << 24, max_num_seqs=16, dtype="float32")
    applied = []
    apply = GrammarStep.apply
    monkeypatch.setattr(GrammarStep, "apply", lambda self, logits: applied.append(1) or apply(self, logits))
    torch_path = [o.outputs[0] for o in llm.generate(prompts, params)]
    assert applied
    applied.clear()
    llm.engine.sampler.fused = True
    kernel_path = [o.outputs[0] for o in llm.generate(prompts, params)]
    assert not applied
    assert_engine_idle(llm)
    for i, (a, b) in enumerate(zip(torch_path, kernel_path)):
        if params[i].structured_outputs is not None:
            jsonschema.validate(json.loads(b.text), schema)
        if params[i].temperature == 0.0:
            assert a.token_ids == b.token_ids, i
