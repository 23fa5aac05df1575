from __future__ import annotations

import subprocess
import sys


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "inflight", *args], capture_output=True,
                          text=True, timeout=300)


def test_generate_chat_prints_the_answer(default_llm):  # default_llm: the GGUF is converted
    result = run_cli("generate", "--chat", "--max-tokens", "24", "--kv-cache-memory", "64MiB",
                     "What is the capital of France?")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert "finish_reason=stop" in result.stderr


def test_generate_plain_prompt_with_options():
    result = run_cli("generate", "--max-tokens", "5", "--max-num-seqs", "4",
                     "--no-enable-chunked-prefill", "--max-model-len", "256",
                     "--max-num-batched-tokens", "256", "--kv-cache-memory", "32MiB",
                     "The sky is")
    assert result.returncode == 0, result.stderr
    assert "5 generated tokens" in result.stderr and result.stdout.strip()


def test_bad_option_value_is_a_clean_error():
    result = run_cli("generate", "--block-size", "0", "hi")
    assert result.returncode == 2 and "block_size" in result.stderr
    assert "Traceback" not in result.stderr
