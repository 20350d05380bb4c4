"""GGUF weights kept quantized (--quantization gguf): the CPU backend's block matmul and row lookup
(csrc/quant_matmul.c) against gguf-py's dequantize and a torch matmul, and whole models against HF
running the dequantized weights."""
from __future__ import annotations

import ctypes
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as QT

from gguf_quantizers import encode_weights
from gguf_writer import make_tiny_tokenizer, write_tiny_gguf
from roseinfer import LLM, SamplingParams
from roseinfer.backends.cpu import kernels, ops
from roseinfer.loader.gguf import convert_gguf
from test_layers import random_linear
from test_native_kernels import needs_kernels
from tiny_models import assert_greedy_matches_hf_on_the_fp32_folder, hf_greedy

QTYPES = [QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.MXFP4]
K_QUANTS = (QT.Q4_K, QT.Q5_K, QT.Q6_K)  # 256-weight blocks


def random_blocks(qtype: QT, rows: int, cols: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks uint8 [rows, bytes per row], the same weights dequantized by gguf-py [rows, cols])."""
    rng = np.random.default_rng(seed)
    raw, stored = encode_weights(rng.standard_normal((rows, cols)).astype(np.float32), qtype, rng)
    assert stored == qtype
    dense = gguf.quants.dequantize(raw, qtype).reshape(rows, cols)
    return torch.from_numpy(np.ascontiguousarray(raw)), torch.from_numpy(dense)


@needs_kernels
@pytest.mark.parametrize("qtype", QTYPES, ids=[q.name for q in QTYPES])
@pytest.mark.parametrize("rows", [1, 3, 8, 21])
def test_quant_matmul_equals_dequantize_then_matmul(qtype: QT, rows: int) -> None:
    # 37 outputs: a partial tile; 2 blocks of 256 (K-quants) or 24 of 32 per row: widths that are
    # whole blocks, and for the 32-blocks (768 = 3 * 256) not whole 256-wide steps
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    cols = 2 * block if block == 256 else 24 * block
    blocks, dense = random_blocks(qtype, 37, cols)
    x = torch.randn(rows, cols)
    bias = torch.randn(37)
    got = ops.quant_matmul(x, blocks, int(qtype), bias)
    torch.testing.assert_close(got, x @ dense.T + bias, rtol=1e-5, atol=1e-4 * dense.abs().max().item())
    # strided rows of x (a slice of a wider tensor) read the same
    wide = torch.randn(rows, cols + 16)
    wide[:, :cols] = x
    torch.testing.assert_close(ops.quant_matmul(wide[:, :cols], blocks, int(qtype), bias), got)


@needs_kernels
@pytest.mark.parametrize("qtype", QTYPES, ids=[q.name for q in QTYPES])
def test_dequantize_rows_equals_gguf_dequantize_bit_for_bit(qtype: QT) -> None:
    blocks, dense = random_blocks(qtype, 9, gguf.GGML_QUANT_SIZES[qtype][0] * 3, seed=1)
    ids = torch.tensor([8, 0, 3, 3])
    assert torch.equal(ops.dequantize_rows(blocks, int(qtype), ids, dense.shape[1]), dense[ids])


@needs_kernels
def test_quant_matmul_refuses_types_and_widths_it_does_not_handle() -> None:
    blocks, _ = random_blocks(QT.Q4_K, 4, 256)
    with pytest.raises(ValueError, match="not supported"):
        ops.quant_matmul(torch.randn(2, 32), blocks[:, :18], int(QT.Q4_K), None)  # 32 is not whole 256-blocks
    with pytest.raises(ValueError, match="not supported"):
        ops.quant_matmul(torch.randn(2, 32), blocks[:, :18], int(QT.Q2_K), None)
    mxfp4, _ = random_blocks(QT.MXFP4, 4, 64)
    with pytest.raises(ValueError, match="not supported"):
        ops.quant_matmul(torch.randn(2, 48), mxfp4[:, :17], int(QT.MXFP4), None)  # 48 is a block and a half


def _tiny_hf(model_type: str, hidden: int, vocab: int, **overrides) -> torch.nn.Module:
    """A random HF model whose 2-D weights are scaled up, so greedy logits are far from ties."""
    torch.manual_seed(0)
    if model_type == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=vocab, n_embd=hidden, n_layer=2, n_head=4, n_positions=128,
                                      n_inner=2 * hidden, bos_token_id=1, eos_token_id=2)
    else:
        cls = dict(llama=transformers.LlamaConfig, qwen3=transformers.Qwen3Config)[model_type]
        cfg = cls(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5,
                  bos_token_id=1, eos_token_id=2, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
            if p.dim() == 2:
                p.mul_(4.0)
    return model


def _quantized_modules(llm: LLM) -> set[str]:
    return {type(m).__name__ for m in llm.engine.runner.model.modules() if hasattr(getattr(m, "weight", None),
                                                                                   "ggml_type")}


# llama: q/k rows unpermuted and reordered for rotary as rows of blocks, an untied head; qwen3: a
# tied head reading the embedding's blocks, q/k norms; gpt2: its Conv1D weights are transposed and
# its names renamed, so everything is dequantized at load (and still exact)
CASES = [("llama", q.name) for q in QTYPES] + [("qwen3", "Q8_0"), ("gpt2", "Q8_0")]


@needs_kernels
@pytest.mark.parametrize("model_type,qtype", CASES, ids=[f"{m}-{q}" for m, q in CASES])
def test_engine_with_blocks_matches_hf_on_the_dequantized_weights(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   model_type: str, qtype: str) -> None:
    """roseinfer with quantization gguf (weights in blocks, dequantized in the matmul) generates what HF
    generates from the dequantized weights (the fp32 conversion of the same file), token for token."""
    monkeypatch.setenv("ROSEINFER_CACHE_DIR", str(tmp_path / "cache"))
    tok = make_tiny_tokenizer(300)
    hidden = 256 if qtype in ("Q4_K", "Q5_K", "Q6_K") else 64  # K-quant rows are whole 256-blocks
    extra = dict(llama=dict(tie_word_embeddings=False), qwen3=dict(head_dim=32, tie_word_embeddings=True), gpt2={})
    src = write_tiny_gguf(tmp_path / "tiny.gguf", _tiny_hf(model_type, hidden, len(tok), **extra[model_type]), tok,
                          qtype)
    llm = LLM(model=str(src), quantization="gguf", num_kv_blocks=32)
    assert _quantized_modules(llm) == (set() if model_type == "gpt2" else {"QuantizedLinear", "QuantizedEmbedding"})
    prompts = [[5, 17, 42, 9], list(range(3, 40))]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    folder = convert_gguf(src)  # dequantized to fp32
    refs = [hf_greedy(folder, p, 12) for p in prompts]
    assert any(len(set(r)) > 2 for r in refs), "degenerate reference"
    assert [o.token_ids for o in outs] == refs
    if model_type == "llama":  # its decode steps ran all layers in one C call (csrc/decode_layers.c)
        table = llm.engine.runner.model._decode_table
        assert table is not None and table[1] is not None


@needs_kernels
def test_matmul_floors_run_on_blocks_from_one_c_loop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`bench offline --floor` on a model kept in blocks: the decode floor runs the quantized matmuls
    from one C loop, as the engine's one-call decoder stack does, each weight with its GGML type; the
    activations are fp32 (the first parameter is a uint8 block table)."""
    from roseinfer.bench.floor import matmul_floor, prefill_matmul_floor
    from roseinfer.layers.linear import linear_layers

    monkeypatch.setenv("ROSEINFER_CACHE_DIR", str(tmp_path / "cache"))
    tok = make_tiny_tokenizer(300)
    src = write_tiny_gguf(tmp_path / "tiny.gguf", _tiny_hf("llama", 64, len(tok), tie_word_embeddings=False), tok,
                          "Q4_1")
    llm = LLM(model=str(src), quantization="gguf", num_kv_blocks=32)
    model, backend = llm.engine.runner.model, llm.engine.backend
    layers = linear_layers(model)
    calls: list[list[int]] = []
    real_steps = ops.packed_matmul_steps
    monkeypatch.setattr(ops, "packed_matmul_steps",
                        lambda weights, x, steps: calls.append([w[1] for w in weights]) or real_steps(weights, x, steps))
    assert matmul_floor(model, backend, 2, steps=2, warmup=1) > 0
    assert calls == [[int(QT.Q4_1)] * len(layers)] * 2
    assert prefill_matmul_floor(model, 2, 8, 16) > 0
    with pytest.raises(ValueError, match="not supported"):
        real_steps([(layers[0].native_weights, 99, None, layers[0].out_features, layers[0].in_features)],
                   torch.zeros(1, layers[0].in_features), 1)


@needs_kernels
def test_tensor_parallel_dequantizes_blocks_at_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank's share of a row would cut through blocks: under tensor parallelism auto dequantizes at
    load (still HF's tokens on the dequantized weights), and gguf is refused before anything starts."""
    # the conversions in a cache of the test's own, the kernels the session's: rank 1's process
    # would compile its own copy of them otherwise
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "kernels").symlink_to(kernels._cache_dir(), target_is_directory=True)
    monkeypatch.setenv("ROSEINFER_CACHE_DIR", str(tmp_path / "cache"))
    tok = make_tiny_tokenizer(300)
    src = write_tiny_gguf(tmp_path / "tiny.gguf", _tiny_hf("llama", 64, len(tok), tie_word_embeddings=False), tok,
                          "Q8_0")
    with pytest.raises(ValueError, match="tensor parallelism splits weights"):
        LLM(model=str(src), quantization="gguf", tensor_parallel_size=2)
    llm = LLM(model=str(src), tensor_parallel_size=2, num_kv_blocks=32)
    try:
        assert _quantized_modules(llm) == set()
        prompt = list(range(3, 40))
        out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
        assert out.token_ids == hf_greedy(convert_gguf(src), prompt, 12)
    finally:
        llm.shutdown()


def test_a_fused_weight_whose_parts_differ_in_type_keeps_each_parts_blocks(caplog: pytest.LogCaptureFixture) -> None:
    """q/k/v in two types: the parts' blocks back to back, each part's type and rows on the parameter;
    a fused weight with a part not stored as blocks stays fp32, and so does one with a type the
    backend does not compute with."""
    from roseinfer.loader.quantized import BlockPart, BlockTensor, keep_blocks
    from roseinfer.models.config import ModelConfig
    from roseinfer.models.registry import build_model

    cfg = _tiny_hf("llama", 64, 300, tie_word_embeddings=False).config
    model = build_model(ModelConfig.from_dict(cfg.to_dict()))
    attn, mlp = "model.layers.{}.self_attn", "model.layers.{}.mlp"
    stored = {f"{attn.format(0)}.q_proj.weight": BlockTensor("Q4_1", (64, 64)),
              f"{attn.format(0)}.k_proj.weight": BlockTensor("Q8_0", (32, 64)),
              f"{attn.format(0)}.v_proj.weight": BlockTensor("Q4_1", (32, 64)),
              f"{mlp.format(0)}.gate_proj.weight": BlockTensor("Q4_1", (64, 64)),  # its up_proj stays F32
              f"{mlp.format(1)}.gate_proj.weight": BlockTensor("Q4_1", (64, 64)),
              f"{mlp.format(1)}.up_proj.weight": BlockTensor("Q6_K", (64, 64))}  # not a type kept here
    with caplog.at_level("INFO"):
        kept = keep_blocks(model, stored, frozenset({"Q4_1", "Q8_0"}))
    assert kept == {f"{attn.format(0)}.{name}_proj.weight" for name in "qkv"}
    assert "layers.0.mlp.gate_up_proj.weight stays fp32" in caplog.text
    qkv = model.model.layers[0].self_attn.qkv_proj.weight
    assert qkv.dtype == torch.uint8 and qkv.shape == (64 * 40 + 32 * 68 + 32 * 40,)  # rows of two 32-blocks
    assert qkv.block_parts == [BlockPart(int(QT.Q4_1), 64, 0, 2560), BlockPart(int(QT.Q8_0), 32, 2560, 2176),
                               BlockPart(int(QT.Q4_1), 32, 4736, 1280)]
    assert all(model.model.layers[i].mlp.gate_up_proj.weight.dtype == torch.float32 for i in (0, 1))


def _parts_weight(parts: list[tuple[QT, int]], cols: int) -> tuple[list[torch.Tensor], torch.Tensor, int, int]:
    """Blocks for each (type, rows) part, the weight_part_t array over them, its address and layout type."""
    blocks = [random_blocks(qtype, rows, cols, seed=i)[0] for i, (qtype, rows) in enumerate(parts)]
    part = ops.weight_part_struct()
    array = (part * len(parts))(*(part(blocks=b.data_ptr(), type=int(q), rows=r) for b, (q, r) in zip(blocks, parts)))
    return blocks, array, ctypes.addressof(array), -len(parts)


@needs_kernels
@pytest.mark.parametrize("rows", [1, 3, 8, 21, 40])
def test_a_weight_in_parts_gives_each_parts_own_matmul_bit_for_bit(rows: int) -> None:
    """Each part computed by its type's kernel into its columns of the output: the values of that
    part's own quant_matmul bit for bit, at every row count (block kernels, the tiles from 17/32 rows),
    with the norm before it in the same call too."""
    parts = [(QT.Q4_K, 37), (QT.Q6_K, 21), (QT.Q5_K, 5), (QT.Q5_0, 11), (QT.Q5_1, 3)]
    blocks, array, address, layout = _parts_weight(parts, 512)
    n = sum(r for _, r in parts)
    x, bias = torch.randn(rows, 512), torch.randn(n)
    biases = bias.split([r for _, r in parts])
    expected = torch.cat([ops.quant_matmul(x, b, int(q), c) for b, (q, _), c in zip(blocks, parts, biases)], dim=1)
    assert torch.equal(ops.weight_matmul(x, address, layout, n, bias), expected)
    norm = torch.randn(512)
    normed = ops.rms_norm(x, norm, 1e-5)
    expected = torch.cat([ops.quant_matmul(normed, b, int(q), None) for b, (q, _) in zip(blocks, parts)], dim=1)
    assert torch.equal(ops.rms_norm_packed_matmul(x, norm, 1e-5, None, address, layout, n, None), expected)
    with pytest.raises(ValueError, match="not supported"):  # the parts' rows do not add up to the outputs
        ops.weight_matmul(x, address, layout, n + 1, None)


# llama.cpp's Q4_K_M: q/k Q4_K and v Q6_K in half the layers, gate Q4_K and up another type here
MIXED = {"attn_v": "Q6_K", "ffn_up": "Q5_K"}


@needs_kernels
def test_engine_with_fused_weights_in_mixed_types_matches_hf_and_the_layer_path(tmp_path: Path,
                                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A GGUF whose q/k are Q4_K and v Q6_K (gate Q4_K, up Q5_K) keeps every fused weight in blocks:
    tokens equal HF's on the dequantized weights, and the one-call decoder stack reading the parts gives
    the layer-by-layer path's logprobs bit for bit."""
    from roseinfer.backends.cpu.llama import CPULlamaForCausalLM
    from roseinfer.backends.cpu.quantized import QuantizedPartsLinear

    monkeypatch.setenv("ROSEINFER_CACHE_DIR", str(tmp_path / "cache"))
    tok = make_tiny_tokenizer(300)
    src = write_tiny_gguf(tmp_path / "tiny.gguf", _tiny_hf("llama", 256, len(tok), tie_word_embeddings=False), tok,
                          "Q4_K", qtypes=MIXED)
    llm = LLM(model=str(src), quantization="gguf", num_kv_blocks=32)
    model = llm.engine.runner.model
    for layer in model.model.layers:
        assert isinstance(layer.self_attn.qkv_proj, QuantizedPartsLinear)
        assert isinstance(layer.mlp.gate_up_proj, QuantizedPartsLinear)
    prompts = [[5, 17, 42, 9], list(range(3, 40))]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    outs = llm.generate(prompts, params)
    assert model._decode_table is not None and model._decode_table[1] is not None
    folder = convert_gguf(src)
    refs = [hf_greedy(folder, p, 12) for p in prompts]
    assert any(len(set(r)) > 2 for r in refs), "degenerate reference"
    assert [o.token_ids for o in outs] == refs
    monkeypatch.setattr(CPULlamaForCausalLM, "decode_layers", lambda self, kv_caches: None)
    layer_by_layer = LLM(model=str(src), quantization="gguf", num_kv_blocks=32).generate(prompts, params)
    assert [o.logprobs for o in outs] == [o.logprobs for o in layer_by_layer]


@needs_kernels
def test_gemma3_in_q5_0_with_a_q8_0_v_keeps_its_blocks_and_matches_hf(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A Gemma-3-1B Q4_K_M file's layout where rows are not whole 256-blocks (llama-quantize falls back
    to Q5_0, and v to Q8_0): every linear keeps its blocks, q/k/v in parts of two types, and greedy
    tokens equal HF's on the dequantized weights."""
    from roseinfer.backends.cpu.quantized import QuantizedPartsLinear
    from test_gemma import _tiny_gemma

    monkeypatch.setenv("ROSEINFER_CACHE_DIR", str(tmp_path / "cache"))
    tok = make_tiny_tokenizer(300)
    src = write_tiny_gguf(tmp_path / "tiny.gguf", _tiny_gemma("gemma3_text", len(tok)), tok, "Q5_0",
                          qtypes={"attn_v": "Q8_0"})
    llm = LLM(model=str(src), quantization="gguf", num_kv_blocks=32)
    for layer in llm.engine.runner.model.model.layers:
        assert isinstance(layer.self_attn.qkv_proj, QuantizedPartsLinear)
        assert layer.mlp.gate_up_proj.weight.ggml_type == int(QT.Q5_0)
    assert_greedy_matches_hf_on_the_fp32_folder(llm, src)


def test_quantization_gguf_needs_a_backend_and_a_model_that_have_blocks(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """--quantization gguf with the torch backend is an error naming the way out; auto there falls back
    to fp32 weights (and still matches HF); gguf on a model without blocks is an error; a bad value too."""
    from roseinfer.config import EngineConfig

    monkeypatch.setenv("ROSEINFER_CACHE_DIR", str(tmp_path / "cache"))
    tok = make_tiny_tokenizer(300)
    src = write_tiny_gguf(tmp_path / "tiny.gguf", _tiny_hf("llama", 64, len(tok), tie_word_embeddings=False), tok, "Q4_0")
    with pytest.raises(ValueError, match="torch backend computes with fp32 weights only"):
        LLM(model=str(src), quantization="gguf", attention_backend="torch", num_kv_blocks=8)
    llm = LLM(model=str(src), attention_backend="torch", num_kv_blocks=8)  # auto
    assert not _quantized_modules(llm)
    prompt = [5, 17, 42, 9]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0]
    assert out.token_ids == hf_greedy(convert_gguf(src), prompt, 8)
    with pytest.raises(ValueError, match="needs a GGUF model with quantized matrices"):
        LLM(model=str(convert_gguf(src)), quantization="gguf", num_kv_blocks=8)
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(quantization="int8")


@needs_kernels
def test_quantized_linear_runs_the_c_matmul_at_every_row_count() -> None:
    from roseinfer.backends.cpu import quantized

    blocks, dense = random_blocks(QT.Q4_1, 45, 64)
    linear = random_linear(64, 45, bias=True)
    linear.weight = torch.nn.Parameter(blocks, requires_grad=False)
    linear.weight.ggml_type = int(QT.Q4_1)
    quantized.install(linear)
    assert isinstance(linear, quantized.QuantizedLinear)
    for rows in (31, 32, 70):  # the block kernel, then fp32 tiles of W dequantized once
        x = torch.randn(rows, 64)
        torch.testing.assert_close(linear(x), x @ dense.T + linear.bias, rtol=1e-5, atol=1e-4)
