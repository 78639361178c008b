"""The scorer role: its records and options, and real ScorerActor processes (real ZeroMQ, under a
supervisor) answering what they serve (score_tokens, generate, score_reward) and refusing what
they do not, naming their `serves`."""
from __future__ import annotations

import anyio
import numpy as np
import pytest
import torch

from postrain.actors.generator.engine import Engine
from postrain.actors.generator.sampling import SamplingParams
from postrain.actors.models.loading import load_model
from postrain.actors.models.tokenizer import byte_tokenizer
from postrain.actors.records import (CHAT, GENERATE, SCORE_CONTINUATIONS, SCORE_REWARD, SCORE_TOKENS, ChatRequest,
                                     ContinuationsRequest, GenerateRequest, RecordError, RewardScoresReply,
                                     RewardScoresRequest, SequenceScores,
                                     TokenScoresReply, TokenScoresRequest)
from postrain.actors.scorer import ScorerActor
from postrain.actors.scorer.local import LocalChatScorer
from postrain.core import ActorSpec, RemoteError, Supervisor, wire
from postrain.core.errors import ConfigError
from postrain.core.options import validate_options
from postrain.core.testing import async_test

PROMPT = [1, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]      # 13 byte tokens
COMPLETIONS = [[33, 33, 2], [63, 10, 63, 10, 45], [46]]
K = 6


def scorer(name: str, **options) -> ActorSpec:
    return ActorSpec(name=name, cls="postrain.actors.scorer:ScorerActor", cpus=0.5, memory_mb=0, max_restarts=0,
                     options={"kv_cache_mb": 4, **options})


def save_reward_folder(folder):
    """A tiny random LlamaForSequenceClassification (num_labels 1) saved by transformers."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=264, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      num_labels=1, pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForSequenceClassification(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.2)
    model.save_pretrained(folder)
    byte_tokenizer().save(folder)        # the byte vocabulary (264) with ChatML: it reads conversations
    return model


# ----------------------------------------------------------------------------- records

def test_token_scores_travel_as_arrays_and_come_back_equal():
    T = 5
    rows = SequenceScores(topk_ids=np.arange(T * K, dtype=np.int32).reshape(T, K),
                          topk_logprobs=-np.ones((T, K), np.float32), tail_logmass=np.full(T, -3.0, np.float32),
                          token_logprobs=np.linspace(-1, 0, T, dtype=np.float32))
    reply = TokenScoresReply(sequences=[rows, rows], model="tiny")
    frames = wire.encode(wire.Message("reply", 1, 1, "teacher", None, reply.to_wire()))
    assert len(frames) == 1 + 8                       # the envelope and one frame per array
    back = TokenScoresReply.from_wire(wire.decode(frames).body)
    assert back.model == "tiny" and back.policy_version == 0 and len(back.sequences) == 2
    for name in ("topk_ids", "topk_logprobs", "tail_logmass", "token_logprobs"):
        got, want = getattr(back.sequences[1], name), getattr(rows, name)
        assert got.dtype == want.dtype and got.shape == want.shape and np.array_equal(got, want)
    assert back.sequences[0].top_k == K


def test_bad_scorer_records_are_refused_by_name():
    with pytest.raises(RecordError, match=r"score_from must be one entry per sequence \(2\)"):
        TokenScoresRequest(token_ids=[[1, 2], [3, 4]], score_from=[1])
    with pytest.raises(RecordError, match=r"score_from must be in \[1, len\(token_ids\[i\]\)\] \(sequence 0: 0"):
        TokenScoresRequest(token_ids=[[1, 2]], score_from=[0])
    with pytest.raises(RecordError, match=r"sequence 0: 3, its length 2"):
        TokenScoresRequest(token_ids=[[1, 2]], score_from=[3])
    with pytest.raises(RecordError, match=r"at least 2 tokens \(sequence 0 has 1\)"):
        TokenScoresRequest(token_ids=[[1]], score_from=[1])
    with pytest.raises(RecordError, match=r"top_k must be >= 1"):
        TokenScoresRequest(token_ids=[[1, 2]], score_from=[1], top_k=0)
    with pytest.raises(RecordError, match=r"tail_logmass must be one row per token \(3, as topk_ids\)"):
        SequenceScores(topk_ids=np.zeros((3, 2), np.int32), topk_logprobs=np.zeros((3, 2), np.float32),
                       tail_logmass=np.zeros(2, np.float32), token_logprobs=np.zeros(3, np.float32))
    with pytest.raises(RecordError, match=r"topk_logprobs must be of topk_ids' shape \(3, 2\)"):
        SequenceScores(topk_ids=np.zeros((3, 2), np.int32), topk_logprobs=np.zeros((3, 4), np.float32),
                       tail_logmass=np.zeros(3, np.float32), token_logprobs=np.zeros(3, np.float32))
    with pytest.raises(RecordError, match="sequence 1 is empty"):
        RewardScoresRequest(token_ids=[[1], []])
    for continuations in ([], ["PASS", "PASS"], [""]):
        with pytest.raises(RecordError, match=r"ContinuationsRequest.continuations must be"):
            ContinuationsRequest(messages=[{"role": "user", "content": "x"}], continuations=continuations)


# ----------------------------------------------------------------------------- options

def test_scorer_options_name_each_bad_field(tmp_path):
    options = validate_options(ScorerActor, {"model": "tiny"})
    assert (options.serves, options.top_k, options.max_num_batched_tokens) == ("logprobs", 32, 4096)
    with pytest.raises(ConfigError, match=r"options.model: Field required"):
        validate_options(ScorerActor, {"serves": "logprobs"})
    with pytest.raises(ConfigError, match=r"options.serves = 'logits'.*'logprobs', 'generate' or 'reward'"):
        validate_options(ScorerActor, {"model": "tiny", "serves": "logits"})
    with pytest.raises(ConfigError, match=r"options.top_kk = 3: unknown field"):
        validate_options(ScorerActor, {"model": "tiny", "top_kk": 3})
    with pytest.raises(ConfigError, match=r"top_k = 0: Input should be greater than or equal to 1"):
        validate_options(ScorerActor, {"model": "tiny", "top_k": 0})
    with pytest.raises(ConfigError, match=r"top_k = 300 is more than the model's vocabulary \(264\)"):
        validate_options(ScorerActor, {"model": "tiny", "top_k": 300})
    with pytest.raises(ConfigError, match=r"reward model 'tiny' is no such folder.*ForSequenceClassification"):
        validate_options(ScorerActor, {"model": "tiny", "serves": "reward"})
    save_reward_folder(tmp_path / "rm")
    with pytest.raises(ConfigError, match=r"is a reward model .*serves \"reward\" only, not 'logprobs'"):
        validate_options(ScorerActor, {"model": str(tmp_path / "rm")})
    assert validate_options(ScorerActor, {"model": str(tmp_path / "rm"), "serves": "reward"}).serves == "reward"


# ----------------------------------------------------------------------------- real actors

@async_test
async def test_scorer_actors_answer_what_they_serve_and_refuse_the_rest(tmp_path):
    model, tokenizer = load_model("tiny", seed=0)                 # what the actors load: the same weights
    sequences = [PROMPT + c for c in COMPLETIONS]
    hf_rm = save_reward_folder(tmp_path / "rm")
    async with Supervisor.open(heartbeat_interval_s=0.2) as sup:
        async with anyio.create_task_group() as starting:         # the processes import at once
            starting.start_soon(sup.start, scorer("teacher", model="tiny", serves="logprobs", top_k=K))
            starting.start_soon(sup.start, scorer("judge", model="tiny", serves="generate"))
            starting.start_soon(sup.start, scorer("rm", model=str(tmp_path / "rm"), serves="reward",
                                                  reward_scale=2.0, reward_offset=1.0))
        teacher, judge, rm = sup.ref("teacher"), sup.ref("judge"), sup.ref("rm")

        # a teacher: a group's sequences sharing their prompt, rows from the first completion token on
        request = TokenScoresRequest(token_ids=[np.array(s, dtype=np.int64) for s in sequences],
                                     score_from=[len(PROMPT)] * 3)
        reply = await teacher.call(SCORE_TOKENS, request, timeout_s=60)
        assert isinstance(reply, TokenScoresReply) and reply.model == "tiny" and reply.policy_version == 0
        for rows, ids in zip(reply.sequences, sequences):
            rows = SequenceScores(*(np.array(getattr(rows, name)) for name in  # writable copies of the frames
                                    ("topk_ids", "topk_logprobs", "tail_logmass", "token_logprobs")))
            with torch.no_grad():
                logprobs = torch.log_softmax(model(torch.tensor([ids]))[0].float(), -1)
            want = logprobs[len(PROMPT) - 1:-1]
            assert rows.topk_ids.shape == (len(ids), K) and not rows.topk_ids[:len(PROMPT)].any()
            torch.testing.assert_close(torch.from_numpy(rows.topk_logprobs[len(PROMPT):]), want.topk(K).values,
                                       rtol=0, atol=1e-5)
            torch.testing.assert_close(torch.from_numpy(rows.token_logprobs[len(PROMPT):]),
                                       want.gather(1, torch.tensor(ids[len(PROMPT):])[:, None])[:, 0], rtol=0, atol=1e-5)
        # a request's own top_k
        small = await teacher.call(SCORE_TOKENS, TokenScoresRequest(token_ids=[sequences[0]], score_from=[1],
                                                                    top_k=2), timeout_s=60)
        assert small.sequences[0].topk_ids.shape == (len(sequences[0]), 2)

        # a judge: a frozen generator, the generator's reply
        params = SamplingParams(temperature=0.0, max_new_tokens=5, ignore_eos=True)
        generated = await judge.call(GENERATE, GenerateRequest(prompt_ids=PROMPT, sampling=params), timeout_s=60)
        local = Engine(model, tokenizer, num_blocks=32).generate([PROMPT], params)[0].outputs[0]
        assert generated.prompt_len == len(PROMPT) and generated.samples[0].token_ids == local.token_ids
        assert generated.samples[0].policy_versions == [0] * 5
        messages = [{"role": "user", "content": "Grade this."}]
        chat = await judge.call(CHAT, ChatRequest(messages=messages, sampling=params), timeout_s=60)
        rendered = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
        local = Engine(model, tokenizer, num_blocks=32).generate([rendered], params)[0].outputs[0]
        assert (chat.text, chat.prompt_tokens, chat.completion_tokens) == (local.text, len(rendered), 5)
        # ... and a choice judge's continuations, as the in-process handle scores them
        choose = ContinuationsRequest(messages=messages, continuations=["PASS", "FAIL"], prefix="VERDICT: ")
        choice = await judge.call(SCORE_CONTINUATIONS, choose, timeout_s=60)
        alone = await LocalChatScorer(Engine(model, tokenizer, num_blocks=32)).score_continuations(
            messages, ["PASS", "FAIL"], prefix="VERDICT: ")
        assert (choice.num_tokens, choice.prompt_tokens) == (alone.num_tokens, alone.prompt_tokens)
        assert choice.logprobs == pytest.approx(alone.logprobs, abs=1e-5)

        # a reward model: the score head on each sequence's last token, as transformers gives it
        rewarded = [PROMPT, PROMPT + COMPLETIONS[1], [5, 6]]
        with torch.no_grad():
            want = [float(hf_rm(torch.tensor([ids])).logits[0, 0]) for ids in rewarded]
        scores = await rm.call(SCORE_REWARD, RewardScoresRequest(token_ids=rewarded), timeout_s=60)
        assert isinstance(scores, RewardScoresReply)
        assert scores.scores == pytest.approx([2 * w + 1 for w in want], abs=2e-4)   # the declared scale
        # ... or conversations, rendered by the reward model's own tokenizer and template
        conversation = [{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": "5"}]
        ids = byte_tokenizer().encode(byte_tokenizer().apply_chat_template(conversation, add_generation_prompt=False))
        with torch.no_grad():
            want_text = float(hf_rm(torch.tensor([ids])).logits[0, 0])
        scores = await rm.call(SCORE_REWARD, RewardScoresRequest(conversations=[conversation]), timeout_s=60)
        assert scores.scores == pytest.approx([2 * want_text + 1], abs=2e-4)

        # each refuses the uses it does not serve, naming its serves
        with pytest.raises(RemoteError, match=r"scorer 'teacher' serves 'logprobs'.*not 'generate'.*serves = "
                                              r"'generate'"):
            await teacher.call(GENERATE, GenerateRequest(prompt_ids=PROMPT), timeout_s=60)
        with pytest.raises(RemoteError, match=r"scorer 'judge' serves 'generate'.*not 'score_tokens'"):
            await judge.call(SCORE_TOKENS, request, timeout_s=60)
        with pytest.raises(RemoteError, match=r"scorer 'teacher' serves 'logprobs'.*not 'score_reward'.*'reward'"):
            await teacher.call(SCORE_REWARD, RewardScoresRequest(token_ids=[PROMPT]), timeout_s=60)
        with pytest.raises(RemoteError, match=r"scorer 'rm' serves 'reward'.*not 'generate'"):
            await rm.call(GENERATE, GenerateRequest(prompt_ids=PROMPT), timeout_s=60)
        with pytest.raises(RemoteError, match=r"scorer 'teacher' serves 'logprobs'.*not 'chat'"):
            await teacher.call(CHAT, ChatRequest(messages=messages), timeout_s=60)
        with pytest.raises(RemoteError, match=r"scorer 'teacher' serves 'logprobs'.*not 'score_continuations'"):
            await teacher.call(SCORE_CONTINUATIONS, choose, timeout_s=60)
        # an engine refusal reaches the caller, and the teacher goes on
        with pytest.raises(RemoteError, match=r"top_k must be in \[1, 264\]"):
            await teacher.call(SCORE_TOKENS, TokenScoresRequest(token_ids=[PROMPT], score_from=[1], top_k=999),
                               timeout_s=60)

        # their heartbeats carry a load the head and the balancer read
        with anyio.fail_after(10):
            while (sup.records["teacher"].load is None or sup.records["judge"].load is None
                   or sup.records["teacher"].load.served < 2):
                await anyio.sleep(0.05)
        load = sup.records["teacher"].load
        assert load.figures["serves"] == "logprobs" and load.queued == 0 and load.running == 0
        assert load.figures["prefix_hit_rate"] > 0            # the group's later samples found the prompt
        assert sup.records["judge"].load.figures["serves"] == "generate"
        assert sup.records["rm"].load.figures == {"serves": "reward"}
