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


def test_rounds_give_each_cell_its_median_and_the_floor_the_largest_bandwidth(tmp_path, monkeypatch, capsys) -> None:
    """--rounds N: every cell is the median of its N rounds, the ratios are the medians' ratios, and the
    floor divides by the largest bandwidth reading of any round (the strictest fraction)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    peers = benchmark_script("cpu_gguf_peers")
    from cpu_peers import LlamaRow

    def scripted(exact: float, int8: float, peer_e2e: float, decode: float, bandwidths: list[float]):
        summary = {"throughput_completion_total": exact, "throughput_decode_tokens": decode, "throughput_prefill": 40.0}
        int8_summary = {**summary, "throughput_completion_total": int8, "throughput_decode_tokens": 2 * decode}
        peer = LlamaRow(32, 64, 1, 50.0, 20.0, 64 / peer_e2e)
        return peers.Round({1: summary}, {1: int8_summary}, {1: peer}, (summary, int8_summary, peer), bandwidths)

    rounds = iter([scripted(10.0, 20.0, 15.0, 14.0, [30e9, 32e9]), scripted(12.0, 25.0, 14.0, 16.0, [35e9, 31e9]),
                   scripted(11.0, 22.0, 16.0, 15.0, [29e9, 33e9])])
    monkeypatch.setattr(peers, "run_round", lambda gguf, args, sizes: next(rounds))
    monkeypatch.setattr(peers, "decode_weight_bytes", lambda gguf: (10**9, 0, 0))
    args = peers.argparse.Namespace(batch_sizes="1", rounds=3, int8=True, prefill_batch=1, prefill_len=512, threads=2,
                                    prompt_len=32, max_new_tokens=64)
    peers.compare(tmp_path / "model.gguf", args)
    out = capsys.readouterr().out
    assert "medians of 3 rounds" in out
    assert "| batch 1, output tok/s | 11.0 | 22.0 | 15.0 | 0.73 | 1.47 |" in out
    assert "| prefill, 1 x 512 tokens, tok/s | 40.0 | 40.0 | 50.0 | 0.80 | 0.80 |" in out
    assert "batch 1 by round, output tok/s (roseinfer / int8 / llama.cpp): 10.0 / 20.0 / 15.0; " \
           "12.0 / 25.0 / 14.0; 11.0 / 22.0 / 16.0" in out
    # floor 1 GB / 35 GB/s = 28.6 ms; median steps 1/15 s, int8 1/30 s, llama.cpp 1/20 s
    assert ("batch-1 decode: floor 1.000 GB / 35.0 GB/s = 28.6 ms; roseinfer step 66.7 ms (floor/step 0.43), "
            "int8 33.3 ms (0.86), llama.cpp 50.0 ms (0.57)") in out
