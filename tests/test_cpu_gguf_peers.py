"""benchmarks/cpu_gguf_peers.py's compute ceiling of the exact path counts a token's multiply-adds from the
GGUF: every matmul weight below the LM head, and the LM head once whether it is its own tensor or the tied
embedding (a prompt token but the last skips it, so the end-to-end ceiling needs it apart)."""
from __future__ import annotations

import pytest
from bench_helpers import BENCHMARKS, benchmark_script
from gguf_writer import make_tiny_tokenizer, write_tiny_gguf
from test_quantized import _tiny_hf
from torch import nn


@pytest.mark.parametrize("tied", [True, False])
def test_multiply_adds_are_the_models_matmul_weights(tmp_path, monkeypatch, tied: bool) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the script imports the scripts beside it
    peers = benchmark_script("cpu_gguf_peers")
    tok = make_tiny_tokenizer()
    hf = _tiny_hf("llama", 64, len(tok), tie_word_embeddings=tied)
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", hf, tok, qtype="Q8_0")
    head = hf.lm_head.weight.numel()
    below = sum(m.weight.numel() for m in hf.modules() if isinstance(m, nn.Linear)) - head
    assert peers.multiply_adds_per_token(gguf) == (below, head)
