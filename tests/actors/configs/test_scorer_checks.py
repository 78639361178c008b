"""The scorer checks at config load (actors/configs/scorer_checks.py and ScorerOptions), as
`postrain up` and `--dry-run` meet them: each refusal names the option, the value and the fix.
In process through `parse_up_config` (names, config.json and safetensors headers only: no
weight is loaded), and once through the real `postrain up --dry-run` on the shipped distill
config. The model folders are the tiny model saved by the code's own `save_checkpoint`
(tests/actors/model_folders.py)."""
from pathlib import Path

import pytest
from model_folders import other_tokenizer_folder, reward_folder, tiny_policy_folder   # tests/actors/

from postrain import cli
from postrain.actors.configs.run_config import parse_up_config
from postrain.core.errors import ConfigError

CONFIGS = Path(__file__).resolve().parents[3] / "actors" / "configs"
ACTOR = {"cpus": 0.25, "memory_mb": 0}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """teacher: a tiny policy of another seed (the policy's byte tokenizer); other: two tokens'
    ids swapped; classifier: a *ForSequenceClassification folder with no score head; rm: with one."""
    root = tmp_path_factory.mktemp("models")
    teacher = tiny_policy_folder(root / "teacher")
    return {"teacher": teacher, "other": other_tokenizer_folder(teacher, root / "other"),
            "classifier": reward_folder(teacher, root / "classifier", head=False),
            "rm": reward_folder(teacher, root / "rm")}


def scorer(name: str, model, **options) -> dict:
    return {"name": name, "cls": "postrain.actors.scorer:ScorerActor", **ACTOR,
            "options": {"model": str(model), **options}}


def run(*scorers: dict, teacher: str | None = None, learner: dict | None = None, env: dict | None = None,
        orchestrator: dict | None = None) -> dict:
    """A run config of the tiny policy with `scorers` beside it."""
    driver = {"num_steps": 1, **({"teacher": teacher} if teacher else {}), **(orchestrator or {})}
    return {"run": {"name": "t", "driver": "orchestrator"},
            "shared": {"model": "tiny", "task": "arithmetic"},
            "actors": [
                {"name": "generator", "cls": "postrain.actors.generator:GeneratorActor", **ACTOR},
                {"name": "learner", "cls": "postrain.actors.learner:LearnerActor", **ACTOR,
                 "options": {"learner": learner or {}}},
                {"name": "env", "cls": "postrain.actors.env:EnvironmentActor", **ACTOR, "options": env or {}},
                {"name": "orchestrator", "cls": "postrain.actors.orchestrator:OrchestratorActor", **ACTOR,
                 "options": driver},
                *scorers]}


def refusal(config: dict) -> str:
    with pytest.raises(ConfigError) as caught:
        parse_up_config(config)
    return str(caught.value)


OPD = {"loss": "opd"}


def test_a_distilling_run_with_a_teacher_of_the_policys_tokenizer_loads(folders):
    config = parse_up_config(run(scorer("teacher", folders["teacher"]), teacher="teacher", learner=OPD))
    assert [spec.name for spec in config.actors][-1] == "teacher"
    parse_up_config(run(scorer("teacher", "tiny", seed=1), teacher="teacher", learner={"distill_coef": 0.1}))
    parse_up_config(run(learner={**OPD, "teacher_model": str(folders["teacher"])}))   # in the learner
    parse_up_config(run(scorer("judge", "tiny", serves="generate"), scorer("rm", folders["rm"], serves="reward"),
                        env={"scorers": ["judge", "rm"]}))


def test_an_unknown_scorer_or_an_actor_that_is_no_scorer_is_named_with_the_fix(folders):
    said = refusal(run(scorer("teacher", "tiny"), teacher="techer", learner=OPD))
    assert said.startswith("1 scorer problem(s):")   # not also "no teacher": the name is the one problem
    assert ("orchestrator.teacher = 'techer': no actor of the run is named 'techer'; fix: correct the name "
            "(this run's scorers: ['teacher']), or add an [[actors]] entry named 'techer' with cls = "
            "\"postrain.actors.scorer:ScorerActor\"") in said
    said = refusal(run(teacher="generator", learner=OPD))
    assert ("orchestrator.teacher = 'generator': actor 'generator' is a GeneratorActor, not a scorer; fix: name "
            "a scorer actor (this run's: none), or add one") in said
    said = refusal(run(scorer("judge", "tiny", serves="generate"), env={"scorers": ["judge", "rm"]}))
    assert said.startswith("1 scorer problem(s):") and "env.scorers = 'rm': no actor of the run is named 'rm'" in said


def test_a_teacher_that_does_not_serve_logprobs_is_refused(folders):
    said = refusal(run(scorer("teacher", "tiny", serves="generate"), teacher="teacher", learner=OPD))
    assert ("orchestrator.teacher = 'teacher': that scorer serves 'generate'; a teacher serves \"logprobs\"; "
            "fix: set teacher.serves = \"logprobs\"") in said
    said = refusal(run(scorer("teacher", "tiny"), teacher="teacher", learner=OPD,
                       orchestrator={"teacher_top_k": 300}))
    assert ("orchestrator.teacher_top_k = 300: more than the teacher's vocabulary (264); fix: set teacher_top_k "
            "to at most 264") in said


def test_a_teacher_of_another_tokenizer_is_refused_naming_the_first_token_that_differs(folders):
    said = refusal(run(scorer("teacher", folders["other"]), teacher="teacher", learner=OPD))
    assert (f"orchestrator.teacher = 'teacher': its tokenizer is not the policy's (policy 'tiny', teacher "
            f"'{folders['other']}': token 'a' is id ") in said
    assert "must share one vocabulary; fix: a teacher of the policy's tokenizer" in said
    said = refusal(run(learner={**OPD, "teacher_model": str(folders["other"])}))   # the learner's own teacher
    assert f"learner.learner.teacher_model = '{folders['other']}': its tokenizer is not the policy's" in said


def test_a_reward_model_folder_without_a_score_head_is_refused(folders):
    said = refusal(run(scorer("rm", folders["classifier"], serves="reward"), env={"scorers": ["rm"]}))
    assert f"reward model folder '{folders['classifier']}' has no `score.weight` tensor in its safetensors" in said
    said = refusal(run(scorer("rm", folders["teacher"], serves="reward"), env={"scorers": ["rm"]}))
    assert "name no *ForSequenceClassification (a causal LM is no reward model)" in said
    said = refusal(run(scorer("teacher", folders["rm"]), teacher="teacher", learner=OPD))
    assert "is a reward model (*ForSequenceClassification: a score head, no LM head), which serves" in said


def test_a_learner_that_distils_without_a_teacher_and_a_teacher_no_learner_uses_are_refused(folders):
    for learner in (OPD, {"distill_coef": 0.5}):
        said = refusal(run(learner=learner))
        assert ("learner.learner distils (loss \"opd\" or distill_coef > 0) but has no teacher; fix: name a "
                "scorer that serves \"logprobs\" as the orchestrator's teacher, or set the learner's "
                "teacher_model") in said
    said = refusal(run(scorer("teacher", "tiny"), teacher="teacher"))
    assert ("orchestrator.teacher = 'teacher', but no learner distils: its rows would be thrown away; fix: set "
            "the learner's loss = \"opd\" or distill_coef > 0, or remove the teacher") in said
    said = refusal(run(scorer("teacher", "tiny"), teacher="teacher",
                       learner={**OPD, "teacher_model": str(folders["teacher"])}))
    assert "and the orchestrator's teacher both score the samples; the learner takes one or the other" in said


def test_postrain_up_dry_run_checks_the_distill_config_with_a_teacher_folder(folders, tmp_path, capsys):
    """The shipped config: placed with the teacher named on the command line; refused, by the
    real command, with a teacher of another tokenizer (exit 2, the line on stderr)."""
    config = str(CONFIGS / "distill.toml")
    assert cli.main(["up", "--config", config, "--dry-run", "--set", f"teacher.model={folders['teacher']}",
                     "--set", f"run.run_dir={tmp_path}"]) == 0
    out = capsys.readouterr().out
    assert "teacher: cores [" in out and "teacher: kv_cache_mb " in out     # placed, and its cache sized
    assert not any(tmp_path.iterdir()), "a dry run starts nothing and writes no run folder"
    assert cli.main(["up", "--config", config, "--dry-run", "--set", f"teacher.model={folders['other']}"]) == 2
    assert "orchestrator.teacher = 'teacher': its tokenizer is not the policy's" in capsys.readouterr().err
