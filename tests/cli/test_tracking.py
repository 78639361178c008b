"""Experiment trackers (cli/tracking.py): metrics.jsonl's rows and the summary reach the backend.

MLflow (a local file store, the `test` extra installs mlflow-skinny) is tested for real here and in
a real run (tests/actors/tasks/test_dataset_task.py); W&B (offline) and trackio where installed.
"""
import importlib.util
import json
import sys

import pytest

from postrain.cli.config import parse_up_config
from postrain.cli.tracking import RunTracking, TrackingSection
from postrain.core.errors import ConfigError, PostrainError
from postrain.core.metrics import MetricsWriter

CONFIG = {"run": {"name": "tracked"}, "actors": [{"name": "env", "cls": "a.b:C", "options": {"x": 1}}]}


def write_rows(folder):
    writer = MetricsWriter(folder, tensorboard=False)
    writer.log("eval", phase="before", accuracy=0.25, num_tasks=4)
    writer.log("train", step=1, loss=0.5, reward_mean=0.1, objective="grpo")
    writer.log("train", step=2, loss=0.25, reward_mean=0.3)
    writer.log("queue", env_queued=3)
    writer.close()


def mlflow_run(folder, project="postrain"):
    from mlflow.tracking import MlflowClient
    client = MlflowClient((folder / "mlruns").resolve().as_uri())
    experiment = client.get_experiment_by_name(project)
    (run,) = client.search_runs([experiment.experiment_id])
    return client, run


def test_mlflow_gets_every_row_the_config_and_the_summary(tmp_path):
    write_rows(tmp_path)
    with RunTracking(tmp_path, TrackingSection(backends=["mlflow"]), "tracked", CONFIG).start() as tracking:
        with (tmp_path / "metrics.jsonl").open("a") as file:
            file.write('{"time": 1, "kind": "train", "step": 3, "loss": 0.1')   # a row being written
        assert tracking.poll() == 4
        (tmp_path / "summary.json").write_text(json.dumps({"eval_after": 0.75, "ledger": {
            "trained": 12, "drop_reasons": {"reward function 'x:y' raised": 2}}}))
    client, run = mlflow_run(tmp_path)
    assert run.info.status == "FINISHED" and run.info.run_name == "tracked"
    assert run.data.params["actors.env.options.x"] == "1" and run.data.params["run.name"] == "tracked"
    loss = client.get_metric_history(run.info.run_id, "train/loss")
    assert [(m.step, m.value) for m in loss] == [(1, 0.5), (2, 0.25)]
    assert run.data.metrics["eval/accuracy"] == 0.25 and run.data.metrics["queue/env_queued"] == 3
    assert run.data.metrics["summary/eval_after"] == 0.75 and run.data.metrics["summary/ledger/trained"] == 12
    assert "train/objective" not in run.data.metrics   # strings are not figures


def test_a_tracker_that_fails_mid_run_is_left_out_and_the_others_go_on(tmp_path, caplog):
    write_rows(tmp_path)

    class Broken:
        def log(self, *args):
            raise ConnectionError("service went away")

        def finish(self, summary):
            raise AssertionError("a dropped tracker is not finished")
    tracking = RunTracking(tmp_path, TrackingSection(backends=["mlflow"]), "tracked", CONFIG).start()
    tracking.trackers["broken"] = Broken()
    assert tracking.poll() == 4 and "broken" not in tracking.trackers
    assert "tracking backend broken failed (ConnectionError: service went away)" in caplog.text
    tracking.__exit__(None, None, None)
    assert mlflow_run(tmp_path)[1].data.metrics["train/loss"] == 0.25


def test_a_backend_that_is_not_installed_is_named_with_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)   # `import wandb` raises ImportError, installed or not
    with pytest.raises(PostrainError, match=r"backend 'wandb' is not installed.*pip install 'postrain\[wandb\]'"):
        RunTracking(tmp_path, TrackingSection(backends=["wandb"]), "x", CONFIG).start()


def test_the_tracking_section_is_checked():
    config = parse_up_config({"tracking": {"backends": ["mlflow"], "project": "p"}})
    assert config.tracking.backends == ["mlflow"] and parse_up_config({}).tracking.backends == []
    with pytest.raises(ConfigError, match=r"tracking.backends.0 = 'neptune'"):
        parse_up_config({"tracking": {"backends": ["neptune"]}})
    with pytest.raises(ConfigError, match=r"tracking.backend .*unknown field"):
        parse_up_config({"tracking": {"backend": "mlflow"}})


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="wandb is not installed (extra: wandb)")
def test_wandb_offline_writes_a_local_run(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    write_rows(tmp_path)
    with RunTracking(tmp_path, TrackingSection(backends=["wandb"]), "tracked", CONFIG).start() as tracking:
        assert tracking.poll() == 4
    assert list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))


@pytest.mark.skipif(importlib.util.find_spec("trackio") is None, reason="trackio is not installed (extra: trackio)")
def test_trackio_logs_locally(tmp_path, monkeypatch):
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))
    write_rows(tmp_path)
    with RunTracking(tmp_path, TrackingSection(backends=["trackio"], project="postrain-test"), "tracked",
                     CONFIG).start() as tracking:
        assert tracking.poll() == 4
    import sqlite3   # trackio's local store
    logged = [row[0] for row in sqlite3.connect(tmp_path / "trackio" / "postrain-test.db").execute(
        "select metrics from metrics")]
    assert [json.loads(m)["train/loss"] for m in logged if b"train/loss" in m] == [0.5, 0.25]


def write_samples(folder, steps):
    rows = [{"sample_id": f"b{step - 1}-g0-s{i}", "step": step, "group": 0, "outcome": "trained", "reward": float(i),
             "advantage": 0.5, "prompt": "What is 2 + 3?", "turns": [{"completion": "x" * 3000 + "|end",
                                                                      "tool_output": "5"}]}
            for step in steps for i in range(2)]
    with (folder / "samples.jsonl").open("a") as file:
        file.write("".join(json.dumps(row) + "\n" for row in rows))


def test_every_nth_step_and_the_last_a_samples_table_reaches_mlflow_and_tensorboard(tmp_path):
    pytest.importorskip("tensorboard")
    write_rows(tmp_path)
    section = TrackingSection(backends=["mlflow"], samples_every_steps=2)
    with RunTracking(tmp_path, section, "tracked", CONFIG).start() as tracking:
        write_samples(tmp_path, [1, 2])
        assert tracking.poll_samples() == 0      # step 2 may still be coming
        write_samples(tmp_path, [3])
        assert tracking.poll_samples() == 1      # step 2 (due); step 1 is not
    assert tracking.num_sample_tables == 2       # and step 3, the last, at the end
    client, run = mlflow_run(tmp_path)
    names = sorted(a.path for a in client.list_artifacts(run.info.run_id, "samples"))
    assert names == ["samples/step_000002.json", "samples/step_000003.json"]
    table = json.loads((tmp_path / "mlruns").joinpath(
        *client.get_run(run.info.run_id).info.artifact_uri.split("/mlruns/")[1].split("/"),
        "samples", "step_000002.json").read_text())
    assert table["columns"][:5] == ["sample_id", "group", "outcome", "reward", "advantage"]
    assert table["data"][0][0] == "b1-g0-s0" and "more]" in table["data"][0][6]   # the text is cut
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    accumulator = EventAccumulator(str(tmp_path / "tensorboard"))
    accumulator.Reload()
    texts = accumulator.Tensors("samples")   # TensorBoard's text plugin reads these
    assert sorted(t.step for t in texts) == [2, 3]
    assert b"| sample_id | group |" in texts[0].tensor_proto.string_val[0]
