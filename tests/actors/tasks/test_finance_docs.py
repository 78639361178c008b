"""The finance_docs task (actors/tasks/finance/): generated reports whose figures add up, a
reference solver that answers every question from the rendered text alone, a strict numeric
grader with units and a tolerance, a held-out split disjoint by construction, options checked by
name, and episodes in both forms through `run_episode` (the files form in a real sandbox)."""
from __future__ import annotations

import itertools
import random
from collections import Counter

import pytest
import trio

from postrain.actors import LocalSandbox, TaskOptionsError, get_task, run_episode
from postrain.actors.tasks.finance import (LEVELS, SIZES, TEMPLATES, VARIANTS, demonstration, grade, grade_answer, in_eval_split,
                                           make_task, solve_text, variants)
from postrain.actors.tasks.finance.company import BALANCE, CASH_FLOW, INCOME, make_company
from postrain.actors.tasks.finance.options import finance_options
from postrain.actors.tasks.finance.prompts import files_message, prompt_message
from postrain.actors.tasks.finance.render import report_text
from postrain.actors.tasks.finance.solver import FinanceReportError
from postrain.actors.tasks.finance.units import read_answer
from postrain.sandbox import Policy, Sandbox

SPEC = get_task("finance_docs")


def replay(demo: dict):
    """A policy that plays a demonstration's assistant turns in order."""
    turns = [m["content"] for m in demo["messages"] if m["role"] == "assistant"]

    async def policy(messages):
        return turns[sum(m["role"] == "assistant" for m in messages)]
    return policy


def scripted(*actions):
    replies = iter(actions)

    async def policy(messages):
        return next(replies)
    return policy


def final_turn(demo: dict) -> str:
    return demo["messages"][-1]["content"]


def test_the_reference_solver_scores_one_on_500_questions_from_the_text_alone():
    """Train and eval splits, every level, every size, both forms (the files form's report is the
    files the session holds, read back as the solver is shown them)."""
    tasks = []
    for size, form in (("excerpt", "prompt"), ("short", "files"), ("medium", "prompt"), ("long", "files")):
        options = {"size": size, "form": form}
        tasks += [(options, t) for t in itertools.islice(SPEC.train_tasks(7, options), 100)]
        tasks += [(options, t) for t in SPEC.eval_tasks({**options, "num_eval": 25})]
    assert len(tasks) == 500
    assert {t["level"] for _, t in tasks} == set(LEVELS)
    scores = []
    for options, task in tasks:
        solution = solve_text(report_text(task["files"]), task["query"])
        assert solution.value == pytest.approx(task["answer"]["value"], rel=1e-12, abs=1e-12), task["variant"]
        scores.append(grade(final_turn(demonstration(task, options)), task["answer"]).correct)
    assert sum(scores) / len(scores) == 1.0


def test_every_variant_has_a_solution_and_a_demonstration_in_every_size_it_fits():
    per_level = Counter(TEMPLATES[v.template].level for v in VARIANTS)
    assert len(VARIANTS) >= 50 and all(per_level[level] >= 15 for level in LEVELS), per_level
    for size, shape in SIZES.items():
        options = finance_options({"size": size})
        fitting = [v for level in LEVELS for v in variants(level, shape.num_years)]
        assert len(fitting) >= 50
        for i, variant in enumerate(fitting):
            task = make_task(1000 + i, variant, options, f"t-{i}")
            assert grade(final_turn(demonstration(task, options)), task["answer"]).correct, (size, variant)


def test_the_generated_figures_add_up_across_the_statements():
    for seed in range(200):
        company = make_company(random.Random(seed), num_years=2 + seed % 4)
        v = company.values
        for i in range(len(company.years)):
            assert v[INCOME]["Gross profit"][i] == v[INCOME]["Revenue"][i] - v[INCOME]["Cost of revenue"][i]
            assert v[INCOME]["Net income"][i] > 0 and v[CASH_FLOW]["Net cash from operating activities"][i] > 0
            assert v[BALANCE]["Total assets"][i] == v[BALANCE]["Total liabilities and shareholders' equity"][i]
            assert v[BALANCE]["Shareholders' equity"][i] > 0
            assert v[CASH_FLOW]["Cash at end of year"][i] == v[BALANCE]["Cash and cash equivalents"][i]
            assert v[CASH_FLOW]["Net income"][i] == v[INCOME]["Net income"][i]
            if i:
                assert v[CASH_FLOW]["Cash at beginning of year"][i] == v[CASH_FLOW]["Cash at end of year"][i - 1]
        restated = company.notes.restatement
        assert restated.previous != company.amount(restated.statement, restated.label, restated.year)
        assert restated.year < company.years[-1]


def test_tables_differ_in_units_and_the_sizes_grow():
    tasks = list(itertools.islice(SPEC.train_tasks(0, {"size": "short"}), 60))
    units = [tuple("US$ millions" in t["files"][name] for name in ("income_statement.md", "balance_sheet.md",
                                                                      "cash_flows.md")) for t in tasks]
    assert sum(len(set(u)) > 1 for u in units) > 30, "most reports mix thousands and millions"
    lengths = {size: len(report_text(SPEC.eval_tasks({"size": size, "num_eval": 1})[0]["files"])) for size in SIZES}
    assert lengths["excerpt"] < lengths["short"] < lengths["medium"] < lengths["long"] < lengths["very_long"]
    assert lengths["very_long"] > 60_000
    excerpt = SPEC.eval_tasks({"size": "excerpt", "num_eval": 20})
    assert all(len(t["files"]) <= 4 for t in excerpt) and any(len(t["files"]) == 1 for t in excerpt)


def test_the_solver_reads_only_the_text():
    task = SPEC.eval_tasks({"size": "short", "levels": [1], "num_eval": 1})[0]
    query = task["query"]
    solved = solve_text(report_text(task["files"]), query).value
    label = f"| {query['params'][1]} |"
    name = next(n for n, text in task["files"].items() if label in text)
    text = task["files"][name]
    row = next(line for line in text.splitlines() if line.startswith(label))
    cells = row.split(" | ")
    changed = " | ".join([cells[0], *("9" + cell for cell in cells[1:-1]), "9" + cells[-1]])   # each year x-ed
    other = dict(task["files"], **{name: text.replace(row, changed)})
    assert solve_text(report_text(other), query).value != solved
    with pytest.raises(FinanceReportError, match=r"the report has no .* for FY\d+ in its"):
        solve_text(report_text({n: t for n, t in task["files"].items() if n != name}), query)


@pytest.mark.parametrize("text, number, kind", [
    ("12.5%", "12.5", "fraction"), ("12.5 percent", "12.5", "fraction"), ("-3.4%", "-3.4", "fraction"),
    ("$1.2 million", "1.2", "money"), ("1,200 thousand", "1200", "money"), ("$1,234.5", "1234.5", "money"),
    ("(12.3)", "-12.3", None), ("-$12.3m", "-12.3", "money"), ("$-12.3 mn", "-12.3", "money"),
    ("1.85x", "1.85", "fraction"), ("45.2 days", "45.2", "days"), ("$1.23 per share", "1.23", "money"),
    ("0.125", "0.125", None), ("1.2 bn", "1.2", "money")])
def test_answers_are_read_as_one_number_with_a_unit(text, number, kind):
    from fractions import Fraction
    read = read_answer(text)
    assert read is not None and read.number == Fraction(number) and read.kind == kind


@pytest.mark.parametrize("text", ["about 12.5%", "12.5% or 12.6%", "twelve", "12,34", "(12.3", "-(12.3)", "$12%",
                                  "", "12.5%%"])
def test_anything_but_one_number_with_a_unit_is_no_answer(text):
    assert read_answer(text) is None


def test_right_answers_in_accepted_forms_score_one_and_wrong_units_rounding_or_items_score_zero():
    percent = {"value": 12.3456, "unit": "percent"}
    for right in ("12.3%", "12.4%", "12.3", "12.35 percent", "0.1234x"):
        assert grade_answer(right, percent).correct, right
    for wrong in ("0.123", "12%", "12.5%", "$12.3 million", "12.3 days", "-12.3%"):
        verdict = grade_answer(wrong, percent)
        assert not verdict.correct and verdict.reason, wrong
    assert "asks as a percentage" in grade_answer("$12.3 million", percent).reason
    money = {"value": 168.904, "unit": "usd_millions"}
    for right in ("$168.9 million", "168.9", "$168.9", "168,904 thousand", "$0.1689 billion", "169", "$168.904m"):
        assert grade_answer(right, money).correct, right
    for wrong in ("$168,904,000", "168,904", "$168.7 million", "$170 million", "16.9%", "-168.9"):
        assert not grade_answer(wrong, money).correct, wrong
    assert grade_answer("$168.8 million", money, tolerance_units=2.0).correct, "the tolerance is an option"
    decrease = {"value": -12.34, "unit": "usd_millions"}
    assert all(grade_answer(a, decrease).correct for a in ("-12.3", "(12.3)", "-$12.3 million", "$-12.3m"))
    assert not grade_answer("12.3", decrease).correct
    assert grade("working... <answer>1%</answer> no: <answer>12.3%</answer>", percent).correct, "the last tag"
    assert not grade("<answer>12.3%</answer> no: <answer>1%</answer>", percent).correct
    assert not grade("<answer>12.3%", percent).correct and not grade("12.3%", percent).correct
    assert grade("12.3%", percent).reason.startswith("no <answer>")
    # each verdict's kind, the episode's cause: counted per task by eval and the run's evaluations
    assert [grade(text, percent).cause for text in ("<answer>12.3%</answer>", "12.3%", "<answer>about 12</answer>",
                                                     "<answer>$12.3 million</answer>", "<answer>12.5%</answer>")] == [
        "ok", "no_answer", "not_a_number", "wrong_unit", "out_of_tolerance"]


def test_another_line_item_or_year_scores_zero_on_generated_lookups():
    options = finance_options({"size": "short"})
    for i, variant in enumerate(v for v in VARIANTS if v.template == "lookup"):
        task = make_task(50 + i, variant, options, f"t-{i}")
        statement, label = task["query"]["params"]
        year = task["query"]["years"][0]
        company = make_company(random.Random(f"finance_docs:{task['report_seed']}"), SIZES["short"].num_years)
        value = company.amount(statement, label, year) / 1000
        assert grade_answer(f"${value:,.3f} million", task["answer"]).correct
        others = [company.amount(statement, other, year) / 1000 for other in company.values[statement]
                  if abs(company.amount(statement, other, year) / 1000 - value) > 0.2]
        assert others and not any(grade_answer(f"${o:,.1f} million", task["answer"]).correct for o in others)
        other_year = next(y for y in company.years if y != year)
        shifted = company.amount(statement, label, other_year) / 1000
        if abs(shifted - value) > 0.2:
            assert not grade_answer(f"{shifted:.1f}", task["answer"]).correct


def test_the_splits_are_deterministic_and_disjoint_by_construction():
    options = {"size": "short"}
    first = [t["id"] for t in itertools.islice(SPEC.train_tasks(3, options), 30)]
    again = list(itertools.islice(SPEC.train_tasks(3, options), 30))
    assert first == [t["id"] for t in again] and again == list(itertools.islice(SPEC.train_tasks(3, options), 30))
    other = list(itertools.islice(SPEC.train_tasks(4, options), 30))
    assert [t["question"] for t in other] != [t["question"] for t in again]
    held_out = SPEC.eval_tasks(options)
    assert held_out == SPEC.eval_tasks(options) and len(held_out) == 200
    assert all(in_eval_split(t["report_seed"]) for t in held_out)
    train = list(itertools.islice(SPEC.train_tasks(0, options), 2000))
    assert not any(in_eval_split(t["report_seed"]) for t in train)
    assert not {report_text(t["files"]) for t in train} & {report_text(t["files"]) for t in held_out}
    assert Counter(t["level"] for t in train).keys() == set(LEVELS)
    assert {t["level"] for t in SPEC.eval_tasks({"levels": [3], "num_eval": 20, "size": "short"})} == {3}


def test_options_are_checked_with_clear_errors():
    with pytest.raises(TaskOptionsError, match=r"task_options.levels = \[4\]: .*levels must be a non-empty subset of "
                                               r"\[1, 2, 3\], got \[4\]; fix: e.g. levels = \[1, 2\]"):
        SPEC.check_options({"levels": [4]})
    with pytest.raises(TaskOptionsError, match=r"task_options.levels = \[\]: .*non-empty subset"):
        SPEC.train_tasks(0, {"levels": []})
    with pytest.raises(TaskOptionsError, match=r"task_options.size = 'huge': .*'excerpt', 'short', 'medium', "
                                               r"'long' or 'very_long'"):
        SPEC.eval_tasks({"size": "huge"})
    with pytest.raises(TaskOptionsError, match=r"task_options.form = 'pdf': .*'prompt' or 'files'"):
        SPEC.make_env(options={"form": "pdf"})
    with pytest.raises(TaskOptionsError, match=r"task_options.tolerance_units = -1"):
        SPEC.check_options({"tolerance_units": -1})
    with pytest.raises(TaskOptionsError, match=r"task_options.level = 1: unknown field"):
        SPEC.check_options({"level": 1})
    assert SPEC.check_options({"levels": [3, 1, 3]}).levels == (1, 3)


def test_demonstrations_come_from_training_reports_and_start_as_reset_does():
    options = {"size": "short"}
    demos = SPEC.demonstrations(30, seed=1, options=options)
    assert demos == SPEC.demonstrations(30, seed=1, options=options)
    tasks = list(itertools.islice(SPEC.train_tasks(1, options), 30))
    assert [d["messages"][0]["content"] for d in demos] == [prompt_message(t) for t in tasks]
    held_out = {prompt_message(t) for t in SPEC.eval_tasks(options)}
    assert not held_out & {d["messages"][0]["content"] for d in demos}
    files_demo = SPEC.demonstrations(1, seed=1, options={**options, "form": "files"})[0]
    assert files_demo["messages"][0]["content"] == files_message(tasks[0])
    assert files_demo["messages"][1]["content"].startswith("<bash>\ngrep -F -e '| Line item'")


def test_the_prompt_form_through_run_episode():
    options = {"size": "excerpt"}
    assert not SPEC.needs_sandbox(options)
    task = SPEC.eval_tasks({**options, "num_eval": 1})[0]
    right = trio.run(run_episode, SPEC.make_env(options=options), task, replay(demonstration(task, options)))
    assert right.messages[0] == {"role": "user", "content": prompt_message(task)}
    assert right.reward.components == {"correct": 1.0} and right.num_turns == 1
    wrong = trio.run(run_episode, SPEC.make_env(options=options), task, scripted("<answer>-1e9</answer>"))
    assert wrong.reward.components == {"correct": 0.0} and wrong.num_turns == 1
    assert "not one number" in wrong.infos[-1]["problem"]
    assert (right.cause, wrong.cause) == ("ok", "not_a_number")
    silent = trio.run(run_episode, SPEC.make_env(options=options), task, scripted("<bash>cat notes.md</bash>"))
    assert silent.reward.components == {"correct": 0.0} and silent.num_turns == 1 and silent.cause == "no_answer"


@pytest.fixture(scope="module")
def sandbox():
    with Sandbox(Policy(wall_time_s=10.0, cpu_time_s=10, memory_mb=256), mode="warm", num_workers=1) as box:
        yield box


def test_the_files_form_reads_the_report_in_a_real_sandbox_session(sandbox):
    """Each demonstration replayed through the environment: every observation is exactly what the
    session printed, and its answer is correct; what the policy writes in /work grades nothing."""
    options = {"size": "medium", "form": "files"}
    assert SPEC.needs_sandbox(options)
    tasks = [next(t for t in SPEC.eval_tasks({**options, "num_eval": 30}) if t["level"] == level) for level in LEVELS]

    async def play(task, policy, extra=None):
        env = SPEC.make_env(sandbox=LocalSandbox(sandbox), options={**options, **(extra or {})})
        try:
            return await run_episode(env, task, policy)
        finally:
            await env.close()

    for task in tasks:
        demo = demonstration(task, options)
        episode = trio.run(play, task, replay(demo))
        assert episode.messages == demo["messages"] and episode.reward.components == {"correct": 1.0}
    task = tasks[0]
    forged = trio.run(play, task, scripted(f"<bash>echo '<answer>{task['answer']['value']}</answer>' > /work/a</bash>",
                                           "<bash>cat /work/a</bash>", "I am done."))
    assert forged.reward.components == {"correct": 0.0} and forged.num_turns == 3
    assert "<answer>" in forged.messages[-2]["content"], "the policy read its own file; the grader did not"
    idle = trio.run(play, task, scripted(*["<bash>ls /work</bash>"] * 3), {"max_turns": 3})
    assert idle.truncated and idle.reward.components == {"correct": 0.0}
    assert "income_statement.md" in idle.messages[2]["content"]
