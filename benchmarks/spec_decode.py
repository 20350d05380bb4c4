"""Speculative decoding (n-gram prompt lookup by default, or any --speculative-config) against plain
decoding, greedy.

Two engines in one process, rounds alternating between them so drift in the machine's load hits
both alike. Three tasks: two input-grounded ones (a rewrite of a ~300-token paragraph and type hints
for ~280 tokens of code: the output copies the input in runs, where prompt lookup should pay) and
an open-ended chat reply (where it should cost next to nothing). Checks the outputs are identical,
and prints tok/s end to end (the prompt's prefill included, which speculation does not touch) and
decode tok/s (after the first token), their ratios and the draft counters.

    python benchmarks/spec_decode.py [--model M] [--rounds 3] [--batch-size 1] [--speculative-config JSON]
                                    [--quantization auto|gguf|none]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from roseinfer import LLM, SamplingParams

PARAGRAPH = (
    "The comittee met on tuesday to dicsuss the new budjet for the comming year. Several members "
    "argued that the libary should recieve more funding, since its buildng is old and the roof leaks "
    "every winter. Others beleived that the money would be better spent on the park, wich is used by "
    "many familys in the sumer. After a long debate, the chairman sugested a compromize: the libary "
    "would get enough to fix the roof, and the rest would go to the park. Most members agred, althogh "
    "a few complained that the proces had been rushed and that the public had not been consulted. "
    "The final vote will take place next month, after a public meeting where residents can share "
    "there opinions. The comittee also decided to publish the full budjet online, so that everyone "
    "can see how the money is spent, and to hold a second meeting in the autum to review progres. "
    "Finaly, the treasurer reminded everyone that the town's reserves are low and that any new "
    "spending must be balanced by savings elsewere, for exemple by reducing the cost of street lighting."
)
CODE = '''def merge_intervals(intervals, min_gap=0):
    if not intervals:
        return []
    intervals = sorted(intervals, key=lambda pair: pair[0])
    merged = [list(intervals[0])]
    for start, end in intervals[1:]:
        last = merged[-1]
        if start <= last[1] + min_gap:
            last[1] = max(last[1], end)
        else:
            merged.append([start, end])
    return [tuple(pair) for pair in merged]


def parse_config(path, defaults=None, strict=False):
    values = dict(defaults or {})
    with open(path) as handle:
        for number, line in enumerate(handle, start=1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            if "=" not in line:
                if strict:
                    raise ValueError(f"line {number}: expected key = value")
                continue
            key, value = line.split("=", 1)
            values[key.strip()] = value.strip()
    return values
'''
TASKS = {
    "rewrite": [{"role": "user", "content": "Rewrite this paragraph, fixing the typos:\n\n" + PARAGRAPH}],
    "type-hints": [{"role": "user", "content": "Add type hints to these functions:\n\n" + CODE}],
    "chat": [{"role": "user", "content": "Tell me about your favourite season of the year and why."}],
}
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


def _time(llm: LLM, prompt: list[int], params: SamplingParams, batch: int = 1
          ) -> tuple[float, float, list[list[int]]]:
    """(output tok/s end to end, decode tok/s: the tokens after each first one over the time from
    the first first token to the last finish, the outputs)."""
    start = time.perf_counter()
    outs = llm.generate([prompt] * batch, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    decode_s = max(o.metrics["finished"] for o in outs) - min(o.metrics["first_token"] for o in outs)
    decoded = sum(len(o.token_ids) - 1 for o in outs)
    return sum(len(o.token_ids) for o in outs) / elapsed, decoded / decode_s, [o.token_ids for o in outs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the embedded default model")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=1,
                        help="copies of each task's prompt decoded together (speculation stops above the config's "
                             "disable_by_batch_size: raise it to measure speculation there)")
    parser.add_argument("--speculative-config", default=json.dumps(NGRAM))
    parser.add_argument("--quantization", default="auto", help="as the engine's flag (auto keeps GGUF blocks)")
    args = parser.parse_args()
    common = {"num_threads": args.num_threads, "enable_prefix_caching": False, "quantization": args.quantization}  # every round prefills afresh
    plain = LLM(args.model, **common)
    spec = LLM(args.model, speculative_config=args.speculative_config, **common)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    print(f"speculative_config={args.speculative_config} max_tokens={args.max_tokens} rounds={args.rounds} "
          f"batch_size={args.batch_size}")
    for task, messages in TASKS.items():
        prompt = plain.apply_chat_template(messages)
        _time(plain, prompt, SamplingParams(temperature=0.0, max_tokens=8))  # warm-up
        _time(spec, prompt, SamplingParams(temperature=0.0, max_tokens=8))
        before = spec.speculative_stats()
        rates: dict[str, list[tuple[float, float]]] = {"plain": [], "spec": []}
        for _ in range(args.rounds):
            *plain_rates, plain_ids = _time(plain, prompt, params, args.batch_size)
            *spec_rates, spec_ids = _time(spec, prompt, params, args.batch_size)
            assert spec_ids == plain_ids, f"{task}: speculative output differs from plain"
            rates["plain"].append(tuple(plain_rates))
            rates["spec"].append(tuple(spec_rates))
        after = spec.speculative_stats()
        drafts = after["spec_num_drafts"] - before["spec_num_drafts"]
        proposed = after["spec_num_draft_tokens"] - before["spec_num_draft_tokens"]
        accepted = after["spec_num_accepted_tokens"] - before["spec_num_accepted_tokens"]
        print(f"{task}: batch {args.batch_size}, prompt {len(prompt)} tokens, output {len(plain_ids[0])} tokens "
              f"each (identical)")
        for column, name in enumerate(("e2e", "decode")):
            plain_r, spec_r = [r[column] for r in rates["plain"]], [r[column] for r in rates["spec"]]
            # each round's pair ran back to back, so its ratio is the least disturbed by the machine's load
            ratio = statistics.median(b / a for a, b in zip(plain_r, spec_r))
            print(f"  {name:<6} plain tok/s {' '.join(f'{r:.1f}' for r in plain_r)} (median "
                  f"{statistics.median(plain_r):.1f})  spec {' '.join(f'{r:.1f}' for r in spec_r)} (median "
                  f"{statistics.median(spec_r):.1f})  ratio (median of rounds) {ratio:.2f}x")
        print(f"  drafts {drafts}  proposed {proposed}  accepted {accepted}  "
              f"mean accepted length {1 + accepted / drafts if drafts else 0:.2f}")

if __name__ == "__main__":
    main()
