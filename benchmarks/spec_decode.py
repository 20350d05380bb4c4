"""Speculative decoding (n-gram prompt lookup by default, or any --speculative-config) against plain
decoding, greedy.

Two engines in one process, rounds alternating between them so drift in the machine's load hits
both alike. Two tasks: an input-grounded rewrite (the output mostly copies the ~300-token input,
where prompt lookup should pay) and an open-ended chat reply (where it should cost next to
nothing). Checks the outputs are identical, and prints tok/s, the ratio and the draft counters.

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
TASKS = {
    "rewrite": [{"role": "user", "content": "Rewrite this paragraph, fixing the typos:\n\n" + PARAGRAPH}],
    "chat": [{"role": "user", "content": "Tell me about your favourite season of the year and why."}],
}
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


def _time(llm: LLM, prompt: list[int], params: SamplingParams, batch: int = 1) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    outs = llm.generate([prompt] * batch, params, use_tqdm=False)
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start), [o.token_ids for o in outs]


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
        rates: dict[str, list[float]] = {"plain": [], "spec": []}
        for _ in range(args.rounds):
            plain_rate, plain_ids = _time(plain, prompt, params, args.batch_size)
            spec_rate, spec_ids = _time(spec, prompt, params, args.batch_size)
            assert spec_ids == plain_ids, f"{task}: speculative output differs from plain"
            rates["plain"].append(plain_rate)
            rates["spec"].append(spec_rate)
        after = spec.speculative_stats()
        drafts = after["spec_num_drafts"] - before["spec_num_drafts"]
        proposed = after["spec_num_draft_tokens"] - before["spec_num_draft_tokens"]
        accepted = after["spec_num_accepted_tokens"] - before["spec_num_accepted_tokens"]
        p, s = statistics.median(rates["plain"]), statistics.median(rates["spec"])
        # each round's pair ran back to back, so its ratio is the least disturbed by the machine's load
        ratio = statistics.median(b / a for a, b in zip(rates["plain"], rates["spec"]))
        print(f"{task}: batch {args.batch_size}, prompt {len(prompt)} tokens, output {len(plain_ids[0])} tokens "
              f"each (identical)")
        print(f"  plain  tok/s {' '.join(f'{r:.1f}' for r in rates['plain'])}  median {p:.1f}")
        print(f"  spec   tok/s {' '.join(f'{r:.1f}' for r in rates['spec'])}  median {s:.1f}")
        print(f"  ratio (median of rounds) {ratio:.2f}x  drafts {drafts}  proposed {proposed}  accepted {accepted}  "
              f"mean accepted length {1 + accepted / drafts if drafts else 0:.2f}")


if __name__ == "__main__":
    main()
