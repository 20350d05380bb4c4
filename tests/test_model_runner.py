"""The model runner's KV pool, and the resident memory of reading a checkpoint."""
from __future__ import annotations

import pathlib

import pytest
import torch

from roseinfer import LLM, SamplingParams
from roseinfer.worker.model_runner import ModelRunner


def _rss_bytes() -> int:
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_cpu_pool_is_zeroed_and_resident_before_the_first_request(tiny_model_factory) -> None:
    """A 256 MB pool is committed when the engine is built (no page faults left for serving); it
    reads as zeros, and a request writes only its own slots."""
    folder = tiny_model_factory("llama")
    probe = LLM(model=str(folder), num_kv_blocks=1).engine
    per_block = ModelRunner.kv_bytes_per_block(probe.model_config, probe.config.block_size, probe.dtype)
    before = _rss_bytes()
    llm = LLM(model=str(folder), num_kv_blocks=2**28 // per_block)
    caches = llm.engine.runner.kv_caches
    pool_bytes = sum(t.numel() * t.element_size() for pair in caches for t in pair)
    assert pool_bytes > 0.99 * 2**28
    assert _rss_bytes() - before > 0.9 * pool_bytes
    assert torch.count_nonzero(caches[0][0]) == 0
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert len(out[0].token_ids) == 4
    # the request's slots hold K/V now; everything past them is still zeros
    k_cache = caches[0][0]
    assert k_cache[:8].abs().sum() > 0
    assert torch.count_nonzero(k_cache[llm.engine.config.block_size * 4:]) == 0


def test_reading_a_checkpoint_keeps_one_tensor_mapped_at_a_time(tmp_path) -> None:
    """safetensors maps the file; pages read stay resident while the mapping is open. The loader
    holds it open per tensor, so reading 8 x 32 MB never holds more than a tensor or two."""
    from safetensors.torch import save_file

    from roseinfer.loader.model_loader import iter_safetensors

    tensor_bytes = 32 * 2**20
    save_file({f"w{i}": torch.full((tensor_bytes // 4,), float(i)) for i in range(8)}, str(tmp_path / "model.safetensors"))
    before = _rss_bytes()
    peak = 0
    for name, tensor in iter_safetensors(tmp_path):
        assert float(tensor.sum()) == float(name[1:]) * tensor.numel()  # every page of it read
        peak = max(peak, _rss_bytes() - before)
        del tensor
    assert peak < 3 * tensor_bytes


def _file_rss_bytes(path: pathlib.Path) -> int:
    """Resident bytes of this process's mappings of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in pathlib.Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and not fields[0].endswith(":"):
            inside = len(fields) >= 6 and fields[-1] == str(path)
        elif inside and fields[0] == "Rss:":
            total += int(fields[1]) * 1024
    return total


def _save_llama(folder: pathlib.Path, tied: bool, vocab_size: int = 16384) -> pathlib.Path:
    """A one-layer Llama whose embedding is 32 MB of the checkpoint's 36 (68 untied); returns the file."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=512, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return folder / "model.safetensors"


def _load_on_cpu_backend(folder: pathlib.Path):
    from roseinfer.backends import select_backend
    from roseinfer.loader.model_loader import load_model_config
    from roseinfer.worker.worker import load_prepared_model

    cfg = load_model_config(folder)
    cpu = torch.device("cpu")
    return load_prepared_model(folder, cfg, torch.float32, cpu, select_backend("cpu", cpu, torch.float32, cfg))


def _cpu_backend_packs() -> bool:
    from roseinfer.backends.cpu import CPUBackend, onednn

    return CPUBackend.supports(torch.device("cpu"), torch.float32) and onednn.available()


needs_onednn = pytest.mark.skipif(not _cpu_backend_packs(), reason="prepacking needs oneDNN and the CPU backend")


@needs_onednn
def test_untied_embedding_is_read_from_the_checkpoint_file(tmp_path) -> None:
    """The embedding is the checkpoint's memory map, not a copy: after loading none of its 32 MB
    stays resident, and a lookup pages in only its rows."""
    from safetensors.torch import load_file

    checkpoint = _save_llama(tmp_path, tied=False)
    model = _load_on_cpu_backend(tmp_path)
    embedding = model.model.embed_tokens.weight
    assert embedding.checkpoint_mapped
    assert _file_rss_bytes(checkpoint) < 2**20
    ids = torch.tensor([0, 5, 16383])
    with torch.inference_mode():
        rows = model.model.embed_tokens(ids)
    # three rows paged in (each fault maps the page-cache folio around it, up to 2 MB on this
    # machine's kernel), not the 32 MB table
    assert _file_rss_bytes(checkpoint) < 8 * 2**20
    assert torch.equal(rows, load_file(str(checkpoint))["model.embed_tokens.weight"][ids])


@needs_onednn
@pytest.mark.parametrize("vocab_size", [16384, 16383])  # the second leaves the last row block part-filled
def test_tied_embedding_reads_its_rows_from_the_prepacked_head(tmp_path, vocab_size) -> None:
    """A tied table is held once: the embedding looks its rows up in the LM head's oneDNN-packed copy
    and keeps no table (nor any mapping of the file) of its own."""
    from safetensors.torch import load_file

    checkpoint = _save_llama(tmp_path, tied=True, vocab_size=vocab_size)
    model = _load_on_cpu_backend(tmp_path)
    embed_tokens = model.model.embed_tokens
    assert embed_tokens.weight is None and embed_tokens.packed is model.lm_head.packed
    assert str(checkpoint) not in pathlib.Path("/proc/self/maps").read_text()
    expected = load_file(str(checkpoint))["model.embed_tokens.weight"]
    ids = torch.tensor([[0, 5, vocab_size - 1], [63, 64, vocab_size - 2]])
    hidden = torch.randn(2, 512)
    with torch.inference_mode():
        rows, logits = embed_tokens(ids), model.compute_logits(hidden)
    assert torch.equal(rows, expected[ids])
    torch.testing.assert_close(logits, hidden @ expected.T, rtol=1e-4, atol=1e-4)


@needs_onednn
def test_tied_embedding_keeps_its_table_where_the_packed_layout_is_unknown(tmp_path, monkeypatch) -> None:
    """oneDNN picks its layout by CPU and version: one the embedding cannot verify leaves it on its
    own table (the checkpoint's memory map), and lookups still return the checkpoint's rows."""
    from safetensors.torch import load_file

    from roseinfer.backends.cpu import onednn
    from roseinfer.backends.cpu.layers import PackedRowsEmbedding

    monkeypatch.setattr(onednn, "ROW_BLOCK_CANDIDATES", (2, 3))  # 2: the wrong rows; 3: the wrong size
    checkpoint = _save_llama(tmp_path, tied=True)
    model = _load_on_cpu_backend(tmp_path)
    embed_tokens = model.model.embed_tokens
    assert not isinstance(embed_tokens, PackedRowsEmbedding) and embed_tokens.weight is not None
    assert _file_rss_bytes(checkpoint) < 2**20  # packing the head read the table; its pages were let go
    ids = torch.tensor([0, 5, 16383])
    with torch.inference_mode():
        assert torch.equal(embed_tokens(ids), load_file(str(checkpoint))["model.embed_tokens.weight"][ids])
