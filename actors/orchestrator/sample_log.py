"""samples.jsonl: what the model said, one line per RL sample whose rollout came back.

The ledger (ledger.jsonl) keeps each sample's life small: states, timings, token counts,
rewards. This file keeps its text, beside it in the run folder: the prompt, each turn's
completion and the tool output the model read next, decoded from the exact tokens the
rollout carries (tokens in, tokens out: the prompt is the ids before the first sampled one;
each run of sampled ids, loss mask 1, is a completion; each run of ids after it that the
environment appended, loss mask 0, is the tool's output in the chat template's framing),
and `cause`: why the environment says the episode ended so (`Episode.cause`; null when it
names none). Each text is bounded to `max_chars` characters: its head and its tail stay,
and the cut is marked where it was, `[... 1234 characters cut ...]`.

One line per sample, written by the train step (train_step.py) when its batch is trained:

    {"sample_id": "b0-g0-s0", "step": 1, "batch": 0, "group": 0, "task": "arithmetic",
     "outcome": "trained" | "dropped: REASON", "reward": 1.1, "cause": "wrong_unit" | null,
     "components": {"correct": 1.0},
     "advantage": 0.71, "staleness": 0, "policy_tokens": 24, "num_turns": 2,
     "prompt": "...", "turns": [{"completion": "...", "tool_output": "..."}, ...]}

`advantage` is GRPO's group-relative advantage of the total reward, (r - group mean) / (group
std + eps), 0 in a group whose rewards are all equal (ext/advantages.py): the learner's own
with its default `advantage_mode = "grpo"` (with "dr_grpo" or "rloo" the learner's differs
in scale, not in sign), over the samples of its group that came back (a failed one is left
out, as the learner leaves it out). It is null for a sample dropped with its group (fewer
than two came back). An episode of several segments is one line (its last segment's text,
`num_segments`); its advantage is the one all its segments share, over the group's rows as the
learner computes it (train_step.py).

Never lost silently: every line is written whole or not at all (postrain.core.jsonl), and a
write refused for want of space raises DiskFullError, which stops the run exactly as a full
disk under the ledger does (driver.py: RunStoppedError, the last checkpoint intact). A
checkpoint stores the file's size (RunState.samples_offset); a resume cuts it back to it, so
its lines match the ledger's trained samples. `read_samples` reads it (`postrain samples`,
`postrain trace`, the trackers' sample tables).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from postrain.core.jsonl import JsonlAppender, read_jsonl

SAMPLES_FILE = "samples.jsonl"
DEFAULT_MAX_CHARS = 4096
HEAD_SHARE = 0.75   # of a cut text's kept characters, the share kept from its start (the rest: its end)


def cut_text(text: str, max_chars: int) -> str:
    """`text` within about `max_chars` characters: its head and tail, the cut marked in place."""
    if len(text) <= max_chars:
        return text
    head = int(max_chars * HEAD_SHARE)
    tail = max_chars - head
    cut = len(text) - head - tail
    return f"{text[:head]}\n[... {cut} characters cut ...]\n{text[len(text) - tail:]}"


def split_turns(token_ids: list[int],
                loss_mask: list[int]) -> tuple[list[int], list[tuple[list[int], list[int]]]]:
    """(prompt ids, [(completion ids, observation ids), ...]) of one rollout: the prompt is
    everything before the first sampled token; each turn is a run of sampled tokens (mask 1)
    and the unsampled tokens after it (mask 0; empty after the last turn)."""
    assert len(token_ids) == len(loss_mask), (len(token_ids), len(loss_mask))
    first = next((i for i, m in enumerate(loss_mask) if m), len(token_ids))
    turns: list[tuple[list[int], list[int]]] = []
    i = first
    while i < len(token_ids):
        j = i
        while j < len(token_ids) and loss_mask[j]:
            j += 1
        k = j
        while k < len(token_ids) and not loss_mask[k]:
            k += 1
        turns.append((list(token_ids[i:j]), list(token_ids[j:k])))
        i = k
    return list(token_ids[:first]), turns


def rollout_texts(tokenizer, rollout, max_chars: int = DEFAULT_MAX_CHARS) -> dict[str, Any]:
    """The `prompt` and `turns` of a rollout (records.Rollout) as bounded text."""
    prompt, turns = split_turns(rollout.token_ids, rollout.loss_mask)

    def text(ids: list[int]) -> str:
        return cut_text(tokenizer.decode(ids), max_chars) if ids else ""
    return {"prompt": text(prompt),
            "turns": [{"completion": text(sampled), "tool_output": text(observed)}
                      for sampled, observed in turns]}


def segment_advantages(samples: list) -> list[float]:
    """Each sample's advantage over its group's rows (one per segment; train_step.py)."""
    rows = group_advantages([s.reward.total for s in samples for _ in range(s.rollout.num_segments)])
    starts = [0]
    for s in samples[:-1]:
        starts.append(starts[-1] + s.rollout.num_segments)
    return [rows[i] for i in starts]


def group_advantages(rewards: list[float]) -> list[float]:
    """GRPO's advantages of one group's total rewards (module docstring)."""
    import torch
    from postrain.ext.advantages import group_advantages as grpo
    if len(rewards) < 2:
        return [0.0] * len(rewards)
    advantages = grpo(torch.tensor(rewards, dtype=torch.float32), len(rewards), "grpo")   # (G,)
    return [round(float(a), 4) for a in advantages]


class SampleLog:
    """Appends the lines of samples.jsonl (module docstring) for one run folder."""

    def __init__(self, folder: str | Path, tokenizer, max_chars: int = DEFAULT_MAX_CHARS):
        self.path = Path(folder) / SAMPLES_FILE
        self.tokenizer = tokenizer            # decodes the rollouts' token ids
        self.max_chars = max_chars            # per text (a prompt, a completion, a tool output)
        self._file: JsonlAppender | None = JsonlAppender(self.path)

    def record_step(self, step: int, batch: int, groups: list[list], staleness: dict[str, int],
                    dropped: dict[str, str]) -> int:
        """One line per sample of `groups` (lists of ScoredSample, None for a failed rollout)
        trained in RL step `step` (1-based) from `batch`; `staleness` of the trained ones by id;
        `dropped`: sample id -> reason for the ones dropped with their group. Returns the lines
        written. Raises DiskFullError (module docstring)."""
        written = 0
        for g, group in enumerate(groups):
            samples = [s for s in group if s is not None]
            complete = len(samples) >= 2   # a failed sample is left out of its group's baseline
            advantages = (segment_advantages(samples) if complete else [None] * len(samples))
            for sample, advantage in zip(samples, advantages):
                sample_id = sample.sample_id
                outcome = "trained" if sample_id in staleness else f"dropped: {dropped.get(sample_id, 'not trained')}"
                self.append(self.row(sample, step=step, batch=batch, group=g, advantage=advantage,
                                     staleness=staleness.get(sample_id), outcome=outcome))
                written += 1
        return written

    def row(self, sample, *, step: int, batch: int, group: int, advantage: float | None,
            staleness: int | None, outcome: str) -> dict[str, Any]:
        rollout = sample.rollout
        return {"sample_id": sample.sample_id, "step": step, "batch": batch, "group": group,
                "task": sample.task, "outcome": outcome, "reward": rollout.reward.total, "cause": rollout.cause,
                "components": dict(rollout.reward.components), "advantage": advantage,
                "staleness": staleness, "policy_tokens": rollout.num_policy_tokens,
                "num_turns": rollout.num_turns, "num_segments": rollout.num_segments,
                **rollout_texts(self.tokenizer, rollout, self.max_chars)}

    def append(self, row: dict) -> None:
        assert self._file is not None, f"{self.path} is closed"
        self._file.append(row)

    def size(self) -> int:
        """Bytes in the file so far (a checkpoint's `samples_offset`)."""
        return 0 if self._file is None else self._file.size()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_samples(run_folder: str | Path) -> list[dict]:
    """The lines of RUN_FOLDER/samples.jsonl, in order ([] when the run has none); a half-written
    last line (a writer killed mid-line) is skipped with a warning."""
    path = Path(run_folder) / SAMPLES_FILE
    return list(read_jsonl(path)) if path.exists() else []
