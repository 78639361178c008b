"""The train/publish step: one generated batch -> one learner step -> the new weights on every generator.

A group with any failed sample is dropped whole (each of its samples "dropped" in the
ledger with the reason): GRPO compares the samples of one prompt, so a partial group
would bias its baseline. The complete groups become one `TrainBatch` (rewards and
group ids; the learner computes the group-relative advantages), stepped through the
`LearnerKeeper` (exactly once, whatever dies meanwhile), then published. Each sample
is then "trained" in the ledger with its staleness (versions between the policy that
sampled its oldest token and the one that trained on it), and the step's figures go
to metrics.jsonl and to the head's live view. Each sample that came back gets its line
of text in samples.jsonl (sample_log.py: prompt, completions, tool outputs, reward,
advantage), and a step whose groups all have zero reward variance gets a warning
(learning_signal.py).
"""
from __future__ import annotations

import statistics
from typing import Callable

from ..records import PublishReport, TrainBatch
from .learning_signal import LearningSignalWatch, num_zero_variance_groups
from .sample_log import SampleLog
from .scored_sample import ScoredSample

# A speculative generator's figures in its `stats` (postrain.actors.generator.engine.Engine.speculation_stats).
SPECULATION_FIGURES = ("acceptance_rate", "tokens_per_verify_step", "draft_time_share")


GROUP_INCOMPLETE = "group incomplete: another sample of its prompt failed"


def complete_samples(groups: list[list[ScoredSample | None]], ledger) -> list[ScoredSample]:
    """The samples of groups where every sample succeeded, in group order; the others'
    succeeded samples are dropped in the ledger."""
    samples = []
    for group in groups:
        if any(item is None for item in group):
            for item in group:
                if item is not None:
                    ledger.drop(item.sample_id, GROUP_INCOMPLETE)
            continue
        samples.extend(group)
    return samples


def train_batch(samples: list[ScoredSample], samples_per_prompt: int) -> TrainBatch:
    """The learner's batch of complete groups (each `samples_per_prompt` samples, contiguous)."""
    rollouts = [s.rollout for s in samples]
    return TrainBatch(token_ids=[r.token_ids for r in rollouts], loss_mask=[r.loss_mask for r in rollouts],
                      behavior_logprobs=[r.behavior_logprobs for r in rollouts],
                      policy_versions=[r.policy_versions for r in rollouts],
                      rewards=[r.reward.total for r in rollouts],
                      group_ids=[i // samples_per_prompt for i in range(len(rollouts))])


class TrainStep:
    """Trains generated batches and publishes the weights; owns no state beyond its collaborators."""

    def __init__(self, keeper, ledger, metrics, report_figures: Callable[[dict], None],
                 samples_per_prompt: int, num_steps: int, *, sample_log: SampleLog | None = None,
                 signal: LearningSignalWatch | None = None, emit: Callable[[str], None] | None = None):
        self.keeper = keeper                   # LearnerKeeper: the only path to the learner
        self.ledger = ledger
        self.metrics = metrics                 # MetricsWriter of the run folder
        self.report_figures = report_figures   # one call per RL step: the head's live view
        self.samples_per_prompt = samples_per_prompt
        self.num_steps = num_steps
        self.sample_log = sample_log           # samples.jsonl, or None (not recorded)
        self.signal = signal                   # warns on steps without a learning signal, or None
        self.emit = emit or (lambda line: None)

    async def publish(self) -> PublishReport:
        """The learner's weights to every generator, and a "sync" metrics row: total_s, the size,
        the messages, and `sync_s_<generator>` per generator (the figure that shows a slow host
        or link); for each generator that decodes speculatively, its acceptance_rate,
        tokens_per_verify_step and draft_time_share since it started, suffixed `_<generator>`.
        Cancelled: see LearnerKeeper.publish (generators that replied hold the version; no row
        is written)."""
        report = await self.keeper.publish()
        speculation = {f"{figure}_{name}": round(stats[figure], 4)
                       for name, stats in sorted((await self.keeper.generator_stats()).items())
                       if "acceptance_rate" in stats for figure in SPECULATION_FIGURES}
        self.metrics.log("sync", version=report.version, total_s=report.total_s, num_bytes=report.num_bytes,
                         num_messages=report.num_messages,
                         **{f"sync_s_{target}": seconds for target, seconds in sorted(report.sync_s.items())},
                         **speculation)
        return report

    async def run(self, b: int, groups: list[list[ScoredSample | None]]) -> str:
        """Train batch `b` (0-based) and publish; returns the step's progress line.

        Cancelled: before the learner's reply, the step is not taken here (the keeper's next
        call sees the learner's version and recovers) and no sample is marked trained; after
        it, the samples are trained in the ledger and the publish may be partial."""
        samples = complete_samples(groups, self.ledger)
        if not samples:
            if self.sample_log is not None:
                self.sample_log.record_step(b + 1, b, groups, {}, {})
            return f"step {b + 1}: every group failed; nothing to train"
        batch = train_batch(samples, self.samples_per_prompt)
        metrics = await self.keeper.step(batch, [s.sample_id for s in samples])
        trained_version = metrics.policy_version - 1  # the weights this step started from
        staleness = [trained_version - s.rollout.oldest_policy_version(default=trained_version)
                     for s in samples]
        if self.sample_log is not None:   # before "trained": a trained sample always has its text
            trained = {s.sample_id: round(n) for s, n in zip(samples, staleness)}
            self.sample_log.record_step(b + 1, b, groups, trained, {})
        for sample, sample_staleness in zip(samples, staleness):
            self.ledger.advance(sample.sample_id, "trained", step=b + 1, staleness=round(sample_staleness))
        sync = await self.publish()
        rewards = batch.rewards
        correct = statistics.fmean(s.reward.components.get("correct", s.reward.total) for s in samples)
        learner_figures = {k: v for k, v in metrics.values.items() if isinstance(v, (int, float))}
        row = self.metrics.log("train", **{**learner_figures, "step": b + 1,
                                           "reward_mean": statistics.fmean(rewards), "correct_mean": correct,
                                           "sync_s": sync.total_s, "staleness_max": max(staleness),
                                           "staleness_mean": statistics.fmean(staleness),
                                           "num_groups": len(rewards) // self.samples_per_prompt,
                                           "num_zero_variance_groups":
                                               num_zero_variance_groups(rewards, self.samples_per_prompt)})
        self._check_signal(b + 1, rewards)
        counts = self.ledger.counts()
        self.report_figures({**{k: v for k, v in row.items() if k not in ("time", "kind")},
                             "num_steps": self.num_steps, "samples_trained": counts["trained"],
                             "samples_dropped": counts["dropped"]})
        return (f"step {b + 1}/{self.num_steps}: reward {statistics.fmean(rewards):.3f} "
                f"correct {correct:.3f} loss {metrics.get('loss', 0):.4f} kl {metrics.get('kl', 0):.4f} "
                f"tokens/s {metrics.get('tokens_per_s', 0):.0f} sync {sync.total_s:.2f}s")

    def _check_signal(self, step: int, rewards: list[float]) -> None:
        """A warning line and a `warning` metrics row when the step had no learning signal."""
        warning = self.signal.check(step, list(rewards)) if self.signal is not None else None
        if warning is not None:
            self.metrics.log("warning", **warning["row"])
            self.emit(warning["line"])
