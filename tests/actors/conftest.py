"""The test helpers of tests/actors (scripted_envs.py, task_runs.py, fsdp_ranks.py,
model_folders.py) import by name from every folder below, and from the actor processes the tests
start (they inherit sys.path)."""
import sys
from pathlib import Path

HELPERS = str(Path(__file__).resolve().parent)
if HELPERS not in sys.path:
    sys.path.insert(0, HELPERS)
