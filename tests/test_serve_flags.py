"""`kvgate serve` takes vLLM's flag for every engine argument and they reach the engine (read back from the
engine's own config in /metrics); sampling defaults come from the model's generation_config.json; values the
engine cannot serve are refused with exit status 2 before anything loads."""
from __future__ import annotations

import importlib.metadata
import json
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import openai
import pytest

from serve_helpers import CLI, free_port, metric_labels, serve
from tiny_models import build_tiny_embedding_model

from kvgate.engine import LLM, SamplingParams
from kvgate.gateway.cli import ENGINE_FLAGS, build_parser, main
from kvgate.gateway.server import GatewayServer

README = Path(__file__).resolve().parents[1] / "README.md"

# every engine argument: the flags that set it on `kvgate serve`, and the value the engine then reports
FLAGS: dict[str, tuple[list[str], str]] = {
    "load_format": (["--load-format", "safetensors"], "safetensors"),
    "dtype": (["--dtype", "float32"], "float32"),
    "seed": (["--seed", "3"], "3"),
    "device": (["--device", "cpu"], "cpu"),
    "max_model_len": (["--max-model-len", "300"], "300"),
    "block_size": (["--block-size", "32"], "32"),
    "enable_prefix_caching": (["--no-enable-prefix-caching"], "False"),
    "gpu_memory_utilization": (["--gpu-memory-utilization", "0.5"], "0.5"),
    "kv_cache_memory_bytes": (["--kv-cache-memory-bytes", "3000000"], "3000000"),
    "num_gpu_blocks_override": (["--num-gpu-blocks-override", "40"], "40"),
    "kv_cache_dtype": (["--kv-cache-dtype", "float32"], "float32"),
    "kv_offloading_size": (["--kv-offloading-size", "0.01"], "0.01"),
    "kv_offloading_eviction": (["--kv-offloading-eviction", "lru"], "lru"),
    "max_num_seqs": (["--max-num-seqs", "7"], "7"),
    "max_num_batched_tokens": (["--max-num-batched-tokens", "333"], "333"),
    "enable_chunked_prefill": (["--no-enable-chunked-prefill"], "False"),
    "enable_preemption": (["--no-enable-preemption"], "False"),
    "scheduler_delay": (["--scheduler-delay", "0.01"], "0.01"),
    "priority_aging_rate": (["--priority-aging-rate", "3"], "3.0"),
    "max_logprobs": (["--max-logprobs", "5"], "5"),
    "attention_backend": (["--attention-backend", "torch"], "torch"),
    "tensor_parallel_size": (["--tensor-parallel-size", "1"], "1"),
    "pipeline_parallel_size": (["--pipeline-parallel-size", "1"], "1"),
    "distributed_executor_backend": (["--distributed-executor-backend", "mp"], "mp"),
    "enforce_eager": (["--enforce-eager"], "True"),
    "async_scheduling": (["--async-scheduling"], "True"),
    "engine_core_process": (["--engine-core-process"], "True"),
    "on_engine_core_death": (["--on-engine-core-death", "exit"], "exit"),
    "max_engine_core_restarts": (["--max-engine-core-restarts", "5"], "5"),
    "served_model_name": (["--served-model-name", "tiny"], "tiny"),
    "runner": (["--runner", "generate"], "generate"),
    "generation_config": (["--generation-config", "vllm"], "vllm"),
    "max_tokens_default": (["--max-tokens-default", "9"], "9"),
    "stream_interval": (["--stream-interval", "3"], "3"),
    "enable_auto_tool_choice": (["--enable-auto-tool-choice"], "True"),
    "tool_call_parser": (["--tool-call-parser", "hermes"], "hermes"),
    "reasoning_parser": (["--reasoning-parser", "qwen3"], "qwen3"),
}
NOT_IN_THIS_RUN = {  # arguments the run above cannot also set, each covered elsewhere
    "model": "the positional MODEL sets it (this test)",
    "tokenizer": "test_tiny_models / test_gguf load tokenizers from elsewhere",
    "max_batch_size": "an alias of max_num_seqs (test_config)",
    "skip_tokenizer_init": "a chat server needs its tokenizer (test_engine_random)",
    "pooler_config": "for embedding models (test_embeddings)",
    "kv_offloading_disk_dir": "a directory of its own: test_kv_offload_disk passes it to kvgate serve",
    "kv_offloading_disk_size": "with kv_offloading_disk_dir (test_kv_offload_disk)",
}


def readme_engine_arguments() -> list[str]:
    """The argument names in the README's engine-argument table (first column, in backticks)."""
    text = README.read_text()
    table = text[text.index("### Engine arguments"):]
    table = table[:table.index("\n\n", table.index("|"))]
    return [name for line in table.splitlines()[2:] for name in re.findall(r"`(\w+)`", line.split("|")[1])]


def test_every_engine_argument_has_a_serve_flag_and_the_readme_lists_it() -> None:
    assert set(FLAGS) | set(NOT_IN_THIS_RUN) == set(ENGINE_FLAGS)  # a new argument needs a line in this test
    assert set(readme_engine_arguments()) == set(ENGINE_FLAGS)
    serve_help = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()  # type: ignore
    for name, (spec, typ, _, _) in ENGINE_FLAGS.items():
        flag = "--" + name.replace("_", "-")
        assert flag in serve_help, flag
        if typ is bool:
            assert "--no-" + name.replace("_", "-") in serve_help
    assert "--dtype {auto,float32,float,bfloat16,float16,half}" in serve_help  # choices are shown
    assert "--block-size {16,32,64}" in serve_help and "--runner {auto,generate,pooling}" in serve_help


def test_every_flag_reaches_the_engine(tmp_path: Path, tiny_model_dirs: dict[str, str]) -> None:
    """One `kvgate serve MODEL` with a flag for every engine argument; the engine core runs in its own process,
    and /metrics reports the config that process built."""
    port = free_port()
    args = [tiny_model_dirs["qwen3"], "--port", str(port)] + [a for flags, _ in FLAGS.values() for a in flags]
    with serve(args, tmp_path / "serve.log", port) as (base, _):
        text = httpx.get(f"{base}/metrics").text
        (labels,) = metric_labels(text, "kvgate:engine_config_info")
        for name, (_, expected) in FLAGS.items():
            assert labels[name] == expected, (name, labels[name], expected)
        assert labels["model"] == tiny_model_dirs["qwen3"] and labels["model_name"] == "tiny"
        assert re.search(r'kvgate:kv_cache_free_blocks\{model_name="tiny"\} 40\.0', text)  # the override won
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                           extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 9 and r.choices[0].finish_reason == "length"  # --max-tokens-default
        asked = dict(model="tiny", messages=[{"role": "user", "content": "Hi"}], temperature=0,
                     extra_body={"ignore_eos": True})
        whole = client.chat.completions.create(**asked).choices[0].message.content
        stream = client.chat.completions.create(**asked, stream=True)
        pieces = [c.choices[0].delta.content for c in stream if c.choices and c.choices[0].delta.content]
        assert "".join(pieces) == whole  # --stream-interval 3: nothing lost...
        assert len(pieces) <= 4  # ...in at most 4 chunks of text for 9 tokens (1, 3, 3, 2), not 9
        with pytest.raises(openai.BadRequestError, match="logprobs must be <= 5"):  # --max-logprobs
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=2, logprobs=True, top_logprobs=6)


def with_generation_config(src: str, dst: Path, config: dict) -> str:
    shutil.copytree(src, dst)
    (dst / "generation_config.json").write_text(json.dumps(config))
    return str(dst)


def test_generation_config_fills_what_the_request_leaves_out(tmp_path: Path, tiny_model_dirs: dict[str, str]
                                                            ) -> None:
    model = with_generation_config(tiny_model_dirs["llama"], tmp_path / "model",
                                   {"temperature": 0.0, "max_new_tokens": 6, "eos_token_id": 2})
    prompt = "The capital of France is"
    greedy = LLM(model, num_gpu_blocks_override=64).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0].outputs[0].text
    port = free_port()
    with serve([model, "--port", str(port), "--num-gpu-blocks-override", "64"], tmp_path / "serve.log", port) \
            as (base, _):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        for _ in range(2):  # no sampling field: temperature 0 and 6 tokens, from generation_config.json
            r = client.completions.create(model="model", prompt=prompt, extra_body={"ignore_eos": True})
            assert r.choices[0].text == greedy and r.usage.completion_tokens == 6
        r = client.completions.create(model="model", prompt=prompt, max_tokens=2, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 2  # what the request sets wins
        chat = client.chat.completions.create(model="model", messages=[{"role": "user", "content": prompt}],
                                              extra_body={"ignore_eos": True})
        assert chat.usage.completion_tokens == 6


@pytest.mark.parametrize("flags, message", [
    (["--tensor-parallel-size", "3"], "tensor_parallel_size must divide the 4 attention heads, the 2 KV heads (or be "
                                      "a multiple of them), the MLP width 128 of LlamaForCausalLM, got 3"),
    (["--max-model-len", "100000"], "max_model_len must be in [2, 512] for this model, got 100000"),
    (["--no-enable-chunked-prefill", "--max-num-batched-tokens", "100"],
     "max_num_batched_tokens must be >= max_model_len (512) without chunked prefill, got 100"),
    (["--attention-backend", "nope"], "--attention-backend: must be a registered backend (torch"),
    (["--attention-backend", "triton"], "attention_backend triton needs a CUDA device"),
    (["--device", "tpu"], "--device: must be auto, cpu, cuda or cuda:N, got 'tpu'"),
    (["--runner", "pooling", "--pooler-config", '{"pooling_type": "MAX"}'],
     "pooler_config.pooling_type must be one of LAST, MEAN, CLS, got 'MAX'"),
    (["--pooler-config", '{"normalize": false}', "--runner", "generate"],
     "--pooler-config: applies to embedding models only"),
    (["--generation-config", "no-such-dir"], "--generation-config: must be auto, vllm or a directory holding a "
                                             "generation_config.json, got 'no-such-dir'"),
    (["--port", "0"], "--port: must be in [1, 65535], got 0"),
    (["--gpu-memory-utilization", "0"], "--gpu-memory-utilization: must be in (0, 1], got 0.0"),
    (["--max-model-len", "1"], "--max-model-len: must be >= 2, got 1"),
    (["--tool-call-parser", "nope"], "--tool-call-parser: must be a registered tool-call parser (hermes, llama3_json, "
                                     "mistral), got 'nope'"),
    (["--reasoning-parser", "r2"], "--reasoning-parser: must be a registered reasoning parser (deepseek_r1, qwen3), "
                                   "got 'r2'"),
    (["--enable-auto-tool-choice"], "--enable-auto-tool-choice: needs tool_call_parser"),
])
def test_values_the_engine_cannot_serve_exit_2_before_loading(tiny_model_dirs: dict[str, str], capsys, monkeypatch,
                                                              flags: list[str], message: str) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the Triton test modules set it for this process

    def started(*args, **kwargs):  # a value that passed the checks would serve forever: fail instead of hanging
        raise AssertionError(f"kvgate serve {' '.join(flags)} got past the checks and started serving")

    monkeypatch.setattr(GatewayServer, "run", started)
    assert main(["serve", tiny_model_dirs["llama"], *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvgate: error: ") and message in err, err
    assert "loading" not in err


def test_argparse_refusals_and_the_model_given_twice(tiny_model_dirs: dict[str, str], capsys) -> None:
    for flags, message in ((["--block-size", "7"], "argument --block-size: invalid choice: 7"),
                           (["--pooler-config", "[1]"], "argument --pooler-config: must be a JSON object"),
                           (["--max-num-seqs", "many"], "argument --max-num-seqs: invalid int value: 'many'")):
        with pytest.raises(SystemExit) as e:
            main(["serve", tiny_model_dirs["llama"], *flags])
        assert e.value.code == 2 and message in capsys.readouterr().err
    assert main(["serve", tiny_model_dirs["llama"], "--model", tiny_model_dirs["qwen3"]]) == 2
    assert "the model is given twice" in capsys.readouterr().err


def test_an_embedding_model_cannot_be_served_to_generate(tmp_path: Path, capsys) -> None:
    model = build_tiny_embedding_model(tmp_path / "emb", "qwen3")
    assert main(["serve", model, "--runner", "generate"]) == 2
    assert ("runner generate needs an LM head, and Qwen3Model has none (an embedding model): use runner pooling"
            in capsys.readouterr().err)


def test_a_config_file_with_an_unservable_value_exits_2(tmp_path: Path, tiny_model_dirs: dict[str, str]) -> None:
    """The case that once left a server up with a dead model: now refused before anything loads or listens."""
    config = tmp_path / "config.yaml"
    config.write_text(f"models:\n  - name: tiny\n    model: {tiny_model_dirs['llama']}\n"
                      f"    pipeline_parallel_size: 3\n")
    r = subprocess.run([*CLI, "serve", "--config", str(config)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip() == (f"kvgate: error: {config}: model 'tiny': pipeline_parallel_size must be at most the 2 "
                                f"layers of LlamaForCausalLM, got 3")
    config.write_text(f"max_model_len: 4096\nmodels:\n  - name: tiny\n    model: {tiny_model_dirs['llama']}\n")
    r = subprocess.run([*CLI, "serve", "--config", str(config)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip() == (f"kvgate: error: {config}: model 'tiny': max_model_len must be in [2, 512] for "
                                f"this model, got 4096")


def test_version() -> None:
    r = subprocess.run([*CLI, "--version"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == f"kvgate {importlib.metadata.version('kvgate')}"
