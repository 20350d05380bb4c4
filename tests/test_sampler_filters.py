"""Top-k / top-p / min-p from each row's candidates, penalties from counts kept per request: each
equals its definition (the sort over the whole row, the counts over the whole history) exactly."""
from __future__ import annotations

import collections
import math
import pytest
import torch
from tiny_models import sample_prompts

from roseinfer import LLM, SamplingParams
from roseinfer.engine.request import Request
from roseinfer.engine.sampler import Sampler
from roseinfer.engine.sampling_filters import PROBE, FilterSettings, candidate_filter, sort_filter

VOCAB = 1000
CPU = torch.device("cpu")
NEG_INF = float("-inf")
TOP_K = [0, 1, 5, 50, 63, 64, 65, 300, 999, 1000, 5000]
TOP_P = [1.0, 0.9, 0.5, 1e-6]
MIN_P = [0.0, 0.05, 0.5, 1.0]


def _settings(top_k: list[int], top_p: list[float], min_p: list[float], vocab: int,
              temperature: float = 1.0) -> FilterSettings:
    host_k = [k if 0 < k < vocab else 0 for k in top_k]
    col = lambda xs: torch.tensor(xs, dtype=torch.float32).unsqueeze(1)  # noqa: E731
    return FilterSettings(col([temperature] * len(top_k)), host_k, col([k or vocab for k in host_k]),
                          col([p if p < 1 else math.inf for p in top_p]), col(min_p))


def _reference(scaled: torch.Tensor, top_k: list[int], top_p: list[float], min_p: list[float]) -> torch.Tensor:
    """The sort-based code this replaced, written out, ties by the lower id (a stable sort), top_p 1
    as no nucleus (see test_top_p_1_keeps_a_tail_whose_mass_before_rounds_above_1)."""
    vocab = scaled.shape[1]
    k = torch.tensor([[min(x, vocab) if x > 0 else vocab] for x in top_k], dtype=torch.float32)
    p = torch.tensor([x if x < 1 else math.inf for x in top_p], dtype=torch.float32).unsqueeze(1)
    m = torch.tensor(min_p, dtype=torch.float32).unsqueeze(1)
    sorted_logits, order = scaled.sort(dim=-1, descending=True, stable=True)
    sorted_logits = sorted_logits.masked_fill(torch.arange(vocab) >= k, NEG_INF)
    probs = sorted_logits.softmax(dim=-1)
    drop = (probs.cumsum(dim=-1) - probs) > p
    drop |= probs < m * probs[:, :1]
    drop[:, 0] = False
    return torch.empty_like(scaled).scatter_(1, order, sorted_logits.masked_fill(drop, NEG_INF))


def _rows(kind: str, n: int, generator: torch.Generator) -> torch.Tensor:
    x = torch.randn(n, VOCAB, generator=generator) * 3
    if kind == "ties":
        x = (x * 2).round() / 2  # ties everywhere, the k-th value's included
    elif kind == "equal":
        x = torch.zeros(n, VOCAB)
    elif kind == "masked":
        x[:, 7:] = NEG_INF  # a grammar's mask: fewer finite logits than candidates
    elif kind == "peaked":
        x[:, :3] += 30.0  # the nucleus is three tokens wide
    return x


def _near_threshold(scaled: torch.Tensor, token: int, top_p: float, min_p: float) -> bool:
    """Whether a token's place in the nucleus rests on rounding: the mass before it within 1e-6 of
    top_p, or its probability within 1e-6 of min_p times the first one's."""
    probs = scaled.softmax(dim=-1)
    before = float(probs[probs > probs[token]].sum()) + float(probs[token]) * int(
        ((probs == probs[token]) & (torch.arange(len(probs)) < token)).sum())
    return abs(before - top_p) < 1e-6 or abs(float(probs[token]) - min_p * float(probs.max())) < 1e-6


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("kind", ["smooth", "ties", "equal", "masked", "peaked"])
def test_kept_set_and_probabilities_equal_the_sort(kind, temperature):
    generator = torch.Generator().manual_seed(len(kind))
    settings = [(k, p, m) for k in TOP_K for p in TOP_P for m in MIN_P]
    logits = _rows(kind, len(settings), generator)
    scaled = logits / torch.tensor(temperature, dtype=torch.float32)
    top_k, top_p, min_p = (list(column) for column in zip(*settings))
    s = _settings(top_k, top_p, min_p, VOCAB, temperature)
    want = sort_filter(logits, s)
    cands = candidate_filter(logits, s)
    masked = torch.stack([cands.masked(VOCAB, row) for row in range(len(settings))])
    got = torch.where(cands.exact.unsqueeze(1), masked, want)
    assert torch.equal(got, want)
    assert torch.equal(got.softmax(dim=-1), want.softmax(dim=-1))
    # the candidates decide most rows; never a row that keeps more than PROBE tokens without a top_k
    decided = cands.exact.tolist()
    assert sum(decided) > len(decided) // 3 or kind == "equal"  # a row of ties has one across every boundary
    for row, (k, _, _) in enumerate(settings):
        if not 0 < k < VOCAB and (want[row] > NEG_INF).sum() > PROBE:
            assert not decided[row]
    # today's code: the same floats with a top_k; without one it summed the softmax in sorted order,
    # which can move a token whose place rests on the sum's last bits
    before = _reference(scaled, top_k, top_p, min_p)
    for row, (k, p, m) in enumerate(settings):
        if 0 < k < VOCAB:
            assert torch.equal(want[row], before[row]), (row, settings[row])
        else:
            moved = ((want[row] > NEG_INF) != (before[row] > NEG_INF)).nonzero().flatten().tolist()
            assert all(_near_threshold(scaled[row], t, p, m) for t in moved), (settings[row], moved)


def test_top_p_1_keeps_a_tail_whose_mass_before_rounds_above_1():
    scaled = _rows("peaked", 1, torch.Generator().manual_seed(0))
    kept = sort_filter(scaled, _settings([63], [1.0], [0.0], VOCAB))  # temperature 1: the logits are scaled
    assert int((kept > NEG_INF).sum()) == 63
    sorted_probs = scaled.topk(63).values.softmax(dim=-1)
    assert float((sorted_probs.cumsum(dim=-1) - sorted_probs).max()) > 1.0  # what dropped tokens before


def _seeded_reference(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """The race over the whole vocabulary that the sampler ran before candidates: one row of draws."""
    scaled = logits.unsqueeze(0) / torch.tensor(params.temperature, dtype=torch.float32)
    masked = _reference(scaled, [params.top_k], [params.top_p], [params.min_p])
    q = torch.empty(VOCAB).exponential_(generator=generator)
    return int((masked.softmax(dim=-1)[0] / q).argmax())


SEEDED = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m, seed=s)
          for s, (t, k, p, m) in enumerate([(0.8, 50, 0.95, 0.0), (1.0, -1, 0.9, 0.0), (0.7, 5, 1.0, 0.0),
                                            (1.3, -1, 1.0, 0.1), (1.0, -1, 1.0, 0.0), (0.9, 20, 0.5, 0.02),
                                            (2.0, -1, 0.99, 0.0)])]


def _seeded_steps(logits: torch.Tensor, rows: list[int], steps: int) -> dict[int, list[int]]:
    """Each of rows' tokens over `steps` calls of one sampler on the batch of those rows."""
    sampler = Sampler({0}, CPU, seed=len(rows))
    batch = [Request(f"r{i}", [1, 2], SEEDED[i], generator=torch.Generator().manual_seed(i)) for i in rows]
    out: dict[int, list[int]] = {i: [] for i in rows}
    for _ in range(steps):
        for i, token in zip(rows, sampler(logits[rows], batch)[0]):
            out[i].append(token)
    return out


@pytest.mark.parametrize("kind", ["smooth", "ties", "equal", "peaked"])
def test_seeded_rows_draw_what_the_whole_vocabulary_race_drew_alone_and_batched(kind):
    logits = _rows(kind, len(SEEDED), torch.Generator().manual_seed(7))
    everyone = list(range(len(SEEDED)))
    want = {}
    for i in everyone:
        generator = torch.Generator().manual_seed(i)
        want[i] = [_seeded_reference(logits[i], SEEDED[i], generator) for _ in range(3)]
    assert _seeded_steps(logits, everyone, 3) == want
    assert _seeded_steps(logits, everyone[::-1], 3) == want
    assert _seeded_steps(logits, [5, 1, 3], 3) == {i: want[i] for i in (5, 1, 3)}
    for i in everyone:
        assert _seeded_steps(logits, [i], 3) == {i: want[i]}


CHI2_CRITICAL = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}  # significance 1e-3
TRIALS = 20_000


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.8, top_k=6),
                                    SamplingParams(temperature=1.0, top_p=0.6),
                                    SamplingParams(temperature=1.2, top_k=40, top_p=0.8, min_p=0.1)])
def test_sampled_tokens_follow_the_filtered_distribution(params):
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(3)) * 3
    scaled = logits.unsqueeze(0) / torch.tensor(params.temperature, dtype=torch.float32)
    expected = _reference(scaled, [params.top_k], [params.top_p], [params.min_p]).softmax(dim=-1)[0].double()
    sampler = Sampler({0}, CPU, seed=11)
    tokens, _ = sampler(logits.repeat(TRIALS, 1), [Request(f"r{t}", [1], params) for t in range(TRIALS)])
    counts = torch.bincount(torch.tensor(tokens), minlength=VOCAB).double()
    support = expected > 0
    assert counts[~support].sum() == 0, "a filtered-out token was drawn"
    want = expected[support] * TRIALS
    statistic = float(((counts[support] - want) ** 2 / want).sum())
    assert 2 <= int(support.sum()) <= 8
    assert statistic < CHI2_CRITICAL[int(support.sum()) - 1], (counts[support].tolist(), want.tolist())


def _from_history(row: torch.Tensor, req: Request) -> torch.Tensor:
    """The penalties read off the whole history, element by element, in fp32 like the sampler's settings."""
    p, row = req.sampling_params, row.clone()
    f32 = lambda x: torch.tensor(x, dtype=torch.float32)  # noqa: E731
    for t in set(req.token_ids):
        row[t] = row[t] / f32(p.repetition_penalty) if row[t] > 0 else row[t] * f32(p.repetition_penalty)
    for t, count in collections.Counter(req.output_token_ids).items():
        row[t] = row[t] - (f32(p.frequency_penalty) * count + f32(p.presence_penalty))
    return row


def test_penalties_equal_the_history_after_preemption_and_speculative_rejections(tiny_model_factory, monkeypatch):
    """Penalised requests decode beside speculating ones in a KV pool too small for all of them: at
    every step each penalised row's processed logits equal the definition over its whole history."""
    model_dir = tiny_model_factory("qwen3")
    prompts = sample_prompts(model_dir, 6, seed=2)
    prompts = [p[:3] * 6 for p in prompts[:3]] + [p[:12] for p in prompts[3:]]  # cyclic ones: drafts get accepted
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
             "disable_by_batch_size": 8}
    # on the CPU in fp32: the test is about the counts, and a GPU may fuse the reference's multiply-add
    llm = LLM(model=str(model_dir), device="cpu", dtype="float32", num_kv_blocks=16, block_size=4,
              speculative_config=ngram)
    penalised = dict(repetition_penalty=1.4, frequency_penalty=0.6, presence_penalty=-0.3)
    params = [SamplingParams(temperature=0.7, top_k=3, max_tokens=24, ignore_eos=True, seed=i) for i in range(3)]
    params += [SamplingParams(temperature=0.9, top_p=0.9, max_tokens=24, ignore_eos=True, seed=9, **penalised),
               SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, **penalised),
               SamplingParams(temperature=1.0, top_k=20, max_tokens=24, ignore_eos=True, **penalised)]
    checked = collections.Counter()
    process = Sampler._process

    def checking(self, logits, ints, floats):
        out = process(self, logits, ints, floats)
        for row, req in enumerate(self.batch):
            if req.sampling_params.needs_penalties:
                assert torch.equal(out[row], _from_history(logits[row], req))
                checked[req.request_id] += 1
        return out
    launch = Sampler.launch  # the model runner's entry: it launches a step's sampling, then reads it

    def recording(self, logits, requests):
        self.batch = requests
        return launch(self, logits, requests)
    monkeypatch.setattr(Sampler, "_process", checking)
    monkeypatch.setattr(Sampler, "launch", recording)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert all(len(o.token_ids) == 24 for o in outputs)
    assert sum(o.metrics["num_preemptions"] for o in outputs[3:]) > 0, "no penalised request was preempted"
    stats = llm.speculative_stats()
    assert 0 < stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"], "no draft was both kept and rejected"
    assert len(checked) == 3 and min(checked.values()) >= 24


@pytest.mark.parametrize("kind, reads", [("peaked", 1), ("equal", 2)])
def test_a_step_reads_twice_only_when_the_candidates_cannot_decide(kind, reads, monkeypatch):
    from test_batched_sampler import SYNCS, _count

    logits = _rows(kind, 4, torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=1.0, top_p=0.5, logprobs=2)  # a flat row's nucleus: 500 tokens
    sampler = Sampler({0}, CPU, seed=0)
    with monkeypatch.context() as patch:
        calls = _count(patch)
        tokens, logprobs = sampler(logits, [Request(f"r{i}", [1], params) for i in range(4)])
    assert sum(calls[name] for name in SYNCS) == reads, calls
    kept = sort_filter(logits, _settings([0] * 4, [0.5] * 4, [0.0] * 4, VOCAB)) > NEG_INF
    assert all(kept[i, t] for i, t in enumerate(tokens))
    assert [lp.token_id for lp in logprobs] == tokens
