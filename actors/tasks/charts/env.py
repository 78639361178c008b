"""`ChartsEnv`: read a company chart (an image) and answer a question that needs arithmetic on it.

The first observation is one user message whose content is OpenAI-style content parts, the chart
and then the question (the tool form puts the tool instructions in a system message before it):

    [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0..."}},
        {"type": "text", "text": "The chart shows ... Question: ... Answer: 1234.5"}]}]

- image form (`form = "image"`): one reply, no tool; its last number (or its answer tag's) is
  graded. No sandbox.
- tool form (`form = "tool"`): each `<python>` turn runs in the sandbox (up to `max_tool_calls`;
  beyond that the model is told to answer) and its output comes back as the next user turn;
  the first `<answer>...</answer>` turn is graded; a turn with neither scores 0.

Reward: `correct` 1.0 iff the graded number is within `tolerance` of the exact value
(`grading.grade`), else 0.0; the tool form adds `format` (weight `format_weight`), 1.0 if every
turn was a well-formed tool call or answer. The grader reads the final turn's text only, with the
expected value from the task. `info` holds the graded number and why it failed.
"""
from __future__ import annotations

from ...env.api import Environment, Reward, StepResult
from ...env.tools import TOOL_INSTRUCTIONS, format_observation, format_tool_output, parse_action
from .figures import Chart
from .grading import grade, graded_text
from .options import ChartsOptions
from .render import data_url, render_png

IMAGE_RULES = ("Work it out briefly, then end your reply with the final answer, one number, on its own line, "
               "for example: Answer: 1234.5")
TOOL_RULES = ("You may run Python to do the arithmetic. Write the final answer, one number, between <answer> and "
              "</answer>, for example <answer>1234.5</answer>.")


def chart_message(task: dict, form: str) -> dict:
    """The user message that shows the chart and asks the question (content parts: image, text)."""
    png = render_png(Chart.from_dict(task["chart"]))
    rules = IMAGE_RULES if form == "image" else TOOL_RULES
    text = f"The chart shows figures of a company. Question: {task['question']}\n\n{rules}"
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(png)}},
                                        {"type": "text", "text": text}]}


def first_messages(task: dict, form: str) -> list[dict]:
    """The episode's first messages: the tool form's instructions, then the chart and the question."""
    message = chart_message(task, form)
    return [message] if form == "image" else [{"role": "system", "content": TOOL_INSTRUCTIONS}, message]


class ChartsEnv(Environment):
    """Reads a chart (module docstring); `correct` on the graded number, and `format` in the tool form."""

    uses_sandbox = True
    options_model = ChartsOptions
    options: ChartsOptions

    @classmethod
    def needs_sandbox(cls, options: ChartsOptions) -> bool:
        """Only the tool form runs code."""
        return options.form == "tool"

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.max_turns = self.options.turns()

    async def reset(self, task: dict) -> list[dict]:
        """The first messages: the chart drawn and the question. Does not wait (cancel-safe)."""
        self.expected = float(task["answer"])
        self.num_tool_calls = 0
        self.all_well_formed = True
        return first_messages(task, self.options.form)

    def _graded(self, text: str) -> StepResult:
        verdict = grade(text, self.expected, tolerance=self.options.tolerance)
        info = {"answer": verdict.value, **({"problem": verdict.reason} if verdict.reason else {})}
        return StepResult(None, True, self._reward(verdict.correct), info)

    def _reward(self, correct: bool) -> Reward:
        if self.options.form == "image":
            return Reward({"correct": float(correct)})
        return Reward({"correct": float(correct), "format": float(self.all_well_formed)},
                      {"format": self.options.format_weight})

    async def step(self, action: str) -> StepResult:
        """Grade the turn, or (tool form) run its Python. Cancelled during a run: the call counts
        against max_tool_calls without an observation; the episode should not go on."""
        if self.options.form == "image":
            return self._graded(graded_text(action))
        parsed = parse_action(action)
        self.all_well_formed &= parsed.well_formed
        if parsed.kind == "answer":
            return self._graded(parsed.content)
        if parsed.kind == "none":
            return StepResult(None, True, self._reward(False), {"problem": parsed.problem})
        if self.num_tool_calls >= self.options.max_tool_calls:
            return StepResult(format_observation("No more tool calls: give your final answer between <answer> "
                                                 "and </answer>."), False)
        self.num_tool_calls += 1
        result = await self.require_sandbox().exec(parsed.content, timeout_s=self.options.tool_timeout_s)
        status = result.get("status") if isinstance(result, dict) else getattr(result, "status", None)
        return StepResult(format_tool_output(result), False, info={"tool_status": str(status)})

    async def truncated(self) -> Reward:
        """Out of turns without an answer: not correct. Does not wait (cancel-safe)."""
        return self._reward(False)
