"""The roles that never run the model start without importing torch (about 2 s of CPU a process).

The environment actor renders prompts and grades them, the sandbox runs commands, and the
orchestrator drives the loop: they read a model spec's tokenizer and image layout
(models/spec.py, models/images.py) but never its weights, and write TensorBoard events with
tensorboard's own writer (core/metrics.py). (The orchestrator imports torch later, for the
advantages it writes to samples.jsonl, once RL has started.)
"""
from __future__ import annotations

import subprocess
import sys

CHECK = """
import sys
import postrain.actors.env as env, postrain.actors.orchestrator as orchestrator, postrain.actors.sandbox as sandbox
from postrain.actors.models.spec import check_model_spec, packaged_model_path, spec_image_layout, spec_tokenizer
from postrain.core.metrics import MetricsWriter

env.EnvironmentActor, orchestrator.OrchestratorActor, sandbox.SandboxActor
check_model_spec("tiny"), spec_image_layout("tiny"), spec_tokenizer("tiny").encode("12+34")
if packaged_model_path("smollm2") is not None:   # a .gguf spec: its tokenizer from the file's metadata
    spec_tokenizer("smollm2").encode("12+34")
MetricsWriter(sys.argv[1]).log("step", step=1, loss=0.5)
print(sorted(name for name in sys.modules if name.split(".")[0] == "torch"))
"""


def test_the_env_orchestrator_and_sandbox_classes_and_a_model_spec_import_no_torch(tmp_path):
    result = subprocess.run([sys.executable, "-c", CHECK, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", result.stdout
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))   # the scalars are still written
