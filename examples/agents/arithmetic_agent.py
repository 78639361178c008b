"""An agent written with the OpenAI Agents SDK (`pip install "postrain[agents]"`), trained by postrain.

    postrain up --config examples/agents/arithmetic_agent.toml

The agent answers the built-in arithmetic task's questions with a `calculator` function tool,
the way any Agents SDK program would; postrain gives it an `openai.AsyncOpenAI` client at the
run's gateway, whose key is the episode's own, and trains exactly the tokens the policy sampled
along the way (docs/agents.md). The reward: 1 when the agent's final answer ends in the right
integer.
"""
from __future__ import annotations

import ast
import operator

from postrain.actors import AgentEnvironment, Reward
from postrain.actors.tasks import arithmetic

OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
INSTRUCTIONS = "Answer the question. Use the calculator tool for arithmetic, then reply with the number."


def calculate(expression: str) -> str:
    """The value of an integer + - * expression, or why it has none."""
    def walk(node):
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](walk(node.left), walk(node.right))
        raise ValueError("only integers with + - * are supported")
    try:
        return str(walk(ast.parse(expression, mode="eval")))
    except (SyntaxError, ValueError) as exc:
        return f"error: {exc}"


class ArithmeticAgent(AgentEnvironment):
    """The arithmetic task played by an OpenAI Agents SDK agent with a calculator tool."""

    max_turns = 4            # model calls per episode at most (the SDK's max_turns)
    max_tokens = 48          # tokens per model call

    @classmethod
    def train_tasks(cls, seed, options):
        return arithmetic.train_tasks(seed, options)

    @classmethod
    def eval_tasks(cls, options):
        return arithmetic.eval_tasks(options)

    async def run(self, client, task) -> Reward:
        from agents import (Agent, MaxTurnsExceeded, ModelSettings, OpenAIChatCompletionsModel, Runner,
                            function_tool, set_tracing_disabled)
        set_tracing_disabled(True)   # nothing leaves the machine

        @function_tool
        def calculator(expression: str) -> str:
            """Evaluate an integer arithmetic expression such as '12 * (3 + 4)'."""
            return calculate(expression)

        agent = Agent(name="arithmetic", instructions=INSTRUCTIONS, tools=[calculator],
                      model=OpenAIChatCompletionsModel(model=self.model, openai_client=client),
                      model_settings=ModelSettings(max_tokens=self.max_tokens))
        try:
            result = await Runner.run(agent, task["question"], max_turns=self.max_turns)
            answer = str(result.final_output or "")
        except MaxTurnsExceeded:
            answer = ""
        return Reward({"correct": float(arithmetic.plain_answer_correct(answer, task["answer"]))})
