"""verifiers tasks (actors/tasks/verifiers_env.py, verifiers_tools.py) against the installed `verifiers`
package: tasksets written here (no hub data), single-turn and with a toolset (the tool loop), their
@vf.reward functions as reward components with their weights on the whole trace, code tools in a
real sandbox, tools that raise, hang or are called badly, @vf.stop hooks and max_turns, a held-out
split, a scorer that raises or hangs, and short real runs."""
import json
from pathlib import Path

import pytest
import trio

from postrain.actors import LocalSandbox, run_episode
from postrain.actors.env import EnvironmentContractError, EnvironmentFailure, TaskOptionsError
from postrain.actors.tasks import get_task
from postrain.actors.tasks.rewards import RewardFailure
from postrain.actors.env.tools import format_named_call
from postrain.cli.eval import evaluate
from postrain.sandbox import Policy, Sandbox

TASKSET = '''
import time
import verifiers.v1 as vf

class SumData(vf.TaskData):
    answer: str

class SumTask(vf.Task[SumData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def correct(self, task, trace) -> float:
        return float(trace.last_reply.strip() == task.answer)

    @vf.reward(weight=0.25)
    async def brief(self, task, trace) -> float:
        return float(len(trace.last_reply) <= 3)

    @vf.metric
    async def length(self, task, trace) -> float:
        return float(len(trace.last_reply))

class SumTaskset(vf.Taskset[SumTask, vf.TasksetConfig]):
    def load(self):
        for a in range(10):
            for b in range(10):
                yield SumTask(SumData(prompt=f"What is {a} + {b}?", system_prompt="Answer with a number.",
                                      answer=str(a + b)), self.config.task)

class FragileTask(SumTask):
    @vf.reward
    async def fragile(self, task, trace) -> float:
        if trace.last_reply == "boom":
            raise RuntimeError("the scorer broke")
        if trace.last_reply == "hang":
            time.sleep(30)
        return 1.0

class FragileTaskset(vf.Taskset[FragileTask, vf.TasksetConfig]):
    def load(self):
        yield FragileTask(SumData(prompt="What is 1 + 1?", answer="2"), self.config.task)

def sums():
    return SumTaskset(vf.TasksetConfig())

def fragile():
    return FragileTaskset(vf.TasksetConfig())

NOT_A_TASKSET = 42
'''


@pytest.fixture
def tasksets(tmp_path, monkeypatch):
    (tmp_path / "vf_tasks.py").write_text(TASKSET)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def answers_policy():
    async def act(messages):
        a, b = messages[-1]["content"].removeprefix("What is ").removesuffix("?").split(" + ")
        return str(int(a) + int(b))
    return act


def test_the_held_out_split_is_disjoint_and_the_prompt_is_the_tasks(tasksets):
    spec = get_task("verifiers")
    opts = {"taskset": "vf_tasks:sums", "eval_fraction": 0.2}
    held = spec.eval_tasks(opts)
    train = [t for t, _ in zip(spec.train_tasks(0, opts), range(100 - len(held)))]
    held_prompts = {t["data"]["prompt"] for t in held}
    assert 5 <= len(held) <= 40 and not held_prompts & {t["data"]["prompt"] for t in train}
    assert len(held_prompts | {t["data"]["prompt"] for t in train}) == 100
    env = spec.make_env(options=opts)
    assert trio.run(env.reset, held[0]) == [{"role": "system", "content": "Answer with a number."},
                                            {"role": "user", "content": held[0]["data"]["prompt"]}]


def test_its_rewards_are_the_components_with_their_weights_and_metrics_are_not(tasksets):
    spec = get_task("verifiers")
    opts = {"taskset": "vf_tasks:sums", "num_eval": 1}
    env = spec.make_env(options=opts)
    task = spec.eval_tasks(opts)[0]
    trio.run(env.reset, task)
    result = trio.run(env.step, str(eval(task["data"]["prompt"].removeprefix("What is ").rstrip("?"))))
    assert result.done and result.reward.components == {"correct": 1.0, "brief": 1.0}
    assert result.reward.weights == {"correct": 1.0, "brief": 0.25} and result.reward.total == 1.25
    held = spec.eval_tasks({"taskset": "vf_tasks:sums"})
    scored = trio.run(lambda: evaluate("scripted", "verifiers", {"taskset": "vf_tasks:sums"}, None, 8,
                                       policy=answers_policy()))
    assert scored["num_tasks"] == len(held) and scored["accuracy"] == 1.0


@pytest.mark.parametrize("reply, reason", [("boom", r"verifiers scoring raised .*the scorer broke"),
                                           ("hang", r"verifiers scoring did not return within 0.5 s")])
def test_a_scorer_that_raises_or_hangs_fails_only_its_sample(tasksets, reply, reason):
    spec = get_task("verifiers")
    opts = {"taskset": "vf_tasks:fragile", "eval_fraction": 0.99, "score_timeout_s": 0.5}
    (task,) = spec.eval_tasks(opts)
    env = spec.make_env(options=opts)
    trio.run(env.reset, task)
    with pytest.raises(RewardFailure, match=reason):
        trio.run(env.step, reply)


def test_a_bad_taskset_is_named(tasksets):
    with pytest.raises(TaskOptionsError, match=r"'vf_tasks:NOT_A_TASKSET' is a int, not a verifiers.v1.Taskset"):
        get_task("verifiers").eval_tasks({"taskset": "vf_tasks:NOT_A_TASKSET"})
    with pytest.raises(TaskOptionsError, match=r"cannot load the verifiers taskset 'vf_tasks:nope'"):
        get_task("verifiers").eval_tasks({"taskset": "vf_tasks:nope"})

TOOL_TASKSET = '''
import subprocess
import time
import verifiers.v1 as vf
from verifiers.v1.types import content_text

class CalcToolset(vf.Toolset[vf.ToolsetConfig]):
    @vf.tool
    def add(self, a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    @vf.tool
    async def divide(self, a: float, b: float) -> float:
        """Divide a by b."""
        return a / b

    @vf.tool
    def slow(self) -> str:
        """Take a while."""
        time.sleep(3)
        return "late"

    @vf.tool(name="python")
    def run_python(self, code: str) -> str:
        """Run Python code and return what it prints."""
        return subprocess.run(["python", "-c", code], capture_output=True, text=True).stdout

    @vf.tool
    def shell(self, command: str) -> str:
        """Run a shell command line."""
        return subprocess.run(command, shell=True, capture_output=True, text=True).stdout

class CalcData(vf.TaskData):
    answer: str

class CalcTask(vf.Task[CalcData, vf.State, vf.TaskConfig]):
    @classmethod
    def toolsets(cls, config):
        return [CalcToolset(vf.ToolsetConfig())]

    @vf.reward(weight=1.0)
    async def correct(self, task, trace) -> float:
        return float(trace.last_reply == task.answer)

    @vf.reward(weight=0.5)
    async def answer_seen(self, task, trace) -> float:
        return float(any(task.answer in content_text(m.content) for m in trace.tool_messages))

    @vf.reward(weight=0.0)
    async def num_calls(self, trace) -> float:
        return float(sum(len(m.tool_calls or []) for m in trace.assistant_messages))

    @vf.reward(weight=0.0)
    async def stopped(self, trace) -> float:
        return {None: 0.0, "max_turns": 1.0, "enough": 2.0}[trace.stop_condition]

    @vf.stop
    async def enough(self, trace: vf.Trace) -> bool:
        return len(trace.tool_messages) >= 4

class CalcTaskset(vf.Taskset[CalcTask, vf.TasksetConfig]):
    def load(self):
        for a in range(6):
            yield CalcTask(CalcData(prompt=f"What is {a} * 7 + 5?", system_prompt="Use the tools.",
                                    answer=str(a * 7 + 5)), self.config.task)

class NoStopTask(CalcTask):
    enough = None

class NoStopTaskset(vf.Taskset[NoStopTask, vf.TasksetConfig]):
    def load(self):
        yield NoStopTask(CalcData(prompt="What is 2 + 3?", answer="5"), self.config.task)

def calc_no_stop():
    return NoStopTaskset(vf.TasksetConfig())

class ResponseStopTask(CalcTask):
    @vf.stop
    async def on_response(self, response: vf.Response) -> bool:
        return False

class ResponseStopTaskset(vf.Taskset[ResponseStopTask, vf.TasksetConfig]):
    def load(self):
        yield ResponseStopTask(CalcData(prompt="What is 1 + 1?", answer="2"), self.config.task)

def calc():
    return CalcTaskset(vf.TasksetConfig())

class AgainConfig(vf.EnvConfig):
    assistant: vf.AgentConfig = vf.AgentConfig()

class AgainEnv(vf.Env[AgainConfig]):
    async def run(self, task, agents):
        async with agents.assistant.interaction(task) as chat:
            await chat.turn()
            await chat.turn("Are you sure? Answer again.")

def response_stop():
    return ResponseStopTaskset(vf.TasksetConfig())
'''


@pytest.fixture
def tool_tasksets(tmp_path, monkeypatch):
    (tmp_path / "vf_tools.py").write_text(TOOL_TASKSET)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


@pytest.fixture(scope="module")
def sandbox():
    policy = Policy(wall_time_s=10.0, cpu_time_s=10, memory_mb=256, max_processes=24, work_dir_size_mb=8,
                    max_output_bytes=65536)
    with Sandbox(policy, mode="warm", num_workers=1) as sb:
        yield LocalSandbox(sb)


def scripted(*actions):
    queue = list(actions)

    async def policy(messages):
        return queue.pop(0)
    return policy


def play(options: dict, *actions, sandbox=None, task_index: int = 0):
    spec = get_task("verifiers")
    options = {"eval_fraction": 0.99, **options}
    task = spec.eval_tasks(options)[task_index]
    env = spec.make_env(sandbox=sandbox, options=options)
    return task, trio.run(run_episode, env, task, scripted(*actions))


def test_a_tool_episode_calls_named_tools_runs_code_in_the_sandbox_and_is_scored_on_the_whole_trace(
        tool_tasksets, sandbox):
    options = {"taskset": "vf_tools:calc", "sandbox_tools": {"python": "python", "shell": "bash"}}
    assert get_task("verifiers").needs_sandbox(options) and not get_task("verifiers").needs_sandbox(
        {"taskset": "vf_tools:calc"})
    task, episode = play(options, format_named_call("add", {"a": 0, "b": 5}),
                         'I will check.\n<tool name="python">print(0 * 7 + 5)</tool>',
                         "<tool name='shell'>\n```\necho from-the-jail; hostname\n```\n</tool>", "5",
                         sandbox=sandbox)
    system = episode.messages[0]["content"]
    assert system.startswith("Use the tools.\n\nYou can call these tools:")
    assert "- add(a: integer, b: integer): Add two integers." in system
    assert "- python(code: string): Run Python code and return what it prints." in system
    assert [m["content"] for m in episode.messages[3:7:2]] == ["<output>\n5\n</output>"] * 2
    shell_output = episode.messages[7]["content"]
    assert "from-the-jail" in shell_output and shell_output.endswith("[exit status 0]\n</output>")
    assert episode.num_turns == 4 and not episode.truncated
    assert episode.reward.components == {"correct": 1.0, "answer_seen": 1.0, "num_calls": 3.0, "stopped": 0.0}
    assert episode.reward.weights["answer_seen"] == 0.5 and episode.reward.total == 1.5
    assert [info["well_formed"] for info in episode.infos[:3]] == [True, False, False]  # raw body; fence


def test_postrain_eval_plays_the_tool_loop_with_a_sandbox(tool_tasksets):
    async def act(messages):
        if messages[-1]["content"].startswith("<output>"):
            return messages[-1]["content"].split("\n")[1]
        return f'<tool name="python">print({messages[-1]["content"].removeprefix("What is ").rstrip("?")})</tool>'
    options = {"taskset": "vf_tools:calc", "eval_fraction": 0.99, "sandbox_tools": {"python": "python"}}
    scored = trio.run(lambda: evaluate("scripted", "verifiers", options, None, 8, policy=act))
    assert scored["num_tasks"] == 6 and scored["num_failed"] == 0 and scored["accuracy"] == 1.0


def test_the_tool_loop_ends_at_the_tasks_stop_hook_or_at_max_turns(tool_tasksets):
    add = format_named_call("add", {"a": 1, "b": 1})
    _, stopped = play({"taskset": "vf_tools:calc"}, add, add, add, add, "never asked")
    assert stopped.num_turns == 4 and not stopped.truncated and stopped.infos[-1]["stop"] == "enough"
    assert stopped.reward.components["stopped"] == 2.0 and stopped.reward.components["num_calls"] == 4.0
    _, out_of_turns = play({"taskset": "vf_tools:calc", "max_turns": 2}, add, add)
    assert out_of_turns.truncated and out_of_turns.reward.components == {
        "correct": 0.0, "answer_seen": 0.0, "num_calls": 2.0, "stopped": 1.0}


def test_a_tool_that_raises_hangs_or_is_called_badly_answers_the_model_and_the_episode_goes_on(tool_tasksets):
    _, episode = play({"taskset": "vf_tools:calc_no_stop", "tool_timeout_s": 0.5, "max_turns": 9},
                      format_named_call("divide", {"a": 1, "b": 0}),
                      format_named_call("slow", {}),
                      format_named_call("multiply", {"a": 2}),
                      '<tool name="add">{"a": 1, b: 2}</tool>',
                      '<tool name="add">[1, 2]</tool>',
                      format_named_call("add", {"a": 1}),
                      '<tool>{"a": 1, "b": 2}</tool>',
                      format_named_call("python", {"code": "print(1)"}),
                      "5")
    outputs = [m["content"] for m in episode.messages[3::2]]
    assert outputs[0] == "<output>\n[error: tool 'divide' raised ZeroDivisionError: float division by zero]\n</output>"
    assert outputs[1] == "<output>\n[error: tool 'slow' did not return within 0.5 s]\n</output>"
    assert "[error: there is no tool 'multiply'; the tools are ['add', 'divide', 'python', 'shell', 'slow']]" \
        in outputs[2]
    assert "the arguments of tool 'add' are not JSON (Expecting property name" in outputs[3]
    assert 'write them as one JSON object: <tool name="NAME">{"argument": "value"}</tool>' in outputs[3]
    assert "the arguments of tool 'add' must be a JSON object, got a list" in outputs[4]
    assert "[error: bad arguments for tool 'add': b: Field required]" in outputs[5]
    assert "a tool call needs the tool's name" in outputs[6]
    assert outputs[7] == "<output>\n1\n</output>"  # not a sandbox tool here: its own body ran
    assert episode.num_turns == 9 and episode.reward.components["num_calls"] == 7.0


def test_stop_hooks_on_a_response_are_refused_by_name(tool_tasksets):
    with pytest.raises(EnvironmentContractError, match=r"ResponseStopTask has @vf.stop hooks on a Request or "
                                                 r"Response \(\['on_response'\]\).*fix: make them take"):
        play({"taskset": "vf_tools:response_stop"}, "2")


def test_a_sandbox_tool_must_take_one_string(tool_tasksets):
    spec = get_task("verifiers")
    with pytest.raises(TaskOptionsError, match=r"the sandbox tool 'add' must take one str argument"):
        spec.make_env(options={"taskset": "vf_tools:calc", "sandbox_tools": {"add": "python"}})
    with pytest.raises(TaskOptionsError, match=r"sandbox_tools names 'nope', which is not a tool of CalcTask"):
        spec.make_env(options={"taskset": "vf_tools:calc", "sandbox_tools": {"nope": "bash"}})
    with pytest.raises(TaskOptionsError, match=r"sandbox_tools\.python"):
        spec.make_env(options={"taskset": "vf_tools:calc", "sandbox_tools": {"python": "ruby"}})


HINT_ENV = '''
import verifiers.v1 as vf

class GuessData(vf.TaskData):
    answer: str

class GuessTask(vf.Task[GuessData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def solved(self, task, trace) -> float:
        return float(trace.last_reply == task.answer)

    @vf.reward(weight=0.0)
    async def turns(self, trace) -> float:
        return float(trace.num_turns)

class GuessTaskset(vf.Taskset[GuessTask, vf.TasksetConfig]):
    def load(self):
        yield GuessTask(GuessData(prompt="Guess my number, 1 to 10.", answer="7"), self.config.task)

class HintConfig(vf.EnvConfig):
    assistant: vf.AgentConfig = vf.AgentConfig()
    max_hints: int = 3

class HintEnv(vf.Env[HintConfig]):
    async def run(self, task, agents):
        async with agents.assistant.interaction(task) as chat:
            segment = await chat.turn()
            for _ in range(self.config.max_hints):
                if segment.terminated or segment.last_reply == task.data.answer:
                    return
                guess = int(segment.last_reply)
                segment = await chat.turn("higher" if guess < int(task.data.answer) else "lower")

class BrokenEnv(HintEnv):
    async def run(self, task, agents):
        async with agents.assistant.interaction(task) as chat:
            await chat.turn()
            raise ValueError("the env broke")

def guess():
    return GuessTaskset(vf.TasksetConfig())
'''


def test_an_envs_own_next_turns_drive_a_multi_turn_episode(tool_tasksets):
    (tool_tasksets / "vf_hints.py").write_text(HINT_ENV)
    options = {"taskset": "vf_hints:guess", "env": "vf_hints:HintEnv"}
    _, solved = play(options, "5", "8", "7")
    assert [m["content"] for m in solved.messages] == ["Guess my number, 1 to 10.", "5", "higher", "8", "lower", "7"]
    assert not solved.truncated and solved.reward.components == {"solved": 1.0, "turns": 3.0}
    _, out_of_hints = play(options, "1", "2", "3", "4")
    assert not out_of_hints.truncated and out_of_hints.reward.components == {"solved": 0.0, "turns": 4.0}
    spec = get_task("verifiers")
    env = spec.make_env(options={**options, "max_turns": 2})
    truncated = trio.run(run_episode, env, spec.eval_tasks({**options, "eval_fraction": 0.99})[0], scripted("1", "2"))
    assert truncated.truncated and truncated.reward.components == {"solved": 0.0, "turns": 2.0}
    trio.run(env.close)   # the env's run, still waiting for a turn, sees the exchange end
    assert env.relay.events.get(timeout=10) == ("end", None)


def test_an_env_that_raises_or_asks_for_another_model_fails_its_sample_by_name(tool_tasksets):
    (tool_tasksets / "vf_hints.py").write_text(HINT_ENV)
    with pytest.raises(EnvironmentFailure, match=r"the verifiers env's run raised ValueError: the env broke"):
        play({"taskset": "vf_hints:guess", "env": "vf_hints:BrokenEnv"}, "5")
    with pytest.raises(EnvironmentFailure, match=r"asked for agent 'user', but postrain plays only its model as "
                                                 r"'assistant'"):
        play({"taskset": "vf_hints:guess", "env": "verifiers.v1.envs.user_sim:UserSimEnv"}, "5")
    with pytest.raises(TaskOptionsError, match=r"'vf_hints:guess' is a function, not a verifiers.v1.Env subclass"):
        get_task("verifiers").make_env(options={"taskset": "vf_hints:guess", "env": "vf_hints:guess"})


@pytest.mark.slow
def test_a_short_run_on_a_verifiers_tool_taskset_balances_its_ledger(tool_tasksets, monkeypatch):
    """The tiny model plays a tool task under an env that asks twice: multi-turn episodes (the env's
    run in the env actor), with any tool calls the model makes, from the real generator."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1]))
    from task_runs import run_task   # tests/actors/task_runs.py
    summary, folder = run_task(tool_tasksets, "verifiers", {"taskset": "vf_tools:calc", "env": "vf_tools:AgainEnv",
                                                            "num_eval": 2, "max_turns": 3})
    ledger = summary["ledger"]
    assert summary["steps"] == 1 and ledger["created"] == 6 and ledger["in_flight"] == 0
    assert ledger["created"] == ledger["trained"] + ledger["dropped"] and ledger["trained"] == 6
    episodes = [json.loads(line) for line in (folder / "ledger.jsonl").read_text().splitlines()]
    turns = [e["num_turns"] for e in episodes if e["event"] == "episode"]
    assert len(turns) == 6 and all(n >= 2 for n in turns)   # the env asked again each time
    assert sorted(p.stem for p in (folder / "logs").iterdir()) == ["env", "generator", "learner", "orchestrator"]
