"""GGUF files of the hybrid linear-attention families (llama.cpp's qwen35, qwen35moe, qwen3next),
written from the tiny checkpoints as convert_hf_to_gguf.py writes them (tests/gguf_writer_hybrid.py):
the tensor names the converter gives, the weights back as transformers holds them, and greedy output
equal to HF's."""
from __future__ import annotations

import sys
from pathlib import Path

import gguf
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # tests/ is not a package
from gguf_writer import write_tiny_gguf  # noqa: E402
from gguf_writer_hybrid import HYBRID_ARCH  # noqa: E402
from tiny_models import HYBRID_ARCHS, hf_greedy, load_hf_model, sample_prompts  # noqa: E402

from roseinfer import LLM, SamplingParams  # noqa: E402
from roseinfer.loader.gguf import convert_gguf  # noqa: E402
from roseinfer.loader.model_loader import load_model, load_model_config  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
# the linear layers' tensors as the converter names them, beside the attention, norm and MLP ones
LINEAR_TENSORS = {"qwen35": ("attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha"),
                  "qwen35moe": ("attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha"),
                  "qwen3next": ("attn_qkv", "attn_gate", "ssm_ba")}


@pytest.fixture(scope="module", params=HYBRID_ARCHS)
def model_dir(request, tiny_model_factory) -> Path:
    return tiny_model_factory(request.param)


def _write(model_dir: Path, path: Path, qtype: str) -> Path:
    from transformers import AutoTokenizer

    return write_tiny_gguf(path, load_hf_model(model_dir), AutoTokenizer.from_pretrained(model_dir), qtype)


def _parameters(folder: Path) -> dict[str, torch.Tensor]:
    model = load_model(folder, load_model_config(folder), torch.float32, torch.device("cpu"), quantization="none")
    return dict(model.state_dict())


def test_tensor_names_and_weights_round_trip(model_dir: Path, tmp_path: Path) -> None:
    """The file holds the converter's names; converted back, every parameter is the checkpoint's: the
    tiled value heads exactly, the norms stored as 1 + w to the same 1 + w they scale by, A_log
    through -exp and back to fp32 rounding."""
    src = _write(model_dir, tmp_path / "tiny.gguf", "F32")
    reader = gguf.GGUFReader(src)
    arch = HYBRID_ARCH[load_model_config(model_dir).model_type]
    assert reader.fields["general.architecture"].contents() == arch
    names = {t.name for t in reader.tensors}
    for kind in LINEAR_TENSORS[arch] + ("ssm_conv1d.weight", "ssm_dt.bias", "ssm_a", "ssm_norm.weight",
                                        "ssm_out.weight", "post_attention_norm.weight", "attn_q.weight"):
        assert any(name.startswith("blk.") and name.split(".", 2)[2].startswith(kind) for name in names), kind
    converted = _parameters(convert_gguf(src, cache_dir=str(tmp_path / "cache")))
    original = _parameters(model_dir)
    assert converted.keys() == original.keys()
    for name, tensor in original.items():
        if name.endswith("A_log"):
            torch.testing.assert_close(converted[name], tensor, rtol=1e-6, atol=0)
        elif name.endswith("norm.weight") and ".linear_attn." not in name:
            assert torch.equal(1 + converted[name], 1 + tensor), name
        else:
            assert torch.equal(converted[name], tensor), name


def test_engine_on_f32_gguf_matches_hf(model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROSEINFER_CACHE_DIR", str(tmp_path / "cache"))
    src = _write(model_dir, tmp_path / "tiny.gguf", "F32")
    prompts = sample_prompts(model_dir, 3, seed=4, max_len=70)
    outs = LLM(model=str(src), num_kv_blocks=64, max_num_batched_tokens=5).generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == [hf_greedy(model_dir, p, 12) for p in prompts]


def test_quantized_blocks_equal_the_dequantized_weights(model_dir: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Q8_0 (the linear layers' out projection, whose columns the converter reordered, dequantized at
    conversion): the engine on the file's blocks generates what it does from the fp32 folder, and for
    dense Qwen3.5 (whose folder transformers loads) what HF does."""
    monkeypatch.setenv("ROSEINFER_CACHE_DIR", str(tmp_path / "cache"))
    src = _write(model_dir, tmp_path / "tiny.gguf", "Q8_0")
    prompts = sample_prompts(model_dir, 2, seed=5, max_len=60)
    blocks = LLM(model=str(src), num_kv_blocks=64).generate(prompts, GREEDY, use_tqdm=False)
    folder = convert_gguf(src)
    dequantized = LLM(model=str(folder), num_kv_blocks=64).generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in blocks] == [o.token_ids for o in dequantized]
    if load_model_config(folder).model_type == "qwen3_5_text":
        assert [o.token_ids for o in dequantized] == [hf_greedy(folder, p, 12) for p in prompts]
