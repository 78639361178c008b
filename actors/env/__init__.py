"""postrain.actors.env: the public Environment API, the one episode driver, tools, and the environment actor.

    api.py       Environment, StepResult, Reward, the handles, check_options: what a task is
    episode.py   run_episode and EpisodePolicy: the one driver of every episode (training and eval);
                 score_episodes: held-out tasks played and scored (postrain eval, the benches)
    context.py   ContextOptions: context policies for episodes longer than the context (segments)
    token_policy.py  TokenPolicy: the environment actor's exact-token policy, segment by segment
    user_errors.py  the user's code failing: drop reasons with their file:line, tracebacks of their
                 frames, EnvironmentErrors (a step that fails mostly by one error stops)
    tools.py     the tool-call grammar of turns: parse_action, format_tool_output, ...
    actor.py     EnvironmentActor: plays episodes on the generator and the sandbox for the orchestrator
    agent.py     AgentEnvironment: an episode is an agent program on the OpenAI API (through the gateway)

Configs name the actor `postrain.actors.env:EnvironmentActor`.
"""
from .agent import AgentEnvironment
from .api import (ROLES, AnyOptions, Environment, EnvironmentContractError, EnvironmentFailure,
                  LocalSandbox, Reward, SandboxHandle, StepResult, TaskOptionsError, check_options,
                  require_text_messages, validate_content_parts, validate_observation, validate_step_result)
from .context import ContextOptions
from .episode import (ActionFn, Episode, EpisodePolicy, TextPolicy, checked_reset, checked_step,
                      checked_truncated, run_episode, score_episodes)
from .scorers import EpisodeJudge, ScorerHandle, Scorers, SharedJudges
from .user_errors import EnvironmentErrors, EnvironmentErrorStop, drop_reason

__all__ = ["ROLES", "ActionFn", "AgentEnvironment", "AnyOptions", "ContextOptions", "Environment", "EnvironmentActor", "EnvironmentContractError",
           "EnvironmentErrorStop", "EnvironmentErrors",
           "EnvironmentFailure", "Episode", "EpisodeJudge", "EpisodePolicy", "LocalSandbox", "Reward",
           "SandboxHandle", "ScorerHandle", "Scorers", "SharedJudges", "StepResult", "TaskOptionsError", "TextPolicy", "check_options", "checked_reset",
           "checked_step", "checked_truncated", "drop_reason", "require_text_messages", "run_episode", "score_episodes",
           "validate_content_parts", "validate_observation",
           "validate_step_result"]


def __getattr__(name: str):
    """The actor imports torch (its tokenizer's model loader), so it loads on first use (PEP 562)."""
    if name == "EnvironmentActor":
        from .actor import EnvironmentActor
        return EnvironmentActor
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
