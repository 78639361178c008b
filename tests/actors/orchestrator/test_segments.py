"""Every segment of a multi-segment episode trains as its own sample (records/rollout.py): an agent
episode whose harness rewrote its history (the gateway's token record, actors/gateway/episodes.py)
becomes one rollout of two segments; the rollout pool gives each segment its ledger sample, the
train step one batch row each with the episode's reward and group, a real learner gives the
segments of one episode one advantage and trains them, and the ledger balances with every
segment trained (or dropped with its episode)."""
from __future__ import annotations

import pytest
import trio

from postrain.actors.env.agent import segments_rollout
from postrain.actors.env.api import Reward
from postrain.actors.env.user_errors import EnvironmentErrors
from postrain.actors.gateway.episodes import Choice, EpisodeTokens
from postrain.actors.orchestrator.ledger import SampleLedger, read_events, segment_id
from postrain.actors.learner.learner import Learner, LearnerConfig
from postrain.actors.models.tokenizer import byte_tokenizer
from postrain.actors.tasks import TaskMixture, get_task
from postrain.actors.orchestrator.admission import AdmittedBatch
from postrain.actors.orchestrator.rollout_pool import RolloutPool
from postrain.actors.orchestrator.sample_log import segment_advantages
from postrain.actors.orchestrator.train_step import GROUP_INCOMPLETE, surviving_groups, train_batch, train_rows
from postrain.actors.orchestrator.work import WorkSignal
from postrain.actors.records import ROLLOUT, SamplingParams

TINY = dict(vocab_size=264, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
            num_kv_heads=2, max_position_embeddings=512, tie_word_embeddings=True)


def agent_episode(edit: bool, reward: float):
    """An agent episode through the gateway's token record, the test playing the generator: two
    calls, the second after the harness replaced its history when `edit` (a second segment)."""
    tokenizer = byte_tokenizer()
    episode, calls = EpisodeTokens(tokenizer), []

    def call(messages, text):
        prompt = episode.prepare(messages, [])
        ids = tokenizer.encode(text, add_bos=False) + [tokenizer.eos_token_ids[-1]]
        version = len(calls)
        episode.record(messages, [], prompt, [Choice({"role": "assistant", "content": text}, ids,
                                                     [-0.25] * len(ids), [version] * len(ids))])
        calls.append((list(prompt.token_ids), ids))
        return {"role": "assistant", "content": text}

    messages = [{"role": "user", "content": "Add 1 and 12."}]
    messages += [call(messages, "13"), {"role": "user", "content": "And 2 and 12?"}]
    if edit:   # the harness compacts: its history is replaced by a summary
        messages = [{"role": "user", "content": "Sums so far: 13. Add 2 and 12."}]
    call(messages, "14")
    rollout = segments_rollout([s.record() for s in episode.finish()], Reward({"correct": reward}))
    return rollout, calls


class ReplayEnv:
    """An environment actor's replies, replayed: each prompt's rollouts in turn (the rollout pool
    asks it for `rollout`; trio runs the pool's tasks in any order)."""

    def __init__(self, by_question: dict[str, list]):
        self.name, self.by_question = "env", {q: list(rollouts) for q, rollouts in by_question.items()}

    async def call(self, kind, request, timeout_s=None):
        assert kind is ROLLOUT, kind
        return self.by_question[request.task["question"]].pop(0)


class Keeper:
    published_version = 0


def generate(ledger, groups: list[list]) -> AdmittedBatch:
    """The rollout pool's generation of batch 0, its prompt g's rollouts `groups[g]`, replayed."""
    env = ReplayEnv({f"q{g}": rollouts for g, rollouts in enumerate(groups)})
    pool = RolloutPool([env], Keeper(), ledger, max_concurrent_rollouts=2, max_rollout_retries=0,
                       work=WorkSignal(None, None), generators=["generator"],
                       errors=EnvironmentErrors(1.0, show=lambda line: None))
    batch = AdmittedBatch(0, sum(map(len, groups)), [[] for _ in groups])
    task = TaskMixture.single(get_task("arithmetic")).tasks[0]
    prompts = [(task, {"question": f"q{g}"}) for g in range(len(groups))]
    trio.run(pool.generate_batch, batch, prompts, len(groups[0]), SamplingParams(), 0)
    return batch


def test_every_segment_of_an_agent_episode_trains_with_the_episodes_advantage(tmp_path):
    (edited, edited_calls), (plain, _), (other, _) = (agent_episode(True, 1.0), agent_episode(False, 0.0),
                                                      agent_episode(True, 0.0))
    assert edited.num_segments == 2 and plain.num_segments == 1
    # each segment holds exactly what was sampled in its context (the generator's record: calls)
    for segment, (prompt, ids) in zip(edited.segments(), edited_calls, strict=True):
        start = segment.loss_mask.index(1)
        assert segment.token_ids[:start] == prompt and segment.token_ids[start:start + len(ids)] == ids
    ledger = SampleLedger(tmp_path / "ledger.jsonl")
    batch = generate(ledger, [[edited, plain], [other, plain]])
    groups = surviving_groups(batch.groups, ledger)
    rows = train_rows(groups)
    # one row per segment, oldest first, each its own ledger id; group ids and rewards the episode's
    episode = next(s for s in groups[0] if s.rollout.num_segments == 2)
    at = [sid for _, _, sid, _ in rows].index(episode.sample_id)
    assert [sid for _, _, sid, _ in rows][at:at + 2] == [episode.sample_id, segment_id(episode.sample_id, 1)]
    assert len(rows) == 6 and len({sid for _, _, sid, _ in rows}) == 6
    train = train_batch(groups)
    assert list(train.group_ids) == [0, 0, 0, 1, 1, 1]
    assert list(train.rewards) == [s.reward.total for _, s, _, _ in rows]
    assert [list(x) for x in train.token_ids[at:at + 2]] == [s.token_ids for s in edited.segments()]
    # a real learner: the segments of one episode share its advantage, and every row trains
    learner = Learner(LearnerConfig(model=TINY, micro_batch_size=3))
    _, advantages = learner.batch_advantages(train)
    mine = [float(a) for (_, s, _, _), a in zip(rows, advantages) if s is episode]
    others = [float(a) for (g, s, _, _), a in zip(rows, advantages) if g == 0 and s is not episode]
    assert len(mine) == 2 and mine[0] == mine[1] > 0 > others[0]
    assert segment_advantages(groups[0])[groups[0].index(episode)] == pytest.approx(mine[0], abs=1e-4)
    metrics = learner.train_step(train)
    assert learner.policy_version == 1 and metrics["loss"] == metrics["loss"]   # a finite step
    for _, _, sid, _ in rows:
        ledger.advance(sid, "trained", step=1)
    ledger.check()
    counts = ledger.counts()
    assert counts["created"] == counts["trained"] == 6 and counts["in_flight"] == 0
    events = read_events(tmp_path / "ledger.jsonl")
    notes = {e["sample_id"]: e["segment_ids"] for e in events if e["event"] == "segments"}
    assert notes[episode.sample_id] == [segment_id(episode.sample_id, 1)] and len(notes) == 2
    created = next(e for e in events if e["sample_id"] == segment_id(episode.sample_id, 1) and e["event"] == "created")
    assert created["segment_of"] == episode.sample_id and created["group"] == 0


def test_an_episode_dropped_with_its_group_drops_every_segment(tmp_path):
    edited, _ = agent_episode(True, 1.0)
    ledger = SampleLedger(tmp_path / "ledger.jsonl")
    batch = generate(ledger, [[edited]])   # a group of one: no baseline
    assert surviving_groups(batch.groups, ledger) == []
    ledger.check()
    assert ledger.counts()["dropped"] == 2 and ledger.drop_reasons == {GROUP_INCOMPLETE: 2}
