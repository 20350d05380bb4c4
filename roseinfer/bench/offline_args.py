"""``bench offline``'s command line: its flags, with the engine's and the sampling ones
(bench/engine_flags.py). What they do is bench/offline.py's."""
from __future__ import annotations

import argparse

from .engine_flags import add_engine_flags, add_sampling_flags

MODES: tuple[str, ...] = ("naive", "offline", "online")
BACKENDS: tuple[str, ...] = ("roseinfer", "hf")
DEFAULT_NUM_REQUESTS = 16


def _csv_list(text: str, kind: type, choices: tuple[str, ...] | None = None) -> list:
    items = [kind(x.strip()) for x in text.split(",") if x.strip()]
    if not items or (choices is not None and any(x not in choices for x in items)):
        raise argparse.ArgumentTypeError(f"expected a comma list of {', '.join(choices or ('integers',))}")
    return items


def add_offline_args(parser: argparse.ArgumentParser) -> None:
    p = parser
    p.add_argument("--mode", default="all", choices=(*MODES, "all"),
                   help="naive: one request at a time; offline: LLM.generate on all; online: submit all, "
                        "step the engine and stamp each token; all (default): the three in turn")
    p.add_argument("--backend", default="roseinfer", type=lambda s: _csv_list(s, str, (*BACKENDS, "both")),
                   help="roseinfer (default), hf (transformers generate, greedy, left-padded batches), "
                        "or both / roseinfer,hf for a side-by-side table")
    p.add_argument("--batch-sizes", default=None, type=lambda s: _csv_list(s, int),
                   help="comma list, e.g. 1,16,64: repeat everything once per batch size "
                        "(default: --max-batch-size)")
    p.add_argument("--num-requests", type=int, default=None,
                   help=f"requests per run (default: {DEFAULT_NUM_REQUESTS}; with --floor, the batch size)")
    p.add_argument("--prompt-len", type=int, default=32, help="tokens per generated prompt (default: 32)")
    p.add_argument("--prompt", default=None, help="use this text for every request instead of generated prompts")
    p.add_argument("--prompts", nargs="+", default=None, metavar="TEXT",
                   help="one request per text (cycled when --num-requests is given); overrides --prompt")
    p.add_argument("--pretok", action="store_true",
                   help="accepted for the blog's command lines: prompts are always tokenized before the timed runs")
    p.add_argument("--keep-prefix-cache-across-runs", action="store_true",
                   help="keep the prefix cache between runs (default: emptied before each) and give every run "
                        "the same generated prompts")
    p.add_argument("--warmup-runs", type=int, default=1, help="unreported runs before the measured ones (default: 1)")
    p.add_argument("--repeat-runs", type=int, default=1, help="measured runs per mode (default: 1)")
    p.add_argument("--print-per-run", action="store_true",
                   help="print each measured run's block before its mode's summary (naive runs always are)")
    p.add_argument("--detailed", action="store_true",
                   help="after the blog's blocks, a table of every backend, mode and batch size (also printed "
                        "with --backend hf/both or --batch-sizes)")
    p.add_argument("--json", default=None, metavar="PATH", help="write every run and the summary as JSON")
    g = p.add_argument_group("matmul floor")
    g.add_argument("--floor", action="store_true",
                   help="also time the matmul floor (only the model's matmuls, LM head included, on the "
                        "engine's weights and threads) for each batch size, before and after every measured "
                        "run, and print a Markdown table of the engine's decode and end-to-end tok/s beside "
                        "the median floor and their ratios; the engine runs the offline mode (online if "
                        "only that is run), one batch of batch-size requests unless --num-requests is given")
    g.add_argument("--floor-steps", type=int, default=16, help="timed decode steps per floor sample (default: 16)")
    g.add_argument("--floor-warmup", type=int, default=2, help="untimed steps before each floor sample (default: 2)")
    add_sampling_flags(p)
    add_engine_flags(p)
