"""`postrain report RUN_DIR`: one self-contained HTML page of a run, readable offline.

    postrain report runs/default                  # writes runs/default/report.html
    postrain report runs/default -o /tmp/r.html   # elsewhere

The page (cli/report_page.py renders it) holds, from the run folder's own files:

    summary        summary.json: accuracies before / after the warm start / after RL, steps,
                   samples, the ledger's counts and drop reasons (absent: "not finished")
    warnings       metrics `warning` rows (no learning signal, ...) and dropped samples
    evaluations    metrics `eval` rows: phase, greedy and sampled accuracy, seconds
    tasks          a mixture's tasks: each one's accuracies by phase, groups trained, mean reward
    timings        summary.json's wall, warm-start, evaluation and RL seconds
    charts         postrain plot's charts (cli/plot.py: reward, accuracy, warm-start loss, KL only
                   where the run uses it, throughput, staleness, queues) as inline SVG
    samples        samples.jsonl in a browser: filter by step, task, outcome, reward, text;
                   each sample's prompt, turns and tool outputs, reward components, advantage
    config         config.toml as the run started from it

Invariant: the file needs nothing beside it and nothing from the network: CSS, SVG, the
samples (JSON) and the browser's script are inline; every text a model wrote reaches the page
as data and is set with `textContent`, never parsed as HTML. tests/cli/test_report.py loads
it in headless chromium. At most --max-samples samples are embedded (default 4000; the rest
are counted, and the page says so).
"""
from __future__ import annotations

import io
import json
import re
from pathlib import Path

from postrain.core.errors import PostrainError

HELP = "write one self-contained HTML page of a run (summary, charts, evaluations, samples) to open offline"
DESCRIPTION = """Write one self-contained HTML page of a run, to open offline in any browser.

examples:
  postrain report runs/default                   writes runs/default/report.html
  postrain report runs/default -o report.html    writes it elsewhere

The page: the summary, warnings, evaluations, timings, the charts of `postrain plot` (inline
SVG), a sample browser (filter by step, task, outcome, reward, text) and the run's config.
More: docs/operations.md#a-run-report."""
DEFAULT_MAX_SAMPLES = 4000
REPORT_FILE = "report.html"


class ReportError(PostrainError, ValueError):
    """The folder is not a run folder with anything to report."""


def add_arguments(parser) -> None:
    parser.add_argument("run_folder", help="the run folder (run_dir/name) that `postrain up` wrote")
    parser.add_argument("-o", "--output", help=f"the HTML file to write (default: RUN_DIR/{REPORT_FILE})")
    parser.add_argument("--max-samples", type=int, default=DEFAULT_MAX_SAMPLES,
                        help=f"samples to embed in the page, spread over the run (default {DEFAULT_MAX_SAMPLES}; 0: all)")


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def chart_svgs(folder: Path) -> tuple[dict[str, str], dict[str, str]]:
    """({chart title: inline <svg>}, {chart: why it is not drawn}), from postrain plot's charts.
    Text stays text (svg.fonttype none), so the numbers on the axes are in the page."""
    from matplotlib import rc_context

    from .plot import CHARTS, PlotError, load_run
    try:
        run = load_run(folder)
    except PlotError as exc:
        return {}, {"charts": str(exc)}
    svgs, skipped = {}, {}
    with rc_context({"svg.fonttype": "none", "svg.hashsalt": "postrain"}):
        for name, chart in CHARTS.items():
            title = name.removesuffix(".png").replace("_", " ")
            figure = chart(run)
            if isinstance(figure, str):
                skipped[title] = figure
                continue
            figure.tight_layout()
            buffer = io.StringIO()
            figure.savefig(buffer, format="svg")
            svgs[title] = inline_svg(buffer.getvalue())
    return svgs, skipped


def inline_svg(text: str) -> str:
    """matplotlib's SVG file as an element of a page: no XML prolog, no RDF metadata block."""
    text = text[text.index("<svg"):]
    start, end = text.find("<metadata>"), text.find("</metadata>")
    return text[:start] + text[end + len("</metadata>"):] if 0 <= start < end else text


def spread(rows: list, limit: int) -> list:
    """At most `limit` of `rows` (0: all), evenly spread over them, first and last kept."""
    if limit <= 0 or len(rows) <= limit:
        return rows
    if limit == 1:
        return rows[-1:]
    step = (len(rows) - 1) / (limit - 1)
    return [rows[round(i * step)] for i in range(limit)]


# Chat markup the page writes as text a person reads: a turn's start becomes "role: ", its end and
# the end-of-text tokens go (samples.jsonl keeps the exact text).
_TURN_START = re.compile(r"<\|im_start\|>(\w+)\n|<\|start_header_id\|>(\w+)<\|end_header_id\|>\n\n|<start_of_turn>(\w+)\n")
_TURN_END = re.compile(r"<\|im_end\|>|<\|eot_id\|>|<end_of_turn>|<\|endoftext\|>|<\|begin_of_text\|>|<\|eos\|>|<\|bos\|>")


def readable(text: str | None) -> str | None:
    """`text` with its chat markup written for a person (`<|im_start|>user\nhi<|im_end|>` -> `user: hi`)."""
    if not text:
        return text
    text = _TURN_START.sub(lambda m: f"{next(g for g in m.groups() if g)}: ", text)
    return _TURN_END.sub("", text)


def collapsed(samples: list[dict]) -> list[dict]:
    """The samples with each run of identical ones (one step and group, the same prompt and turns)
    kept once, its `copies` the run's length: a group of 8 equal answers is one card, "x 8"."""
    out: list[dict] = []
    for sample in samples:
        key = (sample.get("step"), sample.get("group"), sample.get("prompt"), json.dumps(sample.get("turns")))
        if out and out[-1]["_key"] == key:
            out[-1]["copies"] += 1
            continue
        out.append({**sample, "_key": key, "copies": 1})
    for sample in out:
        del sample["_key"]
    return out


def for_reading(sample: dict) -> dict:
    turns = [{**turn, "completion": readable(turn.get("completion")), "tool_output": readable(turn.get("tool_output"))}
             for turn in sample.get("turns") or []]
    return {**sample, "prompt": readable(sample.get("prompt")), "turns": turns}


def gather(folder: Path, max_samples: int = DEFAULT_MAX_SAMPLES) -> dict:
    """Everything the page shows, read from the run folder. ReportError names a folder that
    is no run folder (no config.toml, metrics.jsonl or summary.json)."""
    from postrain.actors.orchestrator.sample_log import SAMPLES_FILE, read_samples
    from postrain.core.metrics import read_metrics

    if not folder.is_dir():
        raise ReportError(f"{folder} is not a folder; pass a run folder (run_dir/name) that `postrain up` wrote")
    if not any((folder / name).exists() for name in ("config.toml", "metrics.jsonl", "summary.json")):
        raise ReportError(f"{folder} holds no run (no config.toml, metrics.jsonl or summary.json); pass a run "
                          "folder (run_dir/name) that `postrain up` wrote")
    rows = read_metrics(folder) if (folder / "metrics.jsonl").exists() else []
    samples = read_samples(folder) if (folder / SAMPLES_FILE).exists() else []
    svgs, skipped = chart_svgs(folder)
    config_path = folder / "config.toml"
    return {
        "name": folder.resolve().name,
        "folder": str(folder),
        "summary": _read_json(folder / "summary.json"),
        "config": config_path.read_text() if config_path.exists() else None,
        "evals": [row for row in rows if row.get("kind") == "eval"],
        "warnings": [row for row in rows if row.get("kind") == "warning"],
        "train": [row for row in rows if row.get("kind") == "train"],
        "num_train_rows": sum(row.get("kind") == "train" for row in rows),
        "num_sft_rows": sum(row.get("kind") == "sft" for row in rows),
        "charts": svgs,
        "skipped_charts": skipped,
        "samples": [for_reading(sample) for sample in spread(collapsed(samples), max_samples)],
        "num_samples": len(samples),
    }


def write_report(folder: str | Path, output: str | Path | None = None,
                 max_samples: int = DEFAULT_MAX_SAMPLES) -> Path:
    """Render the run in `folder` into one HTML file; its path."""
    from .report_page import render
    folder = Path(folder)
    page = render(gather(folder, max_samples))
    path = Path(output) if output else folder / REPORT_FILE
    path.write_text(page, encoding="utf-8")
    return path


def main(args) -> int:
    if args.max_samples < 0:
        raise SystemExit(f"postrain report: --max-samples must be >= 0 (0: all), got {args.max_samples}")
    try:
        path = write_report(args.run_folder, args.output, args.max_samples)
    except ReportError as exc:
        raise SystemExit(f"postrain report: {exc}") from None
    except OSError as exc:
        raise SystemExit(f"postrain report: cannot write {exc.filename}: {exc.strerror}; fix: pass -o with a "
                         "writable path") from None
    print(f"wrote {path} (open it in a browser; it needs no network)")
    return 0
