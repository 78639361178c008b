"""The charts task (actors/tasks/charts/): seeded charts drawn to deterministic PNGs, questions in
three levels answerable from the labelled values (the reference solver scores 1.0), a last-number
grader with an absolute tolerance, a held-out split disjoint by construction, options checked by
name, and episodes in both forms through `run_episode` whose first message carries the image as an
OpenAI-style data-URL content part."""
from __future__ import annotations

import base64
import io
import itertools
import json
import sys
from pathlib import Path

import pytest
import trio
from matplotlib.text import Text
from PIL import Image

from postrain.actors import LocalSandbox, TaskOptionsError, get_task, run_episode
from postrain.actors.env import EnvironmentContractError, EnvironmentFailure, validate_observation
from postrain.actors.env.api import require_text_messages
from postrain.actors.env.tools import parse_action
from postrain.actors.tasks.charts import (FORMS, HEIGHT_PX, LEVELS, WIDTH_PX, Chart, charts_options, draw, grade,
                                          data_url, eval_tasks, graded_text, in_eval_split, read_number, render_png,
                                          solve)
from postrain.sandbox import Policy, Sandbox

SPEC = get_task("charts")


def chart_of(task: dict) -> Chart:
    return Chart.from_dict(task["chart"])


def scripted(*actions):
    replies = iter(actions)

    async def policy(messages):
        return next(replies)
    return policy


def image_part(messages: list[dict]) -> dict:
    user = next(m for m in messages if m["role"] == "user")
    return next(p for p in user["content"] if p["type"] == "image_url")


@pytest.mark.parametrize("level", LEVELS)
def test_the_solver_scores_one_on_300_questions_of_each_level_and_a_wrong_answer_zero(level):
    tasks = list(itertools.islice(SPEC.train_tasks(5, {"levels": [level]}), 250))
    tasks += SPEC.eval_tasks({"levels": [level], "num_eval": 50})
    assert {t["level"] for t in tasks} == {level}
    for task in tasks:
        reply = solve(chart_of(task), task["query"])
        assert grade(graded_text(reply), task["answer"]).correct, (task["question"], reply)
        tool_reply = parse_action(solve(chart_of(task), task["query"], form="tool"))
        assert tool_reply.kind == "answer" and grade(tool_reply.content, task["answer"]).correct
        assert not grade(f"{reply}\nSorry, it is {task['answer'] + 1:.1f}", task["answer"]).correct


def test_a_task_and_its_png_are_the_same_for_the_same_seed():
    first = list(itertools.islice(SPEC.train_tasks(11), 5))
    again = list(itertools.islice(SPEC.train_tasks(11), 5))
    assert first == again
    assert first != list(itertools.islice(SPEC.train_tasks(12), 5))
    pngs = [render_png(chart_of(t)) for t in first[:3]]
    assert pngs == [render_png(chart_of(t)) for t in first[:3]]
    assert len(set(pngs)) == 3


def test_the_png_decodes_at_the_stated_size_and_labels_every_value():
    for task in itertools.islice(SPEC.train_tasks(2, {"kinds": ["bar"]}), 3):
        png = render_png(chart_of(task))
        image = Image.open(io.BytesIO(png))
        image.load()
        assert image.format == "PNG" and image.size == (WIDTH_PX, HEIGHT_PX) == (448, 336)
        assert len(png) < 64_000
    for kinds in (["bar"], ["line"]):
        for task in itertools.islice(SPEC.train_tasks(3, {"kinds": kinds}), 10):
            chart = chart_of(task)
            assert chart.kind == kinds[0]
            texts = {t.get_text() for t in draw(chart).findobj(Text)}
            assert {f"{v:,}" for s in chart.series for v in s.values} <= texts
            assert {c.replace(" ", "\n") for c in chart.categories} <= texts


def test_train_and_eval_never_share_a_chart():
    train = list(itertools.islice(SPEC.train_tasks(0), 2000))
    held_out = SPEC.eval_tasks({"num_eval": 100})
    assert len(held_out) == 100 and {t["level"] for t in held_out} == set(LEVELS)
    assert not any(in_eval_split(t["chart_seed"]) for t in train)
    assert all(in_eval_split(t["chart_seed"]) for t in held_out)
    assert not {t["chart_seed"] for t in train} & {t["chart_seed"] for t in held_out}
    assert SPEC.eval_tasks({"num_eval": 100}) == held_out


@pytest.mark.parametrize(("text", "value"), [
    ("Answer: 1234", 1234.0), ("Answer: $1,234.5", 1234.5), ("a fall of -12.5%", -12.5), ("-$40", -40.0),
    ("$-40", -40.0), ("\u221240", -40.0), ("\u20ac2,000,000", 2_000_000.0), ("12.5.", 12.5),
    ("it grew by 119 from Q1 to Q4", 119.0), ("FY2024 revenue was 31 million", 31.0),
    ("from 10 to 12", 12.0), ("Q1 to Q4", None), ("no idea", None), ("", None),
])
def test_the_last_number_is_read(text, value):
    assert read_number(text) == value


def test_the_answer_tag_wins_in_the_image_form_and_a_reply_without_a_number_scores_zero():
    assert graded_text("I read 12 and 15. <answer>27</answer> (12 + 15)") == "27"
    assert grade(graded_text("I read 12 and 15. <answer>27</answer> (12 + 15)"), 27.0).correct
    assert grade("12 + 15 = 27", 27.0).correct
    verdict = grade("I cannot read the chart.", 27.0)
    assert not verdict.correct and verdict.value is None and "no number" in verdict.reason


@pytest.mark.parametrize(("answer", "correct"), [
    ("18.1", True), ("18", True), ("18.64", True), ("18.65", False), ("17.64", True), ("17.63", False),
])
def test_the_tolerance_is_absolute_half_a_unit_of_the_asked_unit(answer, correct):
    assert grade(answer, 18.14).correct is correct
    assert grade(answer, 18.14, tolerance=0.0).correct is False


def test_the_tolerance_edges_are_inclusive_and_configurable():
    assert grade("100.5", 100.0).correct and grade("99.5", 100.0).correct
    assert not grade("100.51", 100.0).correct and not grade("99.49", 100.0).correct
    assert grade("101", 100.0, tolerance=1.0).correct and not grade("100.5", 100.0, tolerance=0.0).correct
    assert grade("100", 100.0, tolerance=0.0).correct


@pytest.mark.parametrize(("options", "named"), [
    ({"levle": [1]}, "levle"), ({"levels": [4]}, "levels"), ({"kinds": ["pie"]}, "kinds"),
    ({"form": "files"}, "form"), ({"tolerance": -1}, "tolerance"), ({"num_eval": -1}, "num_eval"),
])
def test_bad_options_are_refused_naming_the_option(options, named):
    for use in (lambda: SPEC.train_tasks(0, options), lambda: SPEC.eval_tasks(options),
                lambda: SPEC.make_env(options=options)):
        with pytest.raises(TaskOptionsError, match=named):
            use()


def test_the_image_form_shows_the_chart_as_a_data_url_and_grades_one_reply():
    task = SPEC.eval_tasks({"num_eval": 1})[0]
    right, seen = solve(chart_of(task), task["query"]), []

    async def policy(messages):
        seen.append(messages)
        return right

    env = SPEC.make_env()
    assert not SPEC.needs_sandbox({}) and env.max_turns == 1
    episode = trio.run(run_episode, env, task, policy)
    assert episode.reward.components == {"correct": 1.0} and episode.num_turns == 1
    (first,) = seen[0]
    assert first["role"] == "user" and [p["type"] for p in first["content"]] == ["image_url", "text"]
    url = first["content"][0]["image_url"]["url"]
    assert url.startswith("data:image/png;base64,")
    assert base64.b64decode(url.removeprefix("data:image/png;base64,")) == render_png(chart_of(task))
    assert task["question"] in first["content"][1]["text"]
    assert validate_observation(seen[0]) == seen[0]
    wrong = trio.run(run_episode, SPEC.make_env(), task, scripted(f"Answer: {task['answer'] + 3:.1f}"))
    assert wrong.reward.components == {"correct": 0.0} and "off by" in wrong.infos[0]["problem"]


def test_the_tool_form_runs_python_in_the_sandbox_then_grades_the_answer_tag():
    task = next(t for t in SPEC.eval_tasks({"num_eval": 20, "levels": [3]}) if t["query"]["op"] == "average")
    chart = chart_of(task)
    values = [chart.value(s, c) for s, c in task["query"]["reads"]]
    code = f"<python>\nprint(round(sum({values}) / {len(values)}, 1))\n</python>"
    options = {"form": "tool"}
    assert SPEC.needs_sandbox(options)
    with Sandbox(Policy(wall_time_s=10.0, cpu_time_s=10, memory_mb=256), mode="warm", num_workers=1) as box:
        seen: list[list[dict]] = []

        async def policy(messages):
            seen.append(list(messages))
            if len(seen) == 1:
                return code
            printed = messages[-1]["content"].split("\n")[1]
            return f"<answer>{printed}</answer>"

        env = SPEC.make_env(sandbox=LocalSandbox(box), options=options)
        episode = trio.run(run_episode, env, task, policy)
    assert episode.reward.components == {"correct": 1.0, "format": 1.0} and episode.num_turns == 2
    assert seen[0][0]["role"] == "system" and image_part(seen[0])["image_url"]["url"].startswith("data:image/png;")
    assert seen[1][-1]["content"].startswith("<output>")
    no_tag = trio.run(run_episode, SPEC.make_env(options=options), task, scripted(f"{task['answer']:.1f}"))
    assert no_tag.reward.components["correct"] == 0.0


def test_content_parts_are_checked_and_a_text_only_policy_refuses_an_image():
    good = [{"role": "user", "content": [{"type": "text", "text": "hi"},
                                         {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}]
    assert validate_observation(good) == good
    for parts in ([], [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}],
                  [{"type": "text", "text": 3}], [{"type": "audio"}], ["text"]):
        with pytest.raises(EnvironmentContractError, match="content"):
            validate_observation([{"role": "user", "content": parts}])
    require_text_messages([{"role": "user", "content": "hi"}], "a text policy")
    with pytest.raises(EnvironmentFailure, match="renders text only"):
        require_text_messages(good, "a text policy")


def test_an_image_by_file_path_is_read_where_the_environment_runs(tmp_path):
    """An environment may name an image it wrote by an absolute file:// path: the episode reads it
    there and sends its bytes as a data URL (nothing past the environment reads a path); a
    demonstration may too. A missing file, a relative path or another scheme is named."""
    from postrain.actors.env.api import inline_image_files
    from postrain.actors.tasks.demonstrations import DemonstrationError, validate_demonstration
    png = render_png(Chart.from_dict(eval_tasks({"num_eval": 1})[0]["chart"]))
    chart = tmp_path / "a chart.png"
    chart.write_bytes(png)
    url = chart.as_uri()                                              # file:///.../a%20chart.png
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "What is Q3's revenue?"}]}]
    validate_observation(messages)
    inlined = inline_image_files(messages, where="reset")
    assert inlined[0]["content"][0]["image_url"]["url"] == data_url(png)
    assert inlined[0]["content"][1] == messages[0]["content"][1] and messages[0]["content"][0]["image_url"]["url"] == url
    demo = validate_demonstration({"messages": [*messages, {"role": "assistant", "content": "12.5"}]})
    assert demo["messages"][0]["content"][0]["image_url"]["url"] == data_url(png)
    missing = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url + ".gone"}}]}]
    with pytest.raises(EnvironmentContractError, match=r"reset: message 0: image file .*a chart.png.gone cannot be read"):
        inline_image_files(missing, where="reset")
    with pytest.raises(DemonstrationError, match="cannot be read"):
        validate_demonstration({"messages": [*missing, {"role": "assistant", "content": "1"}]})
    for bad in ("file://relative.png", "/abs/without/scheme.png"):
        with pytest.raises(EnvironmentContractError, match="absolute file:// path"):
            validate_observation([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": bad}}]}])


@pytest.mark.variants      # ~15-25 s; the image path's parts are tested one by one in tests/actors/test_vision.py
def test_a_run_on_the_image_form_trains_the_tiny_vision_language_policy(tmp_path):
    """`postrain up` with every role a real process: a warm start on the solver's demonstrations
    (images in the SFT batches), then RL: the environment renders each chart into the prompt's
    image run, the generator encodes the charts, the learner trains on them (it refuses a batch
    whose prompt placeholders came without their images), and the policy saved is a
    vision-language model again."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))    # tests/actors
    from task_runs import run_task
    from postrain.actors.models.loading import load_model

    shared = {"model": "tiny-vl", "task": "charts", "task_options": {"form": "image"}}
    summary, folder = run_task(tmp_path, "charts", {}, extra={"shared": shared},
                               orchestrator={"sft_steps": 2, "sft_batch_size": 2})
    assert summary["complete"] and summary["sft_steps"] == 2, "the warm start trained on the charts' images"
    assert summary["ledger"]["trained"] == 6 and summary["ledger"]["dropped"] == 0
    sample = json.loads((folder / "samples.jsonl").read_text().splitlines()[0])
    assert sample["prompt"].count("<|image|>") == 48
    model, _ = load_model(folder / "policy")
    assert model.vision is not None and model.vision.layout.num_image_tokens == 48


def test_the_demonstrations_show_the_chart_and_the_solvers_reply_grades_correct():
    from postrain.actors.tasks.demonstrations import validate_demonstration

    for form in FORMS:
        demos = get_task("charts").demonstrations(6, seed=3, options={"form": form})
        tasks = list(itertools.islice(get_task("charts").train_tasks(seed=3, options={"form": form}), 6))
        for demo, task in zip(demos, tasks):
            validate_demonstration(demo)
            *prompt, reply = demo["messages"]
            assert prompt[-1]["content"][0]["type"] == "image_url" and task["question"] in prompt[-1]["content"][1]["text"]
            assert grade(graded_text(reply["content"]), task["answer"], tolerance=charts_options({}).tolerance).correct
