"""No learning signal (actors/orchestrator/learning_signal.py): zero-variance groups, the warning
and its causes, at most once per `warn_every` steps."""
from postrain.actors.orchestrator.learning_signal import LearningSignalWatch, num_zero_variance_groups


def test_zero_variance_groups_are_groups_of_equal_rewards():
    assert num_zero_variance_groups([0, 0, 1, 0, 1, 1], 2) == 2
    assert num_zero_variance_groups([0.5, 0.5, 0.5, 0.5], 4) == 1


def test_a_step_with_some_signal_is_not_warned():
    watch = LearningSignalWatch(samples_per_prompt=2, temperature=1.0)
    assert watch.check(1, [0.0, 0.0, 1.0, 0.0]) is None and watch.num_steps_without == 0


def test_all_zero_rewards_warn_once_per_warn_every_steps_naming_the_causes():
    watch = LearningSignalWatch(samples_per_prompt=2, temperature=1.0, warn_every=3)
    warned = {step: watch.check(step, [0.0] * 4) for step in range(1, 8)}
    assert [step for step, warning in warned.items() if warning] == [1, 4, 7]
    first = warned[1]
    assert first["line"].startswith("warning: step 1: no learning signal: all 2 groups have zero reward variance")
    assert "every reward is 0" in first["line"] and "sft_steps" in first["line"]
    assert first["row"]["code"] == "no_learning_signal" and first["row"]["num_zero_variance_groups"] == 2
    assert warned[7]["row"]["num_steps_without_signal"] == 7


def test_the_settings_that_cause_it_come_first():
    watch = LearningSignalWatch(samples_per_prompt=1, temperature=0.0)
    causes = watch.check(1, [1.0, 0.0])["row"]["causes"]
    assert causes[0].startswith("samples_per_prompt = 1") and causes[1].startswith("sampling temperature 0")


def test_a_run_with_a_warm_start_is_told_to_lengthen_it():
    watch = LearningSignalWatch(samples_per_prompt=2, temperature=1.0, sft_steps=8)
    assert "a longer warm start (sft_steps = 8)" in watch.check(1, [0.0, 0.0])["line"]


def test_a_solved_step_is_a_note_that_says_what_the_reward_is_made_of():
    watch = LearningSignalWatch(samples_per_prompt=2, temperature=1.0)
    solved = watch.check(1, [1.1] * 2, parts={"correct": 1.0, "format": 0.1}, all_correct=True)
    assert solved["line"].startswith("note: step 1: no learning signal: its one group has zero reward variance")
    assert "every sample is right (each reward 1.1 (correct 1 + format 0.1)): the task is solved" in solved["line"]
    assert solved["row"]["code"] == "solved"


def test_a_constant_reward_that_is_not_right_is_a_warning_naming_its_parts():
    watch = LearningSignalWatch(samples_per_prompt=2, temperature=1.0)
    broken = watch.check(1, [0.1] * 4, parts={"correct": 0.0, "format": 0.1})
    assert broken["line"].startswith("warning: step 1: no learning signal: all 2 groups have")
    assert "every reward is 0.1 (correct 0 + format 0.1): the reward function may return a constant" in broken["line"]
    assert broken["row"]["code"] == "no_learning_signal"
