"""The documentation: the site builds strictly, the README stays a front page, and the
generated config reference follows the code.

`mkdocs build --strict` fails on any warning: a broken link or anchor between pages, a page
missing from the nav, or a reference hook (docs/hooks/config_reference.py) that cannot import
a config model or a role. It runs as a subprocess, as CI and a user would run it.
"""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_README_LINES = 250

needs_mkdocs = pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None,
    reason="mkdocs and mkdocs-material are not installed; pip install -e '.[docs]'")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site, built once with `mkdocs build --strict` into a temporary folder."""
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    return out


def test_readme_is_a_front_page():
    num_lines = len(README.read_text().splitlines())
    assert num_lines < MAX_README_LINES, (
        f"README.md has {num_lines} lines; keep it under {MAX_README_LINES} (a front page) and move "
        "the rest into a page of docs/")


def test_readme_links_point_at_existing_pages():
    links = re.findall(r"\]\((docs/[^)#\s]+)(?:#[^)\s]*)?\)", README.read_text())
    assert links, "the README links to no page of docs/"
    missing = sorted({link for link in links if not (ROOT / link).is_file()})
    assert not missing, f"README links to missing docs pages: {missing}"


def test_readme_test_command_is_what_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text()
    command = re.search(r"^pip install .*python -m pytest -q\s*$", ci, re.MULTILINE)
    assert command, ".ci/run has no install-and-test line"
    assert command.group(0).replace("pip install -q ", "pip install ").strip() in README.read_text(), (
        "the README's test command and .ci/run's must be the same command")


@needs_mkdocs
def test_site_builds_strict(site):
    for page in ("index.html", "kernel/index.html", "performance/index.html", "config-reference/index.html"):
        assert (site / page).is_file(), f"{page} is missing from the built site"


@needs_mkdocs
def test_readme_anchors_exist_in_the_site(site):
    for page, anchor in re.findall(r"\]\(docs/([^)#\s]+)\.md#([^)\s]+)\)", README.read_text()):
        html = (site / ("" if page == "index" else page) / "index.html").read_text()
        assert f'id="{anchor}"' in html, f"README links to docs/{page}.md#{anchor}, which has no such anchor"


@needs_mkdocs
def test_config_reference_lists_the_code_fields(site):
    page = (site / "config-reference" / "index.html").read_text()
    for field in ("heartbeat_interval_s", "metrics_port", "max_restarts", "interval_s", "kv_cache_mb",
                  "max_staleness", "max_queued", "max_total_tokens"):
        assert f"<code>{field}</code>" in page, f"the config reference does not list {field}"
    for role in ("GeneratorActor", "LearnerActor", "EnvironmentActor", "SandboxActor", "OrchestratorActor"):
        assert role in page, f"the config reference has no section for {role}"


@needs_mkdocs
def test_records_page_lists_every_record(site):
    from postrain.actors import records
    page = (site / "records" / "index.html").read_text()
    for name in ("Rollout", "TrainBatch", "WeightSync", "GenerateRequest"):
        assert hasattr(records, name) and f"<code>{name}</code>" in page, f"the records page lacks {name}"


def test_the_committed_reference_pages_match_the_code():
    """docs/config-reference.md and docs/records.md read whole in the repository; their generated
    tables must be what the code's models give now (every config error points at the first)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("config_reference", ROOT / "docs" / "hooks" / "config_reference.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    for page, marker, _ in hook.PAGES:
        text = (ROOT / page).read_text()
        assert hook.closing_marker(marker) in text, f"{page} holds no generated block"
        assert hook.refreshed(text) == text, \
            f"{page} differs from the code's options or records: run `python docs/hooks/config_reference.py`"
