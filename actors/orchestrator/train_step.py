"""The train/publish step: one generated batch -> one learner step -> the new weights on every generator.

A sample whose rollout failed (its actor died past the retries, its reward function raised,
its environment failed) is already "dropped" in the ledger with the reason, and is never
trained, not as a 0 either: it is left out of its group, and the group's baseline is its
other samples' (the learner's advantages over groups of different sizes, ext/advantages.py),
exactly as if it had never been sampled. A group left with fewer than 2 samples has no
baseline and is dropped whole (GROUP_INCOMPLETE), unless its sample carries the teacher's rows:
a distilling run trains a lone sample on the teacher's KL (its advantage is 0), so
`samples_per_prompt = 1` works for on-policy distillation. The groups become one `TrainBatch` (rewards and
group ids; the learner computes the group-relative advantages), stepped through the
`LearnerKeeper` (exactly once, whatever dies meanwhile), then published. Each sample
is then "trained" in the ledger with its staleness (versions between the policy that
sampled its oldest token and the one that trained on it), and the step's figures go
to metrics.jsonl and to the head's live view. Each sample that came back gets its line
of text in samples.jsonl (sample_log.py: prompt, completions, tool outputs, reward,
advantage), and a step whose groups all have zero reward variance gets a warning
(learning_signal.py; not when the learner distils: its step reports `distill_kl`, and the
teacher's KL teaches every sample whatever the rewards), as do a collapse of the reward or of
the entropy (health.py).

Segments (records/rollout.py): an episode of several segments is one sample of its group (group
sizes, dynamic sampling and samples.jsonl count episodes) and several rows of the batch, one per
segment, each with the episode's reward and its own ledger id (ScoredSample.segment_ids), each
trained or dropped with its episode. The baseline is the learner's group-relative one over the
rows of the group: the segments of an episode have the same reward and group, so they share
one advantage (docs/long-context.md says why this baseline).
"""
from __future__ import annotations

import statistics
from typing import Callable

from ..records import PublishReport, RolloutSegment, SequenceScores, TrainBatch
from .dynamic_sampling import BatchRules
from .health import HealthWatch, report_warnings
from .learning_signal import LearningSignalWatch, num_zero_variance_groups
from .sample_log import SampleLog
from .scored_sample import ScoredSample
from .task_weights import TaskWeights

# A speculative generator's figures in its `stats` (postrain.actors.generator.engine.Engine.speculation_stats).
SPECULATION_FIGURES = ("acceptance_rate", "tokens_per_verify_step", "draft_time_share")


GROUP_INCOMPLETE = "group incomplete: the other samples of its prompt failed (no baseline)"
MIN_GROUP_SIZE = 2   # samples a group keeps after failures to be trained (a baseline needs two)


def surviving_groups(groups: list[list[ScoredSample | None]], ledger) -> list[list[ScoredSample]]:
    """Each group's samples that came back (None: a failed rollout, left out), in order; a
    group with fewer than MIN_GROUP_SIZE left is dropped, its samples "dropped" in the ledger
    (a lone sample with the teacher's rows is kept: it trains on the distillation KL)."""
    kept = []
    for group in groups:
        samples = [item for item in group if item is not None]
        distilled = bool(samples) and all(item.teacher is not None for item in samples)
        if len(samples) < (1 if distilled else MIN_GROUP_SIZE):   # the teacher's KL needs no baseline
            for item in samples:
                for sid in item.segment_ids:
                    ledger.drop(sid, GROUP_INCOMPLETE)
            continue
        kept.append(samples)
    return kept


def train_rows(groups: list[list[ScoredSample]]) -> list[tuple[int, ScoredSample, str, RolloutSegment]]:
    """(group index, sample, ledger id, segment) of each row of the batch: each group's samples
    contiguous, each sample's segments oldest first (module docstring)."""
    return [(g, s, sid, segment) for g, group in enumerate(groups) for s in group
            for sid, segment in zip(s.segment_ids, s.rollout.segments())]


def train_batch(groups: list[list[ScoredSample]], rules: BatchRules | None = None) -> TrainBatch:
    """The learner's batch: one row per segment (`train_rows`), each group's rows contiguous with
    its group id (sizes may differ), rewards shaped by `rules` (DAPO's overlong penalty;
    dynamic_sampling.py), the same for every segment of an episode."""
    rules = rules or BatchRules()
    rows = train_rows(groups)
    segments = [segment for _, _, _, segment in rows]
    teacher = teacher_rows(groups)
    return TrainBatch(token_ids=[r.token_ids for r in segments], loss_mask=[r.loss_mask for r in segments],
                      behavior_logprobs=[r.behavior_logprobs for r in segments],
                      policy_versions=[r.policy_versions for r in segments],
                      rewards=[rules.reward(s) for _, s, _, _ in rows],
                      group_ids=[g for g, _, _, _ in rows],
                      routed_experts=([r.routed_experts for r in segments]
                                      if any(r.routed_experts is not None for r in segments) else None),
                      images=[r.images or [] for r in segments] if any(r.images for r in segments) else None,
                      teacher_topk_ids=None if teacher is None else [t.topk_ids for t in teacher],
                      teacher_topk_logprobs=None if teacher is None else [t.topk_logprobs for t in teacher],
                      teacher_tail_logmass=None if teacher is None else [t.tail_logmass for t in teacher],
                      **kl_targets(rows, rules))


def kl_targets(rows: list[tuple[int, ScoredSample, str, RolloutSegment]], rules: BatchRules) -> dict:
    """A mixture with KL targets per task: each row's task and the targets (TrainBatch's
    row_tasks and kl_targets; actors/learner/task_kl.py); nothing otherwise."""
    targets = rules.mixture.kl_targets if rules.mixture is not None else None
    if targets is None:
        return {}
    return {"row_tasks": [s.task for _, s, _, _ in rows], "kl_targets": targets}


def teacher_rows(groups: list[list[ScoredSample]]) -> list[SequenceScores] | None:
    """The teacher's rows of every row of the batch (`train_rows`' order), or None when the run does
    not distil. Invariant: in a distilling run every sample that came back was scored (a sample
    the teacher failed is dropped before its group forms: rollout_pool.py)."""
    samples = [s for group in groups for s in group]
    if all(s.teacher is None for s in samples):
        return None
    assert all(s.teacher is not None for s in samples), "a distilling run trains scored samples only"
    return [row for s in samples for row in (s.teacher or ())]


def task_figures(groups: list[list[ScoredSample]]) -> dict[str, float]:
    """A mixture's figures of one step, per task of its groups: `reward_mean_<task>` (the
    environment's reward, before the task's scale), `correct_mean_<task>` and `num_groups_<task>`."""
    figures: dict[str, float] = {}
    for name in sorted({group[0].task for group in groups}):
        samples = [s for group in groups if group[0].task == name for s in group]
        figures[f"reward_mean_{name}"] = statistics.fmean(s.reward.total for s in samples)
        figures[f"correct_mean_{name}"] = statistics.fmean(s.reward.components.get("correct", s.reward.total)
                                                           for s in samples)
        figures[f"num_groups_{name}"] = sum(group[0].task == name for group in groups)
    return figures


class TrainStep:
    """Trains generated batches and publishes the weights; owns no state beyond its collaborators."""

    def __init__(self, keeper, ledger, metrics, report_figures: Callable[[dict], None],
                 samples_per_prompt: int, num_steps: int, *, sample_log: SampleLog | None = None,
                 signal: LearningSignalWatch | None = None, emit: Callable[[str], None] | None = None,
                 rules: BatchRules | None = None, weights: TaskWeights | None = None):
        self.keeper = keeper                   # LearnerKeeper: the only path to the learner
        self.ledger = ledger
        self.metrics = metrics                 # MetricsWriter of the run folder
        self.report_figures = report_figures   # one call per RL step: the head's live view
        self.samples_per_prompt = samples_per_prompt
        self.num_steps = num_steps
        self.sample_log = sample_log           # samples.jsonl, or None (not recorded)
        self.signal = signal                   # warns on steps without a learning signal, or None
        self.emit = emit or (lambda line: None)
        self.health = HealthWatch()            # reward / entropy collapse warnings (health.py)
        self.rules = rules or BatchRules()     # DAPO's dynamic sampling and overlong shaping
        self.weights = weights                 # a mixture's shares (task_weights.py), or None

    async def publish(self) -> PublishReport:
        """The learner's weights to every generator, and a "sync" metrics row: total_s, the size,
        the messages, and `sync_s_<generator>` per generator (the figure that shows a slow host
        or link); for each generator that decodes speculatively, its acceptance_rate,
        tokens_per_verify_step and draft_time_share since it started, suffixed `_<generator>`.
        Cancelled: see LearnerKeeper.publish (generators that replied hold the version; no row
        is written)."""
        report = await self.keeper.publish()
        speculation = {f"{figure}_{name}": round(getattr(stats, figure), 4)
                       for name, stats in sorted((await self.keeper.generator_stats()).items())
                       if stats.acceptance_rate is not None for figure in SPECULATION_FIGURES}
        self.metrics.log("sync", version=report.version, total_s=report.total_s, num_bytes=report.num_bytes,
                         num_bytes_sent=report.num_bytes_sent, num_messages=report.num_messages,
                         **{f"sync_s_{target}": seconds for target, seconds in sorted(report.sync_s.items())},
                         **speculation)
        return report

    async def run(self, b: int, groups: list[list[ScoredSample | None]]) -> str:
        """Train batch `b` (0-based) and publish; returns the step's progress line.

        Cancelled: before the learner's reply, the step is not taken here (the keeper's next
        call sees the learner's version and recovers) and no sample is marked trained; after
        it, the samples are trained in the ledger and the publish may be partial."""
        survivors = surviving_groups(groups, self.ledger)
        kept, num_dynamic_dropped = self.rules.select(survivors, self.ledger)
        shares = self.weights.update(b, survivors, self.rules.reward) if self.weights is not None else None
        if shares is not None:
            self.metrics.log("task_weights", step=b + 1, **shares)
        samples = [s for group in kept for s in group]
        sizes = [len(group) for group in kept]
        if not samples:
            if self.sample_log is not None:
                self.sample_log.record_step(b + 1, b, groups, {}, {})
            if survivors:   # dynamic sampling dropped every group: a step without a learning signal
                self._check_signal(b + 1, [self.rules.reward(s) for g in survivors for s in g],
                                   [len(g) for g in survivors], [s for g in survivors for s in g])
            return (f"step {b + 1}: every group failed or had equal rewards (dynamic sampling); nothing "
                    "to train")
        batch = train_batch(kept, self.rules)
        rows = train_rows(kept)
        metrics = await self.keeper.step(batch, [sid for _, _, sid, _ in rows])
        trained_version = metrics.policy_version - 1  # the weights this step started from
        staleness = [trained_version - s.rollout.oldest_policy_version(default=trained_version)
                     for s in samples]
        if self.sample_log is not None:   # before "trained": a trained sample always has its text
            trained = {s.sample_id: round(n) for s, n in zip(samples, staleness)}
            self.sample_log.record_step(b + 1, b, groups, trained, {})
        for _, _, sid, segment in rows:
            oldest = min((v for v in segment.policy_versions if v >= 0), default=trained_version)
            self.ledger.advance(sid, "trained", step=b + 1, staleness=round(trained_version - oldest))
        sync = await self.publish()
        rewards = [self.rules.reward(s) for s in samples]   # per episode (batch.rewards: per segment)
        correct = statistics.fmean(s.reward.components.get("correct", s.reward.total) for s in samples)
        learner_figures = {k: v for k, v in metrics.values.items() if isinstance(v, (int, float))}
        row = self.metrics.log("train", **{**learner_figures, "step": b + 1,
                                           "reward_mean": statistics.fmean(rewards), "correct_mean": correct,
                                           "sync_s": sync.total_s, "staleness_max": max(staleness),
                                           "staleness_mean": statistics.fmean(staleness),
                                           "num_groups": len(sizes),
                                           "num_zero_variance_groups": num_zero_variance_groups(rewards, sizes),
                                           "zero_variance_group_frac":
                                               num_zero_variance_groups(rewards, sizes) / len(sizes),
                                           "num_dynamic_sampling_dropped_groups": num_dynamic_dropped,
                                           "overlong_penalty_mean":
                                               statistics.fmean(self.rules.penalty(s) for s in samples),
                                           **self._task_figures(kept)})
        if "distill_kl" not in metrics.values:   # distilling: the teacher's KL teaches every sample
            self._check_signal(b + 1, rewards, sizes, samples)
        report_warnings(self.health.check_step(b + 1, row), self.metrics, self.emit)
        counts = self.ledger.counts()
        self.report_figures({**{k: v for k, v in row.items() if k not in ("time", "kind")},
                             "num_steps": self.num_steps, "samples_trained": counts["trained"],
                             "samples_dropped": counts["dropped"]})
        distill = f" distill_kl {metrics.get('distill_kl', 0):.4f}" if "distill_kl" in metrics.values else ""
        return (f"step {b + 1}/{self.num_steps}: reward {statistics.fmean(rewards):.3f} "
                f"correct {correct:.3f} loss {metrics.get('loss', 0):.4f} kl {metrics.get('kl', 0):.4f}{distill} "
                f"tokens/s {metrics.get('tokens_per_s', 0):.0f} sync {sync.total_s:.2f}s")

    def _task_figures(self, groups: list[list[ScoredSample]]) -> dict[str, float]:
        """Per-task figures of a mixture's step (`task_figures`); none for a run of one task."""
        mixture = self.rules.mixture
        return {} if mixture is None or mixture.is_single else task_figures(groups)

    def _check_signal(self, step: int, rewards: list[float], sizes: list[int],
                      samples: list[ScoredSample]) -> None:
        """A warning line and a `warning` metrics row when the step had no learning signal; its
        samples' rewards name what they are made of and whether every one was right."""
        first = samples[0].reward
        parts = {name: first.weights.get(name, 1.0) * value for name, value in first.components.items()}
        penalty = self.rules.penalty(samples[0])
        if penalty:
            parts["overlong_penalty"] = penalty
        all_correct = all(s.reward.components.get("correct") == 1 for s in samples)
        warning = (self.signal.check(step, list(rewards), sizes, parts, all_correct)
                   if self.signal is not None else None)
        if warning is not None:
            self.metrics.log("warning", **warning["row"])
            self.emit(warning["line"])
