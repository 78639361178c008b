"""Built-in tasks: generators, held-out splits, rewards, and whole episodes through a real warm
nsjail sandbox with scripted actions; demonstrations and their JSONL form; the task registry."""
from __future__ import annotations

import itertools
import json

import pytest
import trio

from postrain.actors import (LocalSandbox, TaskOptionsError, TaskSpec, get_task, list_tasks, register_task,
                             run_episode)
from postrain.actors.tasks import TaskError, arithmetic, code
from postrain.actors.tasks.arithmetic import ArithmeticEnv, ArithmeticOptions, answer_matches, in_eval_split
from postrain.actors.tasks.code import CodeEnv, CodeOptions, CodeTaskError, build_test_file
from postrain.actors.tasks.code_problems import PROBLEMS
from postrain.actors.tasks.demonstrations import (DemonstrationError, arithmetic_demonstrations,
                                                  code_demonstrations, read_jsonl, validate_demonstration,
                                                  write_jsonl)
from postrain.actors.records import ExecReply, RunTestsReply
from postrain.actors.env.tools import format_tool_output, parse_tool_call
from postrain.core.testing import async_test
from postrain.sandbox import Policy, Sandbox


@pytest.fixture(scope="module")
def sandbox():
    policy = Policy(wall_time_s=10.0, cpu_time_s=10, memory_mb=256, max_processes=24,
                    work_dir_size_mb=8, max_output_bytes=65536)
    with Sandbox(policy, mode="warm", num_workers=2) as sb:
        yield LocalSandbox(sb)


def scripted(*actions):
    queue = list(actions)

    async def policy(messages):
        return queue.pop(0)
    return policy


# ---------------------------------------------------------------- arithmetic: generator and split
def test_arithmetic_generator_is_deterministic_and_follows_knobs():
    first = list(itertools.islice(arithmetic.train_tasks(7), 50))
    assert first == list(itertools.islice(arithmetic.train_tasks(7), 50))
    assert first != list(itertools.islice(arithmetic.train_tasks(8), 50))
    assert all(t["answer"] == eval(t["expression"]) for t in first)  # noqa: S307 - our own expressions
    knobs = {"min_digits": 4, "max_digits": 4, "min_operands": 3, "max_operands": 3, "operators": ["*"]}
    for t in itertools.islice(arithmetic.train_tasks(0, knobs), 30):
        numbers = t["expression"].split(" * ")
        assert len(numbers) == 3 and all(len(n) == 4 for n in numbers)
        assert t["question"] == f"What is {t['expression']}?"
    # ranges are checked with the options, before any problem is made
    with pytest.raises(TaskOptionsError, match="max_digits <= 9, got 3..2"):
        arithmetic.train_tasks(0, {"min_digits": 3, "max_digits": 2})
    with pytest.raises(TaskOptionsError, match=r"subset of \('\+', '-', '\*'\), got \('/',\)"):
        get_task("arithmetic").check_options({"operators": ["/"]})


def test_arithmetic_eval_split_is_disjoint_by_construction():
    held_out = arithmetic.eval_tasks()
    assert len(held_out) == 200 == len({t["expression"] for t in held_out})
    assert held_out == arithmetic.eval_tasks()
    assert all(in_eval_split(t["expression"]) for t in held_out)
    held = {t["expression"] for t in held_out}
    for seed in range(3):
        train = [t["expression"] for t in itertools.islice(arithmetic.train_tasks(seed), 3000)]
        assert not any(in_eval_split(e) for e in train) and not held & set(train)


def test_answer_matching():
    assert answer_matches("110281", 110281) and answer_matches(" 110,281. ", 110281)
    assert answer_matches("-152", -152) and answer_matches("42.0", 42)
    assert not answer_matches("42.5", 42) and not answer_matches("forty-two", 42)
    assert not answer_matches("", 0) and not answer_matches("41", 42)


# ---------------------------------------------------------------- arithmetic: episodes
TASK = {"id": "t", "question": "What is 3817 * 29 - 412?", "expression": "3817 * 29 - 412", "answer": 110281}


@async_test
async def test_arithmetic_episode_with_python_tool(sandbox):
    env = ArithmeticEnv(sandbox=sandbox)
    ep = await run_episode(env, TASK, scripted("<python>\nprint(3817 * 29 - 412)\n</python>",
                                               "<answer>110281</answer>"))
    assert [m["role"] for m in ep.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert ep.messages[3]["content"] == "<output>\n110281\n</output>"
    assert ep.reward.components == {"correct": 1.0, "format": 1.0}
    assert ep.reward.total == pytest.approx(1.1) and ep.infos[0]["tool_status"] == "ok"


@pytest.mark.parametrize("actions, components", [
    (["<answer>110281</answer>"], {"correct": 1.0, "format": 1.0}),        # no tool needed
    (["<answer>110282</answer>"], {"correct": 0.0, "format": 1.0}),        # wrong
    (["<answer>110281"], {"correct": 1.0, "format": 0.0}),                  # unterminated
    (["It is 110281."], {"correct": 0.0, "format": 0.0}),                   # no tags at all
    (["<python>\nprint(1)\n</python>\nextra", "<answer>1</answer>"], {"correct": 0.0, "format": 0.0}),
])
def test_arithmetic_rewards_without_sandbox_runs(actions, components, sandbox):
    ep = trio.run(run_episode, ArithmeticEnv(sandbox=sandbox), TASK, scripted(*actions))
    assert ep.reward.components == components and ep.reward.weights == {"format": 0.1}


@async_test
async def test_arithmetic_tool_errors_budget_and_truncation(sandbox):
    env = ArithmeticEnv(sandbox=sandbox, options={"max_tool_calls": 1, "max_turns": 3})
    ep = await run_episode(env, TASK, scripted("<python>\nprint(1/0)\n</python>",
                                               "<python>\nprint(2)\n</python>",
                                               "<python>\nprint(3)\n</python>"))
    assert "[error: exit code 1]" in ep.messages[3]["content"]
    assert ep.messages[3]["content"].rstrip().endswith("ZeroDivisionError: division by zero\n</output>")
    assert "No more tool calls" in ep.messages[5]["content"]
    assert ep.truncated and ep.reward.components == {"correct": 0.0, "format": 1.0}
    sys_free = await ArithmeticEnv(sandbox=sandbox, options={"use_system_prompt": False}).reset(TASK)
    assert len(sys_free) == 1 and sys_free[0]["content"].endswith("What is 3817 * 29 - 412?")


PLAIN = {"answer_format": "plain", "max_digits": 2, "max_operands": 2, "operators": ["+"]}


@pytest.mark.parametrize("reply, correct", [
    ("37 + 58 = 95", 1.0), ("The answer is 95.", 1.0), ("95", 1.0), ("1,095", 0.0),
    ("To add 37 and 58, we", 0.0), ("", 0.0), ("<answer>95</answer>", 1.0),
])
def test_arithmetic_plain_answers_are_one_turn_judged_by_the_last_integer(reply, correct):
    task = {"id": "t", "question": "What is 37 + 58?", "expression": "37 + 58", "answer": 95}
    env = get_task("arithmetic").make_env(options=PLAIN)
    ep = trio.run(run_episode, env, task, scripted(reply))
    assert ep.messages[0] == {"role": "user", "content": "What is 37 + 58?"} and len(ep.messages) == 2
    assert ep.reward.components == {"correct": correct} and not ep.truncated


def test_arithmetic_plain_answers_need_no_sandbox_and_demonstrate_the_bare_value():
    spec = get_task("arithmetic")
    assert not spec.needs_sandbox(PLAIN) and spec.needs_sandbox({}) and spec.needs_sandbox(None)
    demo = arithmetic_demonstrations(3, seed=0, options=PLAIN)[0]["messages"]
    assert [m["role"] for m in demo] == ["user", "assistant"]
    assert demo[1]["content"] == str(arithmetic.evaluate(demo[0]["content"][len("What is "):-1]))
    with pytest.raises(TaskOptionsError, match="answer_format"):
        spec.check_options({"answer_format": "boxed"})


# ---------------------------------------------------------------- code problems
def test_code_problems_are_many_distinct_and_split():
    names = [p["name"] for p in PROBLEMS]
    assert len(names) >= 50 and len(set(names)) == len(names)
    for p in PROBLEMS:
        assert len(p["visible_tests"]) >= 2 and len(p["hidden_tests"]) >= 2
        assert not set(p["visible_tests"]) & set(p["hidden_tests"]), p["name"]
    held = {t["name"] for t in code.eval_tasks()}
    train = {t["name"] for t in itertools.islice(code.train_tasks(3), 3 * len(PROBLEMS))}
    assert len(held) == code.NUM_EVAL_PROBLEMS and not held & train
    assert held | train == set(names)
    assert [t["id"] for t in itertools.islice(code.train_tasks(3), 5)] == \
        [t["id"] for t in itertools.islice(code.train_tasks(3), 5)]
    with pytest.raises(CodeTaskError, match="one comparison"):
        build_test_file("f", ["f(1) != 2"])
    with pytest.raises(CodeTaskError, match="comparison"):
        build_test_file("f", ["f(1) =="])


@async_test
async def test_every_reference_solution_passes_its_tests_in_the_sandbox(sandbox):
    failures = {}

    async def check(p):
        tests = build_test_file(p["name"], p["visible_tests"] + p["hidden_tests"])
        report = await sandbox.run_tests(p["reference"], tests)
        if report.collect_error or report.num_failed or len(report.passed) != \
                len(p["visible_tests"]) + len(p["hidden_tests"]):
            failures[p["name"]] = (report.collect_error, report.errors)
    async with trio.open_nursery() as nursery:
        for p in PROBLEMS:
            nursery.start_soon(check, p)
    assert failures == {}


def fizzbuzz_task():
    return next(t for t in code.train_tasks(0) if t["name"] == "fizzbuzz")


WRONG_FIZZBUZZ = """def fizzbuzz(n):
    if n % 3 == 0:
        return "Fizz"
    if n % 5 == 0:
        return "buzz"
    return str(n)
"""
RIGHT_FIZZBUZZ = next(p["reference"] for p in PROBLEMS if p["name"] == "fizzbuzz")


@async_test
async def test_code_episode_fails_then_fixes(sandbox):
    env = CodeEnv(sandbox=sandbox, options={"max_attempts": 3})
    ep = await run_episode(env, fizzbuzz_task(), scripted(f"<python>\n{WRONG_FIZZBUZZ}</python>",
                                                          f"<python>\n{RIGHT_FIZZBUZZ}</python>"))
    feedback = ep.messages[3]["content"]
    assert feedback.startswith("<output>\n2 of 3 visible tests passed.\n")
    assert "FAIL test_1: AssertionError: fizzbuzz(10) returned 'buzz', expected 'Buzz'" in feedback
    assert "You have 2 attempts left" in feedback
    assert ep.num_turns == 2 and not ep.truncated
    assert ep.reward.components == {"hidden_tests": 1.0, "format": 1.0} and ep.reward.total == 1.0
    assert ep.infos[-1]["attempts"] == 2 and ep.infos[-1]["visible_passed"] is True


@async_test
async def test_code_partial_credit_syntax_errors_and_attempt_limit(sandbox):
    # submitted at once: the hidden tests give partial credit (only fizzbuzz(1) == '1' passes)
    ep = await run_episode(CodeEnv(sandbox=sandbox), fizzbuzz_task(),
                           scripted("<answer>\ndef fizzbuzz(n):\n    return str(n)\n</answer>"))
    assert ep.reward.components["hidden_tests"] == pytest.approx(1 / 5) and ep.num_turns == 1
    # a syntax error is shown; the attempts run out and the last attempt is graded
    env = CodeEnv(sandbox=sandbox, options={"max_attempts": 2})
    ep = await run_episode(env, fizzbuzz_task(), scripted("<python>\ndef fizzbuzz(n) return 1\n</python>",
                                                          f"<python>\n{WRONG_FIZZBUZZ}</python>"))
    assert "Your code did not load" in ep.messages[3]["content"]
    assert "SyntaxError" in ep.messages[3]["content"]
    assert ep.num_turns == 2 and ep.infos[-1]["visible_passed"] is False
    assert 0.0 < ep.reward.components["hidden_tests"] < 1.0
    # a hanging function fails its tests, not the episode
    ep = await run_episode(CodeEnv(sandbox=sandbox, options={"test_timeout_s": 0.3}), fizzbuzz_task(),
                           scripted("<answer>\ndef fizzbuzz(n):\n    while True: pass\n</answer>"))
    assert ep.reward.components["hidden_tests"] == 0.0
    ep = await run_episode(CodeEnv(sandbox=sandbox), fizzbuzz_task(), scripted("no code"))
    assert ep.reward.components == {"hidden_tests": 0.0, "format": 0.0}


# ---------------------------------------------------------------- demonstrations
def test_demonstrations_are_deterministic_and_round_trip(tmp_path):
    demos = arithmetic_demonstrations(20, seed=1)
    assert demos == arithmetic_demonstrations(20, seed=1)
    train_questions = {t["question"] for t in itertools.islice(arithmetic.train_tasks(1), 20)}
    assert {d["messages"][1]["content"] for d in demos} == train_questions
    held = {t["question"] for t in arithmetic.eval_tasks()}
    assert not held & train_questions
    code_demos = code_demonstrations(seed=0)
    assert len(code_demos) == len(PROBLEMS) - code.NUM_EVAL_PROBLEMS
    assert not {d["messages"][1]["content"] for d in code_demos} & \
        {code.prompt_text(t) for t in code.eval_tasks()}
    path = tmp_path / "demos.jsonl"
    assert write_jsonl(path, demos + code_demos) == len(demos) + len(code_demos)
    assert read_jsonl(path) == demos + code_demos
    assert get_task("code").demonstrations(3) == code_demos[:3]


def test_mental_products_answer_that_share_of_products_without_the_tool_and_nothing_else():
    """A teacher that multiplies in its head: with mental_products p, about p of the products are
    answered straight away with the right value; sums and differences always use the tool."""
    options = {"max_digits": 2, "max_operands": 2, "mental_products": 0.7}
    demos = arithmetic_demonstrations(600, seed=2, options=options)
    assert demos == arithmetic_demonstrations(600, seed=2, options=options)
    from_memory = [d for d in demos if len(d["messages"]) == 3]   # system, user, the answer
    products = [d for d in demos if "*" in d["messages"][1]["content"]]
    assert all("*" in d["messages"][1]["content"] for d in from_memory)
    assert 0.6 < len(from_memory) / len(products) < 0.8
    for demo in from_memory:
        question = demo["messages"][1]["content"]
        assert parse_tool_call(demo["messages"][2]["content"]) is None
        value = str(arithmetic.evaluate(question[len('What is '):-1]))
        answer = demo["messages"][2]
        assert answer["content"] == f"<answer>{value}</answer>"
        (start, end), = answer["no_loss_spans"]   # the digits: the choice is taught, not the value
        assert answer["content"][start:end] == value
        validate_demonstration(demo)
    assert all(len(d["messages"]) == 5 for d in arithmetic_demonstrations(200, seed=2, options={"max_operands": 2}))


def test_jsonl_errors_name_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "q"},
                                             {"role": "assistant", "content": "a"}]}) + "\n\n{oops\n")
    with pytest.raises(DemonstrationError, match=r"bad.jsonl:3: not JSON"):
        read_jsonl(path)
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "q"}]}) + "\n")
    with pytest.raises(DemonstrationError, match=r"bad.jsonl:1: has no assistant turn"):
        read_jsonl(path)
    with pytest.raises(DemonstrationError, match=r"messages\[0\] must have role"):
        write_jsonl(path, [{"messages": [{"role": "bot", "content": "x"}]}])
    for spans in ([[2, 9]], [[1]], "0-1", [[1.0, 2]]):
        with pytest.raises(DemonstrationError, match=r"messages\[1\].no_loss_spans must be"):
            write_jsonl(path, [{"messages": [{"role": "user", "content": "q"},
                                             {"role": "assistant", "content": "<a>7</a>",
                                              "no_loss_spans": spans}]}])
    with pytest.raises(DemonstrationError, match=r"messages\[0\].no_loss_spans must be"):
        write_jsonl(path, [{"messages": [{"role": "user", "content": "q", "no_loss_spans": [[0, 1]]},
                                         {"role": "assistant", "content": "a"}]}])


@async_test
async def test_demonstrations_replay_through_the_real_environments(sandbox):
    for demo, task in zip(arithmetic_demonstrations(3, seed=2), arithmetic.train_tasks(2)):
        messages = demo["messages"]
        real = await sandbox.exec(parse_tool_call(messages[2]["content"]))
        assert format_tool_output(real) == messages[3]["content"]
        ep = await run_episode(ArithmeticEnv(sandbox=sandbox), task,
                               scripted(*[m["content"] for m in messages if m["role"] == "assistant"]))
        assert ep.messages == messages and ep.reward.total == pytest.approx(1.1)
    demo = code_demonstrations(seed=0)[0]
    task = next(code.train_tasks(0))
    ep = await run_episode(CodeEnv(sandbox=sandbox), task, scripted(demo["messages"][-1]["content"]))
    assert ep.messages == demo["messages"] and ep.reward.components["hidden_tests"] == 1.0


# ---------------------------------------------------------------- registry
def test_task_registry():
    assert {"arithmetic", "code"} <= set(list_tasks())
    spec = get_task("arithmetic")
    assert spec.env_class is ArithmeticEnv and len(spec.eval_tasks({"num_eval": 10})) == 10
    assert isinstance(spec.make_env(options={"max_turns": 2}), ArithmeticEnv)
    assert get_task("postrain.actors.tasks:CODE") is get_task("code")
    with pytest.raises(TaskError, match="unknown task 'nope'; registered: .*'arithmetic'"):
        get_task("nope")
    with pytest.raises(TaskError, match="cannot load task"):
        get_task("no_such_module_xyz:SPEC")
    with pytest.raises(TaskError, match="not a TaskSpec"):
        get_task("postrain.actors.tasks.arithmetic:EVAL_SEED")
    with pytest.raises(TaskError, match="already registered"):
        register_task(TaskSpec("code", CodeEnv, code.train_tasks, code.eval_tasks))
    with pytest.raises(TaskError, match="env_class must be an Environment subclass"):
        TaskSpec("x", dict, code.train_tasks, code.eval_tasks)
    with pytest.raises(TaskError, match="no built-in demonstrations"):
        TaskSpec("x", CodeEnv, code.train_tasks, code.eval_tasks).demonstrations(1)


# ---------------------------------------------------------------- task options
@pytest.mark.parametrize("name, option", [("arithmetic", "max_digts"), ("code", "max_attemps")])
def test_a_misspelt_task_option_is_an_error_naming_it(name, option):
    spec = get_task(name)
    owner = rf"(task '{name}'|{spec.env_class.__name__})"
    message = rf"1 bad task option\(s\) of {owner}: task_options.{option} = 2: unknown field"
    for use in (lambda: spec.make_env(options={option: 2}), lambda: spec.train_tasks(0, {option: 2}),
                lambda: spec.eval_tasks({option: 2}), lambda: spec.check_options({option: 2}),
                lambda: spec.env_class(options={option: 2})):
        with pytest.raises(TaskOptionsError, match=message):
            use()
    with pytest.raises(TaskOptionsError, match=r"format_weight = 'heavy': Input should be a valid number"):
        spec.make_env(options={"format_weight": "heavy"})


def test_task_option_models_keep_the_tasks_names_and_defaults():
    a = ArithmeticOptions()
    assert (a.min_digits, a.max_digits, a.min_operands, a.max_operands, a.operators) == \
        (1, 3, 2, 3, arithmetic.OPERATORS)
    assert a.num_eval == arithmetic.NUM_EVAL and a.max_turns == ArithmeticEnv().max_turns == 4
    assert (a.max_tool_calls, a.tool_timeout_s, a.format_weight, a.use_system_prompt,
            a.include_instructions) == (2, 5.0, 0.1, True, True)
    code_options = CodeOptions()
    assert (code_options.max_attempts, code_options.test_timeout_s, code_options.run_timeout_s,
            code_options.format_weight, code_options.use_system_prompt, code_options.max_turns) == \
        (code.DEFAULT_MAX_ATTEMPTS, 2.0, 10.0, 0.0, True, None)
    # the options the shipped configs use are all known
    get_task("arithmetic").check_options({"include_instructions": False, "max_digits": 2, "max_operands": 2,
                                          "max_tool_calls": 1, "operators": ["+", "*"]})
    get_task("code").check_options({"max_attempts": 2})
    env = get_task("code").make_env(options={"max_attempts": 2})
    assert env.options == CodeOptions(max_attempts=2) and env.max_turns == 3
    assert get_task("arithmetic").uses_sandbox and get_task("code").uses_sandbox
    with pytest.raises(TaskOptionsError, match=r"task_options.max_attempts = 0: Input should be greater"):
        CodeEnv(options={"max_attempts": 0})


def test_environments_read_their_options_as_a_validated_model():
    spec = get_task("arithmetic")
    options = spec.check_options({"max_tool_calls": 1})
    assert isinstance(options, ArithmeticOptions) and options.max_tool_calls == 1
    assert options.tool_timeout_s == 5.0                # the default lives in the model's field
    assert spec.check_options(options) is options       # a checked instance passes as it is
    env = spec.make_env(options=options)
    assert env.options is options and env.max_turns == 4
    assert spec.make_env(options={"max_turns": 2}).max_turns == 2
    with pytest.raises(Exception):
        options.max_tool_calls = 3                      # frozen: every episode sees the same options


# ---------------------------------------------------------------- the sandbox actor's wire shapes
class WireSandbox:
    """A handle that answers with the sandbox actor's reply records (what a run's environment
    actor's RemoteSandbox returns from `exec` / `run_tests`), over the same real sandbox."""

    def __init__(self, local):
        self.local = local

    async def exec(self, code, **kwargs):
        return ExecReply.of(await self.local.exec(code, **kwargs))

    async def run_tests(self, solution, tests, **kwargs):
        return RunTestsReply.of(await self.local.run_tests(solution, tests, **kwargs))


@async_test
async def test_tasks_work_with_the_sandbox_actors_wire_results(sandbox):
    wire = WireSandbox(sandbox)
    ep = await run_episode(ArithmeticEnv(sandbox=wire), TASK, scripted(
        "<python>\nprint(3817 * 29 - 412)\n</python>", "<answer>110281</answer>"))
    assert ep.messages[3]["content"] == "<output>\n110281\n</output>" and ep.infos[0]["tool_status"] == "ok"
    assert ep.reward.total == pytest.approx(1.1)
    ep = await run_episode(CodeEnv(sandbox=wire), fizzbuzz_task(), scripted(
        f"<python>\n{WRONG_FIZZBUZZ}</python>", f"<python>\n{RIGHT_FIZZBUZZ}</python>"))
    assert "fizzbuzz(10) returned 'buzz'" in ep.messages[3]["content"]
    assert ep.reward.components["hidden_tests"] == 1.0
