"""`postrain report RUN_DIR`: one self-contained HTML page, from a synthetic run folder, checked as
text and as a user sees it in a real headless browser (Debian's chromium, where installed)."""
import argparse
import json
import re
import shutil
import subprocess

import pytest

from postrain.cli import report as report_command
from postrain.cli.report import gather, spread, write_report
from postrain.cli.report_page import eval_causes

HOSTILE = "</script><script>window.pwned = 1</script><img src=x onerror=alert(1)>"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install chromium)")


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def sample(sample_id, step, reward, completion="<answer>5</answer>", tool_output=""):
    return {"sample_id": sample_id, "step": step, "batch": step - 1, "group": 0, "task": "arithmetic",
            "outcome": "trained", "reward": reward, "components": {"correct": reward}, "advantage": 0.5,
            "staleness": 0, "policy_tokens": 12, "num_turns": 1, "prompt": f"What is {step} + 3?",
            "turns": [{"completion": completion, "tool_output": tool_output}]}


def synthetic_run(folder):
    """A finished run's files as `postrain up` writes them: 3 warm-start steps, 2 RL steps (KL
    unused), three evaluations (the last with the causes its environment named), one warning, five
    samples (one with hostile text)."""
    rows = [{"time": 100.0, "kind": "eval", "phase": "before", "accuracy": 0.125, "eval_s": 1.5}]
    rows += [{"time": 100.0 + i, "kind": "sft", "step": i + 1, "loss": 3.0 / (i + 1)} for i in range(3)]
    rows += [{"time": 104.0, "kind": "eval", "phase": "after_sft", "accuracy": 0.625, "eval_s": 1.25}]
    rows += [{"time": 104.0 + step, "kind": "train", "step": step, "reward_mean": 0.25 * step, "kl": 0.0,
              "correct_mean": 0.2 * step, "tokens_per_s": 4321.0 + step, "staleness_max": 0} for step in (1, 2)]
    rows += [{"time": 106.5, "kind": "warning", "code": "no_learning_signal", "step": 2,
              "causes": ["every reward is 0: the model never reaches a rewarded answer"]},
             {"time": 107.0, "kind": "eval", "phase": "after", "accuracy": 0.875, "step": 2, "eval_s": 1.0,
              "causes": {"wrong_unit": 1, "ok": 7}}]
    write_jsonl(folder / "metrics.jsonl", rows)
    write_jsonl(folder / "samples.jsonl", [
        sample("b0-g0-s0", 1, 0.0), sample("b0-g0-s1", 1, 1.0, "<python>print(4)</python>", "<output>\n4\n</output>"),
        sample("b1-g0-s0", 2, 0.5), sample("b1-g0-s1", 2, 0.0, HOSTILE), sample("b1-g0-s2", 2, 1.0)])
    (folder / "summary.json").write_text(json.dumps({
        "eval_before": 0.125, "eval_after_sft": 0.625, "eval_after": 0.875, "steps": 2, "sft_steps": 3,
        "samples": 5, "task": "arithmetic", "wall_s": 61.5, "warm_start_s": 12.25,
        "ledger": {"created": 6, "trained": 5, "dropped": 1, "drop_reasons": {"environment timed out": 1}}}))
    (folder / "config.toml").write_text('[run]\nname = "synthetic"\n\n[shared]\ntask = "arithmetic"\n')
    return folder


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    folder = synthetic_run(tmp_path_factory.mktemp("run"))
    return write_report(folder)


def test_the_page_holds_summary_evaluations_warnings_timings_config_and_charts(page):
    text = page.read_text()
    assert page.name == "report.html"
    for seen in ("0.125", "0.625", "0.875", "61.5 s", "12.2 s", "no_learning_signal", "every reward is 0",
                 "1 sample dropped: environment timed out", 'name = &quot;synthetic&quot;', "after sft",
                 "<td>ok 7, wrong_unit 1</td>"):
        assert seen in text, f"the page lacks {seen!r}"
    charts = re.findall(r'data-chart="([^"]+)"', text)
    assert charts == ["reward", "accuracy", "warm start", "throughput", "staleness"]
    assert "kl: KL is 0 at every step: the run does not use KL" in text   # drawn only where KL is used


def test_a_mixtures_evaluation_shows_each_tasks_causes_by_name():
    row = {"kind": "eval", "causes_finance": {"wrong_unit": 1, "ok": 1}, "causes_cad": {"no_export": 3}}
    assert eval_causes(row) == "cad: no_export 3; finance: ok 1, wrong_unit 1"
    assert eval_causes({"kind": "eval", "accuracy": 0.5}) == ""


def test_the_page_needs_no_network_and_keeps_model_text_out_of_the_markup(page):
    text = page.read_text()
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", text), "the page loads something from a URL"
    assert "@import" not in text and "url(http" not in text
    assert HOSTILE not in text and "</script><script>window.pwned" not in text
    data = re.search(r'<script type="application/json" id="samples-data">(.*?)</script>', text, re.DOTALL)
    assert [s["sample_id"] for s in json.loads(data.group(1))][3] == "b1-g0-s1"


def test_a_run_without_summary_or_samples_says_so(tmp_path):
    synthetic_run(tmp_path)
    (tmp_path / "summary.json").unlink()
    (tmp_path / "samples.jsonl").unlink()
    text = write_report(tmp_path, tmp_path / "r.html").read_text()
    assert "No summary.json: the run has not finished" in text
    assert "No samples.jsonl: the run trained no RL step" in text and "samples-data" not in text
    assert "0.875" in text, "its evaluations are still shown"


def test_spread_keeps_the_first_and_last_and_the_limit(tmp_path):
    assert spread(list(range(10)), 4) == [0, 3, 6, 9] and spread([1, 2], 5) == [1, 2]
    assert spread(list(range(10)), 0) == list(range(10)) and spread(list(range(10)), 1) == [9]
    write_jsonl(tmp_path / "samples.jsonl", [sample(f"b{i}-g0-s0", i + 1, 0.0) for i in range(7)])
    (tmp_path / "config.toml").write_text("")
    data = gather(tmp_path, max_samples=3)
    assert [s["step"] for s in data["samples"]] == [1, 4, 7] and data["num_samples"] == 7


def test_a_folder_without_a_run_or_a_bad_flag_is_one_line(tmp_path):
    def run(**kw):
        return report_command.main(argparse.Namespace(**{"run_folder": str(tmp_path), "output": None,
                                                         "max_samples": 10, **kw}))
    with pytest.raises(SystemExit, match=r"^postrain report: .* holds no run \(no config.toml, metrics.jsonl"):
        run()
    with pytest.raises(SystemExit, match=r"^postrain report: .*missing is not a folder; pass a run folder"):
        run(run_folder=str(tmp_path / "missing"))
    with pytest.raises(SystemExit, match=r"^postrain report: --max-samples must be >= 0 \(0: all\), got -1$"):
        run(max_samples=-1)
    synthetic_run(tmp_path)
    with pytest.raises(SystemExit, match=r"^postrain report: cannot write .*nope.*; fix: pass -o"):
        run(output=str(tmp_path / "nope" / "r.html"))


# ------------------------------------------------------------------ in a real browser
def browser_dom(page, fragment=""):
    """The page's DOM after its scripts ran in headless chromium, and the console lines it logged."""
    result = subprocess.run([CHROMIUM, "--headless", "--disable-gpu", "--no-sandbox", "--enable-logging=stderr",
                             "--v=0", "--dump-dom", f"file://{page}{fragment}"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout, [line for line in result.stderr.splitlines() if ":CONSOLE" in line]


@needs_chromium
def test_in_a_browser_the_page_loads_without_errors_and_shows_charts_and_samples(page):
    dom, console = browser_dom(page)
    assert console == [], f"the page logged to the console: {console}"
    assert dom.count("<svg") == 5 and "0.875" in dom
    assert re.search(r'id="sample-count"[^>]*>5 of 5 samples match<', dom)
    # newest step first, in run order within it
    assert re.findall(r'data-sample-id="([^"]+)"', dom) == ["b1-g0-s0", "b1-g0-s1", "b1-g0-s2", "b0-g0-s0", "b0-g0-s1"]
    assert "&lt;/script&gt;&lt;script&gt;window.pwned = 1" in dom, "the model's text is shown as text"
    assert "window.pwned = 1</script>" not in dom and "<img src=\"x\"" not in dom
    assert "<pre>&lt;output&gt;\n4\n&lt;/output&gt;</pre>" in dom, "a tool output is shown under its completion"


@needs_chromium
def test_in_a_browser_the_filters_select_by_step_reward_and_order(page):
    dom, console = browser_dom(page, "#step=2&order=worst")
    assert console == []
    assert re.findall(r'data-sample-id="([^"]+)"', dom) == ["b1-g0-s1", "b1-g0-s0", "b1-g0-s2"]
    dom, _ = browser_dom(page, "#min=1&text=print")
    assert re.findall(r'data-sample-id="([^"]+)"', dom) == ["b0-g0-s1"]
    assert re.search(r'id="sample-count"[^>]*>1 of 5 samples match<', dom)


def test_identical_samples_are_one_card_and_chat_markup_reads_as_turns():
    from postrain.cli.report import collapsed, for_reading
    same = [sample(f"b0-g0-s{i}", 1, 1.0) for i in range(8)] + [sample("b0-g1-s0", 1, 0.0)]
    same[-1]["group"] = 1
    cards = collapsed(same)
    assert [card["copies"] for card in cards] == [8, 1]
    shown = for_reading({"prompt": "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
                         "turns": [{"completion": "4<|im_end|>", "tool_output": None}]})
    assert shown["prompt"] == "user: What is 2+2?\nassistant: " and shown["turns"][0]["completion"] == "4"
