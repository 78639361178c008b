"""postrain.actors"""

# The public Environment API and the task registry (actors/environment.py, actors/tasks/).
from .environment import (Environment, EnvironmentContractError, EnvironmentFailure, Episode,
                          GeneratorHandle, LocalSandbox, Reward, SandboxHandle, StepResult,
                          checked_reset, checked_step, checked_truncated, drop_reason,
                          load_environment_class, run_episode, validate_observation,
                          validate_step_result)
from .tasks import TaskSpec, get_task, list_tasks, register_task
