"""Stop strings (SamplingParams.stop, include_stop_str_in_output) in the offline API, vLLM's semantics:
the text is cut where a stop string first appears, finish_reason is "stop" and stop_reason the string;
and the OutputProcessor's matching on text that arrives token by token, multi-byte characters included."""
from __future__ import annotations

import pytest

from roseinfer import LLM, SamplingParams
from roseinfer.engine.outputs import EngineCoreOutput
from roseinfer.output_processor import OutputProcessor
from roseinfer.sampling_params import RequestOutputKind
from roseinfer.stop_strings import StopStringMatcher
from roseinfer.tokenizer import Tokenizer

PROMPT = "The cat sees a red apple"
MAX_TOKENS = 40


def greedy(max_tokens: int = MAX_TOKENS, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


@pytest.fixture(scope="module")
def llm(tiny_model_factory) -> LLM:
    return LLM(str(tiny_model_factory("llama")), num_kv_blocks=64)


@pytest.fixture(scope="module")
def full(llm: LLM) -> tuple[list[int], str]:
    out = llm.generate(PROMPT, greedy(), use_tqdm=False)[0]
    assert out.finish_reason == "length" and out.stop_reason is None
    return out.token_ids, out.text


def _token_ends(llm: LLM, ids: list[int]) -> list[int]:
    """The text length after each output token (the prompt's context included, as the stream decodes)."""
    prompt = llm.tokenizer.encode(PROMPT)
    return [len(llm.tokenizer.decode(prompt + ids[:i + 1])) - len(llm.tokenizer.decode(prompt)) for i in range(len(ids))]


def _spanning_stop(llm: LLM, ids: list[int], text: str) -> tuple[str, int]:
    """A stop string that begins inside one token's text and ends inside a later one's, and where it begins."""
    ends = _token_ends(llm, ids)
    start = ends[len(ends) // 3] - 1  # the last character of a token a third of the way in
    stop = text[start:start + 6]
    assert len(stop) == 6 and sum(start < e < start + 6 for e in ends) >= 1, "the stop must span a token boundary"
    return stop, text.index(stop)


def test_a_stop_spanning_tokens_cuts_the_text_and_ends_the_request(llm: LLM, full: tuple[list[int], str]) -> None:
    ids, text = full
    stop, at = _spanning_stop(llm, ids, text)
    out = llm.generate(PROMPT, greedy(stop=[stop, "never-appears-xyz"]), use_tqdm=False)[0]
    assert out.text == text[:at]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    # the request ended once the stop's text appeared: its tokens are a prefix of the full run's
    assert len(out.token_ids) < MAX_TOKENS and out.token_ids == ids[:len(out.token_ids)]
    assert llm.tokenizer.decode(out.token_ids).find(stop) == at
    assert llm.kv_cache_stats()["used_blocks"] == 0


def test_include_stop_str_in_output_keeps_the_stop_and_nothing_after(llm: LLM, full: tuple[list[int], str]) -> None:
    ids, text = full
    stop, at = _spanning_stop(llm, ids, text)
    out = llm.generate(PROMPT, greedy(stop=[stop], include_stop_str_in_output=True), use_tqdm=False)[0]
    assert out.text == text[:at + len(stop)]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)


def test_of_several_stops_the_earliest_in_the_text_wins(llm: LLM, full: tuple[list[int], str]) -> None:
    ids, text = full
    early, late = text[len(text) // 4:len(text) // 4 + 3], text[len(text) // 2:len(text) // 2 + 4]
    assert text.index(early) < text.index(late)
    for stops in ([late, early], [early, late]):
        out = llm.generate(PROMPT, greedy(stop=stops), use_tqdm=False)[0]
        assert (out.text, out.stop_reason) == (text[:text.index(early)], early)


def test_max_tokens_before_the_stop_appears_ends_by_length(llm: LLM, full: tuple[list[int], str]) -> None:
    ids, text = full
    stop = text[-5:]
    short = 8
    assert stop not in llm.tokenizer.decode(ids[:short])
    out = llm.generate(PROMPT, greedy(short, stop=[stop]), use_tqdm=False)[0]
    assert (out.token_ids, out.finish_reason, out.stop_reason) == (ids[:short], "length", None)
    assert out.text == llm.tokenizer.decode(ids[:short])  # text held back for the stop comes out at the end


def test_stops_that_never_match_change_nothing(llm: LLM, full: tuple[list[int], str]) -> None:
    ids, text = full
    # each could start at many places in the text (its first character is common), so text is held back often
    stops = [text[0] + "\x00never", " " + "\x01" * 3]
    outs = llm.generate([PROMPT, PROMPT], [greedy(stop=stops), greedy(stop=stops, include_stop_str_in_output=True)],
                        use_tqdm=False)
    for out in outs:
        assert (out.token_ids, out.text, out.finish_reason, out.stop_reason) == (ids, text, "length", None)


def test_a_stop_token_id_is_the_stop_reason(llm: LLM, full: tuple[list[int], str]) -> None:
    ids, _ = full
    position = next(j for j in range(2, len(ids)) if ids[j] not in ids[:j])
    out = llm.generate(PROMPT, greedy(stop_token_ids=[ids[position]]), use_tqdm=False)[0]
    assert (out.token_ids, out.finish_reason, out.stop_reason) == (ids[:position + 1], "stop", ids[position])


def test_an_empty_stop_string_is_refused() -> None:
    with pytest.raises(ValueError, match="stop strings"):
        SamplingParams(stop=["a", ""])
    assert SamplingParams(stop="ab").stop == ["ab"]


def _feed(tokenizer: Tokenizer, params: SamplingParams, prompt: list[int], ids: list[int],
          final_only: bool = False) -> tuple[str, list]:
    """The processor fed one token per step; the text it released and its deltas."""
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", prompt, params, final_only)
    deltas = []
    for i, token in enumerate(ids):
        last = i == len(ids) - 1
        out = EngineCoreOutput("r", [token], "length" if last else None, num_prompt_tokens=len(prompt))
        processed = processor.process([out], float(i))
        deltas += [d for _, d in processed.deltas]
        if processed.stopped_ids:
            assert processed.stopped_ids == ["r"] and not last
            break
    assert deltas[-1].finished and not processor.has_requests()
    return "".join(d.text for d in deltas), deltas


@pytest.fixture(scope="module")
def tokenizer(tiny_model_factory) -> Tokenizer:
    return Tokenizer(tiny_model_factory("llama"))


@pytest.mark.parametrize("final_only", [False, True])
def test_multibyte_characters_split_across_tokens(tokenizer: Tokenizer, final_only: bool) -> None:
    prompt = tokenizer.encode("A note:")
    text = " caf\u00e9 \u732b and \u732b\u732b end"
    ids = tokenizer.encode(text)
    assert len(tokenizer.encode("\u732b")) > 1, "the character must take several tokens (its UTF-8 bytes)"
    assert tokenizer.decode(prompt + ids).endswith(text)
    plain, deltas = _feed(tokenizer, greedy(), prompt, ids, final_only)
    assert plain == text and "\ufffd" not in "".join(d.text for d in deltas)
    cut, deltas = _feed(tokenizer, greedy(stop=["\u732b\u732b"]), prompt, ids, final_only)
    assert cut == " caf\u00e9 \u732b and " and (deltas[-1].finish_reason, deltas[-1].stop_reason) == ("stop", "\u732b\u732b")
    kept, _ = _feed(tokenizer, greedy(stop=["\u732b a"], include_stop_str_in_output=True), prompt, ids, final_only)
    assert kept == " caf\u00e9 \u732b a"
    # a stop right after a character whose bytes span tokens: the character comes out whole
    after, _ = _feed(tokenizer, greedy(stop=[" and"]), prompt, ids, final_only)
    assert after == " caf\u00e9 \u732b"


def test_final_only_output_is_one_delta_with_the_streamed_text(tokenizer: Tokenizer) -> None:
    """A FINAL_ONLY request (the server's non-streaming ones) is decoded once at the end, to the text its
    deltas would have streamed; with a stop string it is still matched token by token."""
    prompt = tokenizer.encode("A note:")
    ids = tokenizer.encode(" caf\u00e9 \u732b and \u732b\u732b end")
    final = RequestOutputKind.FINAL_ONLY
    streamed, deltas = _feed(tokenizer, greedy(), prompt, ids)
    assert len(deltas) == len(ids)
    whole, deltas = _feed(tokenizer, greedy(output_kind=final), prompt, ids)
    assert whole == streamed and len(deltas) == 1
    assert (deltas[0].token_ids, deltas[0].num_output_tokens, deltas[0].finish_reason) == (ids, len(ids), "length")
    cut, deltas = _feed(tokenizer, greedy(stop=["\u732b\u732b"], output_kind=final), prompt, ids)
    assert cut == " caf\u00e9 \u732b and " and len(deltas) == 1 and deltas[0].stop_reason == "\u732b\u732b"


def test_matcher_with_include_keeps_the_stop_and_holds_nothing_back() -> None:
    matcher = StopStringMatcher(["world", "wx"], include_in_output=True)
    assert matcher.add("hello w") == ("hello w", False)  # nothing held: the stop would be shown anyway
    assert matcher.add("or") == ("or", False)
    assert matcher.add("ld and more") == ("ld", True)  # a match that began in released text ends here
    assert matcher.matched == "world" and matcher.flush() == ""


def test_stop_strings_count_only_past_min_tokens(tokenizer: Tokenizer) -> None:
    """vLLM's rule: a stop string that ends within the first min_tokens tokens does not stop the output."""
    prompt = tokenizer.encode("A note:")
    ids = tokenizer.encode(" cat dog cat dog")
    k = next(k for k in range(1, len(ids)) if tokenizer.decode(prompt + ids[:k]).endswith(" cat dog"))
    early, _ = _feed(tokenizer, greedy(stop=["cat"]), prompt, ids)
    assert early == " "
    late, deltas = _feed(tokenizer, greedy(stop=["cat"], min_tokens=k), prompt, ids)
    assert late == " cat dog " and deltas[-1].stop_reason == "cat"
    kept, _ = _feed(tokenizer, greedy(stop=["cat"], min_tokens=k, include_stop_str_in_output=True), prompt, ids)
    assert kept == " cat dog cat"
    never, deltas = _feed(tokenizer, greedy(stop=["cat"], min_tokens=len(ids) - 1), prompt, ids)
    assert never == " cat dog cat dog" and deltas[-1].finish_reason == "length"
