"""The disk tier below the CPU offload tier (engine/kv_offload/disk.py): a block's round trip device -> CPU -> disk
-> device is bit-exact; greedy tokens are the same with it when the working set is many times the device pool and
the CPU tier; a fresh engine on the same directory serves a prefix from disk (and a restarted `kvgate serve`
reports it as cached tokens); a corrupt file is deleted and the block recomputed; a disk that fails its writes
leaves the CPU tier working; bad settings are refused at start."""
from __future__ import annotations

import glob
import json
import re
import os
import subprocess
import sys
import tempfile

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgate.engine import LLM, SamplingParams
from kvgate.engine.arg_utils import ArgError, EngineArgs
from kvgate.engine.config import EngineConfig
from kvgate.engine.kv_offload import DELETE, FETCH, LOAD, SAVE, SPILL, OffloadStore, OffloadTier
from kvgate.engine.kv_offload.disk import HEADER, decode
from kvgate.engine.memory_monitor import MemoryMonitor
from tiny_models import assert_engine_idle

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def fetched(store: OffloadStore, tier: OffloadTier) -> None:
    """Until rank 0's reads are done, then let the tier take them in."""
    store.disk.flush()  # type: ignore[union-attr]
    tier.poll()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_block_round_trip_device_cpu_disk_device_is_bit_exact(dtype: torch.dtype, tmp_path) -> None:
    kv = torch.randn(3, 2, 8, 4, 2, 16).to(dtype)
    store = OffloadStore(kv, num_slots=1, disk_dir=str(tmp_path))
    tier = OffloadTier(1, "lru", disk_blocks=4, fetch_result=store.disk.poll)
    original = kv[:, :, 3].clone()
    tier.save(b"a" * 32, (1, 2), 3)
    tier.save(b"b" * 32, (3, 4), 5)  # the one slot goes to b: a is spilled to disk first
    ops = tier.take_ops()
    assert ops == [(SAVE, 3, 0), (SPILL, 0, b"a" * 32), (SAVE, 5, 0)]
    store.apply(ops)
    store.disk.flush()
    assert os.listdir(tmp_path) == [(b"a" * 32).hex() + ".kv"]
    kv[:, :, 3] = torch.randn_like(original)
    assert tier.on_disk(b"a" * 32) and not tier.holds(b"a" * 32, (1, 2))
    assert tier.fetch(b"a" * 32, (1, 2))  # into the slot b held: b goes to disk
    ops = tier.take_ops()
    assert ops == [(SPILL, 0, b"b" * 32), (FETCH, 0, b"a" * 32)]
    store.apply(ops)
    fetched(store, tier)
    assert tier.holds(b"a" * 32, (1, 2)) and not tier.fetching and tier.stats.fetched_blocks == 1
    tier.load(b"a" * 32, 6)
    store.apply(tier.take_ops())
    assert torch.equal(kv[:, :, 6].view(torch.uint8), original.view(torch.uint8))


def test_a_full_disk_index_deletes_the_files_it_drops(tmp_path) -> None:
    kv = torch.randn(1, 2, 8, 4, 1, 4)
    store = OffloadStore(kv, num_slots=1, disk_dir=str(tmp_path))
    tier = OffloadTier(1, "lru", disk_blocks=2, fetch_result=store.disk.poll)
    for i in range(5):  # each save spills the previous block; the disk keeps the last two
        tier.save(bytes([i]) * 32, (i,), i)
    ops = tier.take_ops()
    assert [op[0] for op in ops].count(SPILL) == 4 and [op for op in ops if op[0] == DELETE] == [
        (DELETE, 0, bytes([0]) * 32), (DELETE, 0, bytes([1]) * 32)]
    store.apply(ops)
    store.disk.flush()
    assert sorted(os.listdir(tmp_path)) == sorted(bytes([i]).hex() * 32 + ".kv" for i in (2, 3))
    assert OffloadTier(1, "lru", disk_blocks=2, on_disk=store.disk.scan()).on_disk(bytes([3]) * 32)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([SAVE, LOAD, SPILL, FETCH, DELETE]), st.integers(0, 4), st.integers(0, 3)),
                max_size=30))
def test_disk_ops_mixed_with_copies_end_as_running_them_one_by_one(ops: list[tuple[int, int, int]]) -> None:
    """Spills, fetches and deletes batched with the copies (disk ops first in each phase, reads and writes on the
    disk's thread) end as running every op in order would; a fetch is of a file that exists then (the engine only
    fetches what its index says is on disk)."""
    kv = torch.randn(2, 2, 5, 4, 1, 4)
    store = OffloadStore(kv.clone(), num_slots=4, disk_dir=tempfile.mkdtemp())
    store.slots.copy_(torch.randn_like(store.slots))
    want_kv, want_slots, files = kv.clone(), store.slots.clone(), {}
    real = []
    for kind, a, b in ops:
        key = bytes([b]) * 32
        if kind == SAVE:
            want_slots[b % 4] = want_kv[:, :, a]
            real.append((SAVE, a, b % 4))
        elif kind == LOAD:
            want_kv[:, :, a] = want_slots[b % 4]
            real.append((LOAD, a, b % 4))
        elif kind == SPILL:
            files[key] = want_slots[a % 4].clone()
            real.append((SPILL, a % 4, key))
        elif kind == FETCH and key in files:
            want_slots[a % 4] = files[key]
            real.append((FETCH, a % 4, key))
        elif kind == DELETE:
            files.pop(key, None)
            real.append((DELETE, 0, key))
    store.apply(real)
    store.disk.flush()
    assert torch.equal(store.kv_cache, want_kv) and torch.equal(store.slots, want_slots)
    assert sorted(os.listdir(store.disk_dir)) == sorted(k.hex() + ".kv" for k in files)


def documents(n: int, length: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 500, (length,), generator=g).tolist() for _ in range(n)]


DOCS = documents(6, 192)  # 12 blocks each, 72 in all
# then the third last document once more: the CPU tier holds it (the device the last two)
ROUNDS = [[d + [7, 8, 9] for d in DOCS], [d + [10, 11] for d in DOCS], [DOCS[3] + [12, 13]]]
# the device holds 24 blocks and the CPU tier 0.0002 GiB 26 (of 8 KiB in float32, on a GPU too): about 2
# documents each; the disk holds them all
TIERS = dict(num_gpu_blocks_override=24, max_num_seqs=1, dtype="float32")


def run_rounds(llm: LLM, rounds: list[list[list[int]]]) -> list[list[list[int]]]:
    return [[o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in r], GREEDY)]
            for r in rounds]


@pytest.fixture(scope="module")
def plain_tokens(tiny_llama: str) -> list[list[list[int]]]:
    llm = LLM(tiny_llama, **TIERS)
    try:
        return run_rounds(llm, ROUNDS)
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("tp,asynchronous", [(1, False), (1, True), (2, False)])
def test_greedy_tokens_are_the_same_with_the_disk_tier_and_a_fresh_engine_reads_its_files(
        tiny_llama: str, plain_tokens, tmp_path, tp: int, asynchronous: bool) -> None:
    """The second round's documents come back from disk (the device and the CPU tier hold a third of them): the
    same tokens as without any tier. Then a new engine on the same directory (another process's restart) finds the
    documents' blocks on disk at once; with TP=2 each rank reads its own files."""
    disk = dict(kv_offloading_size=0.0002, kv_offloading_disk_dir=str(tmp_path), kv_offloading_disk_size=0.1,
                async_scheduling=asynchronous)
    llm = LLM(tiny_llama, tensor_parallel_size=tp, **TIERS, **disk)
    try:
        assert run_rounds(llm, ROUNDS) == plain_tokens
        st = llm.engine.block_manager.offload.stats
        assert st.spilled_blocks > 30 and st.fetched_blocks > 20 and st.failed_fetches == 0
        stats = MemoryMonitor(llm.engine).get_stats()
        assert stats["offload_disk_blocks"] > 30 and 0 < stats["offload_disk_used"] <= stats["offload_disk_capacity"]
        # (how many prompt tokens the disk serves depends on how its reads and the steps interleave: 13-27% seen)
        assert stats["offload_disk_hit_rate"] == st.disk_hits / st.disk_queries > 0.05
        assert_engine_idle(llm)
    finally:
        llm.engine.shutdown()
    for rank in range(tp):
        assert len(glob.glob(str(tmp_path / "*" / f"rank{rank}" / "*.kv"))) > 30
    again = LLM(tiny_llama, tensor_parallel_size=tp, **TIERS, **disk)
    try:
        outs = again.generate([{"prompt_token_ids": ROUNDS[1][0]}], GREEDY)
        assert outs[0].outputs[0].token_ids == plain_tokens[1][0]
        assert outs[0].num_cached_tokens == 192  # every full block of the document, read from disk
        assert again.engine.block_manager.offload.stats.fetched_blocks == 12
    finally:
        again.engine.shutdown()


def test_at_start_the_disk_tier_keeps_only_blocks_every_rank_has_a_file_of(tiny_llama: str, plain_tokens,
                                                                           tmp_path) -> None:
    """TP=2: rank 1 lost a file (a failed write, a partial copy) and holds a stray one. A block some rank cannot read
    back is of no use: at start each rank deletes its files of such blocks, and the rest is served as before."""
    disk = dict(kv_offloading_size=0.0002, kv_offloading_disk_dir=str(tmp_path), kv_offloading_disk_size=0.1)
    llm = LLM(tiny_llama, tensor_parallel_size=2, **TIERS, **disk)
    try:
        run_rounds(llm, ROUNDS[:1])
    finally:
        llm.engine.shutdown()

    def names(rank: int) -> set[str]:
        return {os.path.basename(f) for f in glob.glob(str(tmp_path / "*" / f"rank{rank}" / "*.kv"))}

    assert names(0) == names(1) and len(names(1)) > 10
    lost = sorted(glob.glob(str(tmp_path / "*" / "rank1" / "*.kv")), key=os.path.getmtime)[-1]
    os.unlink(lost)
    stray = os.path.join(os.path.dirname(lost), "ab" * 32 + ".kv")
    with open(stray, "wb") as f:
        f.write(b"not a block")
    before = names(0)
    again = LLM(tiny_llama, tensor_parallel_size=2, **TIERS, **disk)
    try:
        assert names(0) == before - {os.path.basename(lost)}  # rank 0's file of the block rank 1 lost is gone
        assert len(again.engine.block_manager.offload.disk) == len(before) - 1
        outs = again.generate([{"prompt_token_ids": p} for p in ROUNDS[0]], GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == plain_tokens[0]
        # rank 1 deleted the stray file at start too (by its first step at the latest)
        assert "ab" * 32 + ".kv" not in names(1)
    finally:
        again.engine.shutdown()


@pytest.mark.parametrize("tp,rank", [(1, 0), (2, 1)])
def test_a_corrupt_file_is_deleted_and_its_block_recomputed(tiny_llama: str, plain_tokens, tmp_path, tp: int,
                                                            rank: int) -> None:
    """Two of a rank's files damaged (a byte flipped, a file cut short): the blocks are recomputed and the files
    deleted. With TP=2 the damage is on rank 1 alone, whose reads the ranks confirm before anyone loads the block
    (before, rank 1 stopped at the load, and the engine with it)."""
    disk = dict(kv_offloading_size=0.0002, kv_offloading_disk_dir=str(tmp_path), kv_offloading_disk_size=0.1)
    llm = LLM(tiny_llama, tensor_parallel_size=tp, **TIERS, **disk)
    try:
        run_rounds(llm, ROUNDS[:1])
    finally:
        llm.engine.shutdown()
    files = sorted(glob.glob(str(tmp_path / "*" / f"rank{rank}" / "*.kv")), key=os.path.getmtime)
    victim = files[0]  # the oldest file: a block of the first document
    with open(victim, "r+b") as f:  # one byte of the payload flipped
        f.seek(-5, os.SEEK_END)
        byte = f.read(1)
        f.seek(-5, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))
    torn = files[1]
    with open(torn, "r+b") as f:  # a torn file: cut short
        f.truncate(100)
    bad_victim, bad_torn = (open(p, "rb").read() for p in (victim, torn))
    again = LLM(tiny_llama, tensor_parallel_size=tp, **TIERS, **disk)
    try:
        assert run_rounds(again, ROUNDS[1:]) == plain_tokens[1:]
        st = again.engine.block_manager.offload.stats
        assert st.failed_fetches >= 1 and st.fetched_blocks > 0
        for path, bad in ((victim, bad_victim), (torn, bad_torn)):  # deleted (maybe written again since: intact)
            if os.path.exists(path):
                with open(path, "rb") as f:
                    data = f.read()
                key = bytes.fromhex(os.path.basename(path)[:-3])
                assert data != bad and decode(key, data, len(data) - HEADER.size) is not None
        assert_engine_idle(again)
    finally:
        again.engine.shutdown()


FAILING_DISK = """
import json, resource, signal, sys
sys.path.insert(0, {tests!r})
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as a full disk's does
resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))
from kvgate.engine import LLM, SamplingParams
llm = LLM({model!r}, num_gpu_blocks_override=24, max_num_seqs=1, dtype="float32", kv_offloading_size=0.0002,
          kv_offloading_disk_dir={disk!r}, kv_offloading_disk_size=0.1)
sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
rounds = json.loads(sys.stdin.read())
outs = [[o.outputs[0].token_ids for o in llm.generate([{{"prompt_token_ids": p}} for p in r], sp)] for r in rounds]
st = llm.engine.block_manager.offload.stats
print(json.dumps({{"outs": outs, "broken": llm.engine.runner.offload.disk.broken, "fetched": st.fetched_blocks,
                  "hits": st.hits}}))
llm.engine.shutdown()
"""


def test_a_disk_that_fails_its_writes_leaves_the_cpu_tier_working(tiny_llama: str, plain_tokens, tmp_path) -> None:
    """Writes fail (a file-size limit makes every block file's write fail with EFBIG, as a full disk fails them
    with ENOSPC): a warning, the disk tier off, and the tokens unchanged, the CPU tier still serving hits."""
    code = FAILING_DISK.format(tests=os.path.dirname(__file__), model=tiny_llama, disk=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", code], input=json.dumps(ROUNDS), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["outs"] == plain_tokens and got["broken"] and got["fetched"] == 0 and got["hits"] > 0
    assert "the KV disk tier" in r.stderr and "failed to write a block" in r.stderr and "File too large" in r.stderr
    assert glob.glob(str(tmp_path / "*" / "rank0" / "*")) == []  # no torn file left behind


def test_bad_disk_tier_settings_are_refused_before_anything_loads(tiny_llama: str, tmp_path) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    cases = [
        (dict(kv_offloading_size=0.01, kv_offloading_disk_dir=str(a_file), kv_offloading_disk_size=1),
         "kv_offloading_disk_dir must be a directory that can be made or written, got .*a-file"),
        (dict(kv_offloading_disk_dir=str(tmp_path), kv_offloading_disk_size=1),
         "kv_offloading_disk_dir needs kv_offloading_size > 0"),
        (dict(kv_offloading_size=0.01, kv_offloading_disk_size=1), "kv_offloading_disk_size needs kv_offloading_disk_dir"),
        (dict(kv_offloading_size=0.01, kv_offloading_disk_dir=str(tmp_path), kv_offloading_disk_size=1e-9),
         "kv_offloading_disk_size must hold at least one KV block"),
        (dict(kv_offloading_size=0.01, kv_offloading_disk_dir=str(tmp_path), kv_offloading_disk_size=-1),
         "kv_offloading_disk_size must be >= 0"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ArgError, match=message):
            EngineConfig.from_args(EngineArgs(model=tiny_llama, **kwargs))
    r = subprocess.run([sys.executable, "-m", "kvgate.gateway.cli", "serve", "--model", tiny_llama,
                        "--kv-offloading-size", "0.01", "--kv-offloading-disk-dir", str(a_file),
                        "--kv-offloading-disk-size", "1"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "kv_offloading_disk_dir must be a directory" in r.stderr


def test_a_restarted_server_reports_a_prefix_from_disk_as_cached_tokens(tiny_llama: str, tmp_path) -> None:
    """`kvgate serve` with a disk tier: a first turn, then other traffic that pushes its blocks through the device
    and the CPU tier to disk; the server stops (its files stay) and a new one starts on the directory: the same
    turn's usage reports its full blocks as cached tokens, and the disk tier's hit metric agrees."""
    import httpx
    import openai

    from serve_helpers import free_port, serve

    g = torch.Generator().manual_seed(2)
    words = " ".join(f"w{int(i)}" for i in torch.randint(0, 400, (40,), generator=g))
    turn = [{"role": "system", "content": f"Answer from this document: {words}"},
            {"role": "user", "content": "What is the first word?"}]
    flags = ["--served-model-name", "tiny", "--dtype", "float32", "--num-gpu-blocks-override", "24",
             "--max-num-seqs", "1", "--kv-offloading-size", "0.0002", "--kv-offloading-disk-dir", str(tmp_path / "kv"),
             "--kv-offloading-disk-size", "0.1"]
    chat = dict(model="tiny", max_tokens=4, temperature=0)
    answers = []
    for run in ("first", "restarted"):
        port = free_port()
        with serve([tiny_llama, "--port", str(port), *flags], tmp_path / f"serve-{run}.log", port) as (base, _):
            client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
            r = client.chat.completions.create(messages=turn, **chat)
            answers.append(r.choices[0].message.content)
            metrics = httpx.get(f"{base}/metrics", timeout=10).text
            disk_hits = float(re.search(r'^kvgate:kv_offload_disk_hits_total\{model_name="tiny"\} (\S+)$', metrics,
                                        re.M).group(1))
            if run == "first":
                assert r.usage.prompt_tokens_details.cached_tokens == 0 and disk_hits == 0
                for k in range(3):  # other documents: the turn's blocks leave the device, then the CPU tier
                    client.completions.create(model="tiny", prompt=[(k * 37 + j) % 500 for j in range(300)],
                                              max_tokens=2)
            else:
                full = (r.usage.prompt_tokens - 1) // 16 * 16
                assert full > 100 and r.usage.prompt_tokens_details.cached_tokens == full and disk_hits == full
    assert answers[0] == answers[1]
