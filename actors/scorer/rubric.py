"""Rubrics: what a judge grades by, the verdict formats it answers in, and the escaping that
keeps a policy's output from speaking to it as the rubric does (actors/scorer/judge.py asks the
judge; docs/scorers.md, "Judges").

    rubric = Rubric("Score how clearly the answer explains each step.", ScoreVerdict(0, 10))
    rubric.digest                 # names the rubric and the prompt's version in caches and traces
    escape_output(text)           # the output as the judge's prompt fences it

Verdict formats: `ScoreVerdict(low, high)` (a number in range, the reward scaled to [0, 1]),
`PassFailVerdict()` (PASS / FAIL: 1 / 0), `JsonVerdict(field, low, high)` (a JSON object's numeric
field). Each parses one verdict strictly and, for choice mode, lists its allowed values.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import re
import unicodedata
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import ConfigDict, Field

from postrain.core.errors import ConfigError

#: Bumped whenever the prompt's wording or the escaping changes: it is part of every rubric's
#: digest, so a cache or a trace never mixes verdicts given to different prompts.
PROMPT_VERSION = 1
VERDICT_MARKER = "VERDICT:"
CHOICE_PREFIX = VERDICT_MARKER + " "   # choice mode: the assistant's turn is opened with this text
MAX_CHOICES = 101                      # choice mode: a score's range holds at most this many integers
DEFAULT_MAX_OUTPUT_CHARS = 16_000
_NO_EXTRA = ConfigDict(extra="forbid")    # a rubric read from a config names a misspelt key


class RubricError(ConfigError):
    """A rubric or a judge setting that breaks a rule (the message names the field and the fix)."""



def format_number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def _check_range(low: Any, high: Any, where: str) -> tuple[float, float]:
    for name, value in (("low", low), ("high", high)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise RubricError(f"{where}.{name} must be a finite number, got {value!r}; fix: e.g. {where}(0, 10)")
    if not low < high:
        raise RubricError(f"{where} needs low < high, got low={low!r}, high={high!r}; fix: e.g. {where}(0, 10)")
    return float(low), float(high)


_NUMBER = re.compile(r"[-+]?(?:[0-9]+(?:\.[0-9]+)?|\.[0-9]+)")   # ASCII digits only


# --------------------------------------------------------------------------- verdict formats
@dataclass(frozen=True)
class ScoreVerdict:
    """The verdict is a number in [low, high]; the reward is it scaled to [0, 1]."""

    low: float
    high: float
    kind: Literal["score"] = "score"
    __pydantic_config__: ClassVar[ConfigDict] = _NO_EXTRA

    def __post_init__(self) -> None:
        low, high = _check_range(self.low, self.high, "ScoreVerdict")
        object.__setattr__(self, "low", low)
        object.__setattr__(self, "high", high)

    @property
    def placeholder(self) -> str:
        return f"<a number from {format_number(self.low)} to {format_number(self.high)}>"

    def describe(self) -> str:
        return (f"Your verdict is a score: one number from {format_number(self.low)} to {format_number(self.high)} "
                f"(digits, optionally with a decimal point), written alone after the marker.")

    def parse(self, value: str) -> float:
        if not _NUMBER.fullmatch(value):
            raise ValueError(f"the verdict must be a plain number, got {value[:40]!r}")
        raw = float(value)
        if not self.low <= raw <= self.high:
            raise ValueError(f"the verdict {value} is outside [{format_number(self.low)}, {format_number(self.high)}]")
        return raw

    def scale(self, raw: float) -> float:
        return (raw - self.low) / (self.high - self.low)

    def choices(self) -> list[tuple[str, float]]:
        """Choice mode's values: each integer of [low, high], as written and as raw."""
        return [(str(i), float(i)) for i in range(math.ceil(self.low), math.floor(self.high) + 1)]


@dataclass(frozen=True)
class PassFailVerdict:
    """The verdict is PASS or FAIL; the reward is 1 or 0."""

    kind: Literal["pass_fail"] = "pass_fail"
    __pydantic_config__: ClassVar[ConfigDict] = _NO_EXTRA

    @property
    def placeholder(self) -> str:
        return "<PASS or FAIL>"

    def describe(self) -> str:
        return "Your verdict is PASS or FAIL, in capitals, written alone after the marker."

    def parse(self, value: str) -> float:
        if value not in ("PASS", "FAIL"):
            raise ValueError(f"the verdict must be PASS or FAIL, got {value[:40]!r}")
        return 1.0 if value == "PASS" else 0.0

    def scale(self, raw: float) -> float:
        return raw

    def choices(self) -> list[tuple[str, float]]:
        """Choice mode's values, as written and as raw."""
        return [("PASS", 1.0), ("FAIL", 0.0)]


@dataclass(frozen=True)
class JsonVerdict:
    """The verdict is a one-line JSON object whose `field` is a number in [low, high]; the reward
    is that number scaled to [0, 1]. Other keys (a reason) are allowed and kept in the call's record."""

    field: str
    low: float
    high: float
    kind: Literal["json"] = "json"
    __pydantic_config__: ClassVar[ConfigDict] = _NO_EXTRA

    def __post_init__(self) -> None:
        if not isinstance(self.field, str) or not self.field.strip():
            raise RubricError(f"JsonVerdict.field must name the JSON key holding the score, got {self.field!r}; "
                              f"fix: e.g. JsonVerdict('score', 0, 10)")
        low, high = _check_range(self.low, self.high, "JsonVerdict")
        object.__setattr__(self, "low", low)
        object.__setattr__(self, "high", high)

    @property
    def placeholder(self) -> str:
        return f'{{"{self.field}": <a number from {format_number(self.low)} to {format_number(self.high)}>}}'

    def describe(self) -> str:
        return (f"Your verdict is a JSON object on one line whose key \"{self.field}\" holds a number from "
                f"{format_number(self.low)} to {format_number(self.high)} (other keys, such as a short reason, are allowed).")

    def parse(self, value: str) -> float:
        def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
            keys = [k for k, _ in pairs]
            if len(set(keys)) != len(keys):
                raise ValueError(f"the verdict's JSON repeats a key: {sorted(k for k in set(keys) if keys.count(k) > 1)}")
            return dict(pairs)
        try:
            data = json.loads(value, object_pairs_hook=no_duplicates)
        except json.JSONDecodeError as exc:
            raise ValueError(f"the verdict is not JSON ({exc.msg}): {value[:60]!r}") from None
        if not isinstance(data, dict):
            raise ValueError(f"the verdict must be a JSON object, got {type(data).__name__} {value[:40]!r}")
        if self.field not in data:
            raise ValueError(f"the verdict's JSON has no key {self.field!r} (keys: {sorted(data)[:5]})")
        raw = data[self.field]
        if isinstance(raw, bool) or not isinstance(raw, (int, float)) or not math.isfinite(raw):
            raise ValueError(f"the verdict's {self.field!r} must be a finite number, got {raw!r:.40}")
        if not self.low <= raw <= self.high:
            raise ValueError(f"the verdict's {self.field!r} = {raw} is outside [{format_number(self.low)}, {format_number(self.high)}]")
        return float(raw)

    def scale(self, raw: float) -> float:
        return (raw - self.low) / (self.high - self.low)

    def choices(self) -> list[tuple[str, float]]:
        """None: a JSON object is written, not chosen (a Rubric refuses it in choice mode)."""
        return []


VerdictFormat = Annotated[Union[ScoreVerdict, PassFailVerdict, JsonVerdict], Field(discriminator="kind")]


# --------------------------------------------------------------------------- the rubric
@dataclass(frozen=True)
class Rubric:
    """What to judge and how the verdict is written, and the judge's sampling.

    instructions: the criteria, as the judge reads them (trusted text: the task author's);
    verdict: ScoreVerdict(low, high), PassFailVerdict() or JsonVerdict(field, low, high);
    temperature (0: greedy) and max_new_tokens: the judge's sampling (a reply cut by the token
    limit has no verdict line and fails); max_output_chars: the policy's output is cut there;
    mode: "reply" (the judge writes its reply, the verdict is its last line) or "choice" (the
    judge writes nothing: the verdict is the value the format allows that it finds most likely
    after `VERDICT: `, read from its logprobs; PassFailVerdict, or a ScoreVerdict of at most
    MAX_CHOICES integers; sampling unused).
    A task's options may hold one (a pydantic field of type Rubric reads
    `{instructions = "...", verdict = {kind = "score", low = 0, high = 10}}`)."""

    instructions: str
    verdict: VerdictFormat
    temperature: float = 0.0
    max_new_tokens: int = 1024
    max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS
    mode: Literal["reply", "choice"] = "reply"
    __pydantic_config__: ClassVar[ConfigDict] = _NO_EXTRA

    def __post_init__(self) -> None:
        if not isinstance(self.instructions, str) or not self.instructions.strip():
            raise RubricError(f"Rubric.instructions must be the criteria as text, got {self.instructions!r}; "
                              f"fix: e.g. 'PASS if the answer names the capital of France'")
        if not isinstance(self.verdict, (ScoreVerdict, PassFailVerdict, JsonVerdict)):
            raise RubricError(f"Rubric.verdict must be ScoreVerdict(low, high), PassFailVerdict() or "
                              f"JsonVerdict(field, low, high), got {self.verdict!r}")
        checks = [(isinstance(self.temperature, (int, float)) and not isinstance(self.temperature, bool)
                   and self.temperature >= 0, "temperature", ">= 0 (0 = greedy)"),
                  (isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1, "max_new_tokens", ">= 1"),
                  (isinstance(self.max_output_chars, int) and self.max_output_chars >= 1, "max_output_chars", ">= 1")]
        for ok, name, rule in checks:
            if not ok:
                raise RubricError(f"Rubric.{name} must be {rule}, got {getattr(self, name)!r}")
        if self.mode not in ("reply", "choice"):
            raise RubricError(f"Rubric.mode must be 'reply' (the judge writes its verdict) or 'choice' (the verdict "
                              f"is read from its logprobs), got {self.mode!r}")
        if self.mode == "choice":
            if isinstance(self.verdict, JsonVerdict):
                raise RubricError("Rubric(mode='choice') cannot take a JsonVerdict: a JSON object is written, not "
                                  "chosen among a few values; fix: PassFailVerdict() or ScoreVerdict(low, high) "
                                  "in choice mode, or mode='reply'")
            n = len(self.verdict.choices())
            if isinstance(self.verdict, ScoreVerdict) and not 1 <= n <= MAX_CHOICES:
                raise RubricError(f"Rubric(mode='choice') chooses among the integers of the ScoreVerdict's range, "
                                  f"and [{format_number(self.verdict.low)}, {format_number(self.verdict.high)}] holds {n} (at most "
                                  f"{MAX_CHOICES}); fix: e.g. ScoreVerdict(0, 10), or mode='reply'")

    @functools.cached_property
    def digest(self) -> str:
        """16 hex digits naming this rubric and the prompt version: the cache's and the trace's key."""
        data = {"prompt_version": PROMPT_VERSION, "instructions": self.instructions,
                "verdict": dataclasses.asdict(self.verdict), "temperature": float(self.temperature),
                "max_new_tokens": self.max_new_tokens, "max_output_chars": self.max_output_chars}
        if self.mode != "reply":      # reply mode's digests are the ones from before the mode existed
            data["mode"] = self.mode
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]

    @property
    def sampling(self) -> dict[str, Any]:
        """The keyword arguments of the handle's call (SamplingParams' names)."""
        return {"temperature": float(self.temperature), "max_new_tokens": self.max_new_tokens}


# --------------------------------------------------------------------------- escaping
# A '<' (or a look-alike) that opens a tag, a closing tag or a special token: </output-..>, <|im_end|>,
# <｜end▁of▁sentence｜>, </s>, <start_of_turn>, <!-- -->. A '<' before a space or a digit (a < b) stays.
_TAG_OPEN = re.compile(r"[<\uff1c\ufe64](?=[ \t]*/|[|\uff5c!?A-Za-z])")
# A '[' that opens a control token: [INST], [/INST], [SYSTEM_PROMPT], [TOOL_CALLS].
_CONTROL_OPEN = re.compile(r"\[(?=/?[A-Z][A-Z_]+\])")
# The word verdict, however written, before a colon (or a look-alike): the colon is escaped.
_VERDICT_COLON = re.compile(r"(verdict[ \t*_`~\"'\])]*)[:\uff1a\ufe55\ufe13]", re.IGNORECASE)
_ESCAPED_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})   # control, format, surrogate, line/para seps


def _escape_char(ch: str) -> str:
    code = ord(ch)
    if 0xDC80 <= code <= 0xDCFF:          # an undecodable byte (surrogateescape): shown as that byte
        return f"\\x{code - 0xDC00:02x}"
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def _escape_invisible(text: str) -> str:
    if text.replace("\n", "").replace("\t", "").isprintable():   # the common case: nothing to escape
        return text
    return "".join(_escape_char(ch) if ch not in "\n\t" and unicodedata.category(ch) in _ESCAPED_CATEGORIES
                   else ch for ch in text)


def escape_output(output: str | bytes, max_chars: int = DEFAULT_MAX_OUTPUT_CHARS) -> str:
    """The policy's output as the judge sees it inside the fence: bytes decoded (an undecodable
    byte shown as `\\xNN`), CRLF made LF, cut to `max_chars` characters with a visible mark, and
    escaped as the module docstring says, so that it holds no fence tag, special token, verdict
    line or control character. For display to the judge only: it is not reversible."""
    text = output.decode("utf-8", errors="surrogateescape") if isinstance(output, (bytes, bytearray)) else output
    if not isinstance(text, str):
        raise TypeError(f"a judged output must be str or bytes, got {type(output).__name__}")
    text = text.replace("\r\n", "\n")
    cut = ""
    if len(text) > max_chars:
        cut = (f"\n[... cut by the judge's harness: the output has {len(text)} characters, "
               f"the first {max_chars} are shown ...]")
        text = text[:max_chars]
    text = _escape_invisible(text)
    text = _TAG_OPEN.sub("&lt;", text)
    text = _CONTROL_OPEN.sub("&#91;", text)
    text = _VERDICT_COLON.sub(r"\1&#58;", text)
    return text + cut
