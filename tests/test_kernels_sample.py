"""The fused sampling kernel (kernels/triton_sample.py) against its twin, the sampler's torch path: the same
greedy tokens (first of equal maxima), and draws from the same distribution softmax(logits / T). On the CPU through
Triton's interpreter (TRITON_INTERPRET=1 before the first import of kvgate.kernels.triton_*)."""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

from collections import Counter  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from kvgate.kernels.triton_sample import sample  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")


def test_temperature_zero_is_torch_argmax_ties_included() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 1500)  # a vocab that is not a multiple of the 256-wide blocks
    logits[1, 7] = logits[1, 1300] = logits[1].max() + 1  # a tie across blocks: the first wins
    logits[2, 1499] = 50.0  # the last token
    logits[3, :] = -1.0  # every token tied
    got = sample(logits, torch.zeros(6), seed=3, block=256)
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
    got = sample(logits, inv_t, seed=11, block=16)
    assert (got[::10] == base.argmax()).all()
    drawn = [t for i, t in enumerate(got.tolist()) if i % 10]
    counts = Counter(drawn)
    probs = torch.softmax(base / 0.7, dim=0)
    tv = 0.5 * sum(abs(counts.get(j, 0) / len(drawn) - float(probs[j])) for j in range(vocab))
    assert tv < 0.05, tv
    assert len(counts) >= 6  # not collapsed onto a few tokens
    some = slice(0, 100)
    assert sample(logits[some], inv_t[some], seed=11, block=16).tolist() == got[some].tolist()  # the seed decides
    assert sample(logits[some], inv_t[some], seed=12, block=16).tolist() != got[some].tolist()
