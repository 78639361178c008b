"""The records that cross between roles: the same dicts on the wire as before, and a wrong field
fails where the message is made, naming the record and the field."""
import pytest
import torch

from postrain.actors.records import (GeneratedSample, GenerateReply, GenerateRequest, PublishReport,
                                     RecordError, Rollout, RolloutRequest, SamplingParams,
                                     SamplingParamsError, SftBatch, TrainBatch, WeightSync)
from postrain.actors.env import Reward
from postrain.core import wire

ROLLOUT = {"token_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 1, 1], "behavior_logprobs": [0.0, 0.0, -0.5, -0.25],
           "policy_versions": [-1, -1, 3, 4], "reward": {"components": {"correct": 1.0}, "weights": {}},
           "num_turns": 1, "num_policy_tokens": 2, "tool_statuses": ["ok"],
           "timeline": [{"hop": "episode", "actor": "env", "start": 1.0, "duration_ms": 2.0}]}


def test_a_rollout_travels_as_the_same_dict_and_comes_back_equal():
    rollout = Rollout.from_wire(ROLLOUT)
    assert rollout.to_wire() == ROLLOUT
    assert rollout.reward == Reward({"correct": 1.0}) and rollout.oldest_policy_version(default=9) == 3
    frames = wire.encode(wire.Message("reply", 1, 1, "env", None, rollout.to_wire()))
    assert Rollout.from_wire(wire.decode(frames).body) == rollout


def test_a_wrong_key_or_value_fails_where_the_message_is_made():
    with pytest.raises(RecordError, match=r"Rollout has no field\(s\) \['num_turn'\]"):
        Rollout.from_wire({**{k: v for k, v in ROLLOUT.items() if k != "num_turns"}, "num_turn": 1})
    with pytest.raises(RecordError, match=r"Rollout needs field\(s\) \['reward'\]"):
        Rollout.from_wire({k: v for k, v in ROLLOUT.items() if k != "reward"})
    with pytest.raises(RecordError, match="Rollout.num_turns must be of type int, got str"):
        Rollout.from_wire({**ROLLOUT, "num_turns": "1"})
    with pytest.raises(RecordError, match=r"Rollout.loss_mask must be one entry per token \(4\)"):
        Rollout.from_wire({**ROLLOUT, "loss_mask": [0, 1]})
    with pytest.raises(RecordError, match=r"num_policy_tokens must be sum\(loss_mask\) = 2"):
        Rollout.from_wire({**ROLLOUT, "num_policy_tokens": 3})
    with pytest.raises(SamplingParamsError, match=r"unknown sampling field\(s\) \['temprature'\]"):
        RolloutRequest.from_wire({"task": {"question": "1+1"}, "sampling": {"temprature": 0.5}})
    with pytest.raises(SamplingParamsError, match="temperature must be >= 0"):
        GenerateRequest(prompt_ids=[1], sampling=SamplingParams(temperature=-1))


def test_generate_messages_keep_their_shape():
    request = GenerateRequest.from_wire({"prompt_ids": [1, 2], "sampling": {"max_new_tokens": 8, "n": 2}})
    assert request.sampling.max_new_tokens == 8 and request.to_wire()["prompt_ids"] == [1, 2]
    assert GenerateRequest.from_wire({"prompt": "hi"}).sampling == SamplingParams()
    with pytest.raises(RecordError, match="exactly one of the two"):
        GenerateRequest(prompt_ids=[1], prompt="hi")
    sample = {"token_ids": [3], "logprobs": [-0.1], "policy_versions": [0], "finish_reason": None,
              "text": "a"}
    reply = GenerateReply(prompt_len=2, samples=[GeneratedSample.from_wire(sample)])
    assert reply.to_wire() == {"prompt_len": 2, "samples": [sample]}
    assert GenerateReply.from_wire(reply.to_wire()) == reply


def test_batches_take_tensors_and_check_one_entry_per_sample():
    ids = [torch.arange(6), torch.arange(6)]
    batch = TrainBatch(token_ids=ids, loss_mask=[[0, 1, 1, 1, 1, 1]] * 2,
                       behavior_logprobs=[torch.zeros(6)] * 2, policy_versions=[0, 0], rewards=[1.0, 0.0],
                       group_ids=[0, 0])
    assert set(batch.to_wire()) == {"token_ids", "loss_mask", "behavior_logprobs", "policy_versions",
                                    "rewards", "group_ids"}
    with pytest.raises(RecordError, match=r"TrainBatch.rewards must be one entry per sample \(2"):
        TrainBatch(token_ids=ids, loss_mask=[[0] * 6] * 2, behavior_logprobs=[[0.0] * 6] * 2, rewards=[1.0])
    with pytest.raises(RecordError, match="TrainBatch.advantages must be given, or rewards"):
        TrainBatch(token_ids=ids, loss_mask=[[0] * 6] * 2, behavior_logprobs=[[0.0] * 6] * 2)
    with pytest.raises(RecordError, match=r"SftBatch has no field\(s\) \['rewards'\]"):
        SftBatch.from_wire({"token_ids": ids, "loss_mask": [[0] * 6] * 2, "rewards": [1.0, 1.0]})


def test_weight_syncs_and_publish_reports():
    assert WeightSync(3, {}).to_wire() == {"version": 3, "weights": {}}
    assert not WeightSync(3, {}, chunk=0, num_chunks=2).completes_version
    with pytest.raises(RecordError, match="both or neither"):
        WeightSync(3, {}, chunk=0)
    report = {"version": 2, "num_bytes": 10, "num_messages": 1, "sync_s": {"gen": 0.5}, "total_s": 0.6}
    assert PublishReport.from_wire(report).to_wire() == report
