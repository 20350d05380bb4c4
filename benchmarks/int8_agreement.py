"""How closely int8 activations (--cpu-activations int8) agree with the exact path, beside llama.cpp.

The same GGUF, the same text, cut as llama-perplexity cuts it (chunks of --ctx tokens, each a fresh
context, the second half of each scored): roseinfer's exact path (fp32 activations) gives the base
distributions, written as a llama-perplexity --kl-divergence-base file. Against that base, in one run:
roseinfer with int8 activations (mean KL divergence and top-1 agreement computed here as llama.cpp
computes them), and llama.cpp itself on the file (its own int8 activations: `llama-perplexity
--kl-divergence`). A last row puts llama.cpp against roseinfer int8: the same activation numerics, but
llama.cpp keeps its KV cache in fp16 and orders its sums its own way, so that row is not 0.
The tokens are llama.cpp's (the first run saves them), so both engines read the same ids.

    python benchmarks/int8_agreement.py --gguf FILE --llama-cpp LLAMA_CPP/build/bin [--text FILE]
        [--ctx 512] [--chunks 8] [--threads 2] [--work-dir /tmp/int8-agreement]
"""
from __future__ import annotations

import argparse
import gc
import os
import re
import struct
import subprocess
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from roseinfer.backends.base import BatchLayout
from roseinfer.llm import LLM
from roseinfer.worker.model_runner import layer_caches

LOGITS_MAGIC = b"_logits_"


@torch.inference_mode()
def prompt_logits(llm: LLM, tokens: list[int]) -> torch.Tensor:
    """Logits [len(tokens), vocab] of the token after each prefix of `tokens`: one sequence in one
    forward (a prefill of the whole chunk), into a KV pool of its own."""
    worker = llm.engine.executor.driver
    block_size = llm.engine.config.block_size
    blocks = -(-len(tokens) // block_size)
    caches = layer_caches(worker.local_config, worker.backend, blocks * block_size, 0)
    n = len(tokens)
    layout = BatchLayout(block_size, list(tokens), list(range(n)), list(range(n)), [0], [n], [n],
                         [list(range(blocks))])
    hidden = worker.backend.forward(worker.model, layout, caches)
    return worker.model.compute_logits(hidden).float()


class Agreement(NamedTuple):
    """Mean KL(base || other) over the positions, and the share whose most likely tokens agree."""

    mean_kl: float
    top1: float
    positions: int


def compressed_log_probs(logits: torch.Tensor) -> np.ndarray:
    """Rows of logits as llama-perplexity stores a base's log-probabilities: per row two fp32 (scale,
    lowest log-prob kept, 16 below the top) then one uint16 a token, rounded to nearest even."""
    logits = logits.double()
    top = logits.max(dim=1, keepdim=True).values
    low = torch.maximum(logits.min(dim=1, keepdim=True).values, top - 16)
    log_sum_exp = torch.log(torch.exp(logits - top).sum(dim=1, keepdim=True))
    scale = ((top - low) / 65535.0).float()
    codes = torch.where(logits > low, torch.round((logits - low).float() / scale), torch.zeros_like(scale))
    n, vocab = logits.shape
    out = np.zeros((n, 2 * ((vocab + 1) // 2) + 4), dtype=np.uint16)
    header = np.stack([scale[:, 0].numpy(), (low - top - log_sum_exp)[:, 0].float().numpy()], axis=1)
    out[:, :4] = header.astype(np.float32).view(np.uint16).reshape(n, 4)
    out[:, 4:4 + vocab] = codes.numpy().astype(np.uint16)
    return out


def base_log_probs(rows: np.ndarray, vocab: int) -> torch.Tensor:
    """compressed_log_probs's rows read back as log-probabilities [n, vocab]."""
    header = rows[:, :4].copy().view(np.float32)
    return torch.from_numpy(header[:, :1] * rows[:, 4:4 + vocab].astype(np.float32) + header[:, 1:2])


def agreement(base: torch.Tensor, logits: torch.Tensor) -> Agreement:
    """base: log-probabilities [n, vocab] (base_log_probs); logits: the other run's [n, vocab]. As
    llama-perplexity: base tokens below e^-16 left out of the KL, top-1 from both arg-maxes."""
    log_q = torch.log_softmax(logits.double(), dim=1)
    base = base.double()
    p = torch.where(base > -16, torch.exp(base), torch.zeros_like(base))
    kl = (p * (base - log_q)).sum(dim=1)
    same = (base.argmax(dim=1) == logits.argmax(dim=1)).double()
    return Agreement(kl.mean().item(), same.mean().item(), base.shape[0])


def scored_rows(n_ctx: int) -> slice:
    """The positions of a chunk that llama-perplexity scores: from the middle to the one before last."""
    return slice(n_ctx // 2, n_ctx - 1)


def write_base_file(path: Path, n_ctx: int, vocab: int, chunks: list[list[int]], rows: list[np.ndarray]) -> None:
    """A llama-perplexity --kl-divergence-base file: magic, n_ctx, vocab, chunk count, every token,
    then each chunk's scored rows (compressed_log_probs)."""
    with open(path, "wb") as f:
        f.write(LOGITS_MAGIC + struct.pack("<iii", n_ctx, vocab, len(chunks)))
        f.write(np.asarray(chunks, dtype=np.int32).tobytes())
        for chunk_rows in rows:
            f.write(chunk_rows.tobytes())


def read_base_file(path: Path) -> tuple[int, int, list[list[int]], list[np.ndarray]]:
    """(n_ctx, vocab, chunks of tokens, each chunk's scored rows) of a --kl-divergence-base file."""
    data = Path(path).read_bytes()
    if data[:8] != LOGITS_MAGIC:
        raise ValueError(f"{path} is not a llama-perplexity logits file")
    n_ctx, vocab, count = struct.unpack("<iii", data[8:20])
    offset = 20 + 4 * n_ctx * count
    tokens = np.frombuffer(data[20:offset], dtype=np.int32).reshape(count, n_ctx)
    width, scored = 2 * ((vocab + 1) // 2) + 4, n_ctx - 1 - n_ctx // 2
    rows = np.frombuffer(data[offset:], dtype=np.uint16).reshape(count, scored, width)
    return n_ctx, vocab, tokens.tolist(), list(rows)


def chunk_rows(llm: LLM, chunks: list[list[int]], bos: int | None) -> list[torch.Tensor]:
    """Each chunk's logits at its scored positions (the first token replaced by BOS where the vocabulary
    adds one, as llama-perplexity evaluates it)."""
    rows = []
    for chunk in chunks:
        tokens = [bos, *chunk[1:]] if bos is not None else chunk
        rows.append(prompt_logits(llm, tokens)[scored_rows(len(chunk))])
    return rows


def engine(gguf: Path, activations: str, threads: int) -> LLM:
    return LLM(model=str(gguf), quantization="gguf", cpu_activations=activations, num_threads=threads,
               num_kv_blocks=64, enable_prefix_caching=False)


def llama_kl(bin_dir: Path, gguf: Path, base: Path, threads: int) -> Agreement:
    """llama-perplexity --kl-divergence on `gguf` against the base file: its mean KLD and same-top share."""
    out = subprocess.run([str(bin_dir / "llama-perplexity"), "-m", str(gguf), "--kl-divergence-base", str(base),
                          "--kl-divergence", "-t", str(threads), "-b", "512"], check=True, capture_output=True,
                         text=True)
    text = out.stdout + out.stderr
    kl = float(re.search(r"Mean\s+KLD:\s+(-?[\d.]+)", text).group(1))
    top = float(re.search(r"Same top p:\s+([\d.]+)", text).group(1)) / 100
    return Agreement(kl, top, -1)


def print_row(label: str, result: Agreement) -> None:
    """A table row as soon as it is measured (a long run on a busy machine keeps what it got)."""
    print(f"| {label} | {result.mean_kl:.6f} | {100 * result.top1:.2f} % |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", type=Path, required=True)
    parser.add_argument("--llama-cpp", type=Path, required=True, help="folder with llama-perplexity")
    parser.add_argument("--text", type=Path, default=Path("/usr/share/common-licenses/GPL-3"))
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/int8-agreement"))
    args = parser.parse_args()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    from gguf import GGUFReader

    fields = GGUFReader(str(args.gguf)).fields
    add_bos = "tokenizer.ggml.add_bos_token" in fields and bool(fields["tokenizer.ggml.add_bos_token"].contents())
    bos = int(fields["tokenizer.ggml.bos_token_id"].contents()) if add_bos else None
    llama_base = args.work_dir / "llama_cpp.logits"
    subprocess.run([str(args.llama_cpp / "llama-perplexity"), "-m", str(args.gguf), "-f", str(args.text), "-c",
                    str(args.ctx), "--chunks", str(args.chunks), "-t", str(args.threads), "-b", str(args.ctx),
                    "--kl-divergence-base", str(llama_base)], check=True, capture_output=True)
    n_ctx, vocab, chunks, _ = read_base_file(llama_base)
    positions = len(chunks) * (n_ctx - 1 - n_ctx // 2)
    print(f"{args.gguf.name}: {len(chunks)} chunks of {n_ctx} tokens of {args.text.name}, {positions} positions "
          f"scored, {args.threads} threads, load average {os.getloadavg()[0]:.2f}")
    print("| | mean KL divergence | top-1 agreement |\n|---|---:|---:|", flush=True)
    bases = {}
    for activations in ("fp32", "int8"):
        llm = engine(args.gguf, activations, args.threads)
        logits = chunk_rows(llm, chunks, bos)
        del llm
        gc.collect()
        rows = [compressed_log_probs(chunk[:, :vocab]) for chunk in logits]
        bases[activations] = args.work_dir / f"roseinfer_{activations}.logits"
        write_base_file(bases[activations], n_ctx, vocab, chunks, rows)
        if activations == "fp32":
            exact = [base_log_probs(r, vocab) for r in rows]
        else:
            print_row("roseinfer int8 against roseinfer fp32", agreement(torch.cat(exact), torch.cat(logits)[:, :vocab]))
    print_row("llama.cpp (its int8) against roseinfer fp32", llama_kl(args.llama_cpp, args.gguf, bases["fp32"],
                                                                      args.threads))
    print_row("llama.cpp against roseinfer int8", llama_kl(args.llama_cpp, args.gguf, bases["int8"], args.threads))


if __name__ == "__main__":
    main()
