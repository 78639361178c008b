"""A small OpenEnv environment written with its own API, for tests: the model must say a word."""
from openenv.core.env_server.http_server import create_fastapi_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

WORDS = ["apple", "river", "stone", "cloud"]


class SayAction(Action):
    message: str


class WordObservation(Observation):
    prompt: str = ""


class WordEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self._state, self.word = State(step_count=0), WORDS[0]

    def reset(self, seed=None, episode_id=None, **kwargs) -> WordObservation:
        self.word = WORDS[(seed or 0) % len(WORDS)]
        self._state = State(episode_id=episode_id, step_count=0)
        return WordObservation(prompt=f"Say the word {self.word}.", done=False, reward=0.0)

    def step(self, action: SayAction, **kwargs) -> WordObservation:
        self._state.step_count += 1
        right = action.message.strip().rstrip(".").lower() == self.word
        done = right or self._state.step_count >= 2
        return WordObservation(prompt=f"No. Say the word {self.word}.", done=done, reward=1.0 if right else 0.0)

    @property
    def state(self) -> State:
        return self._state


app = create_fastapi_app(WordEnvironment, SayAction, WordObservation, max_concurrent_envs=8)
