"""The HTML of `postrain report`: `render(data) -> str`, one self-contained page.

`data` is cli/report.py's `gather(...)`. Static parts (summary, warnings, evaluations,
timings, charts, config) are HTML built here with every value escaped; the sample browser is
a small inline script over the samples, embedded as JSON in a `<script type="application/json">`
whose `<` are written `\\u003c` (so no text can close the tag). The script builds each sample
with `textContent` only: nothing a model wrote is ever parsed as HTML. No external URL appears
anywhere in the page (tests/cli/test_report.py checks it).
"""
from __future__ import annotations

import html
import json
from collections.abc import Sequence

from postrain.core.text import counted, tally

CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:0 auto;max-width:1100px;padding:0 16px 48px;color:#222}
h1{font-size:22px;margin:18px 0 4px} h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #ddd}
.sub{color:#666} table{border-collapse:collapse;margin:4px 0} td,th{padding:3px 10px;border-bottom:1px solid #eee;text-align:left}
td.num{text-align:right;font-variant-numeric:tabular-nums} .warn{background:#fff6e0;border-left:4px solid #e0a000;padding:6px 10px;margin:6px 0}
.charts{display:flex;flex-wrap:wrap;gap:12px} .chart{flex:1 1 480px;max-width:540px} .chart svg{width:100%;height:auto}
pre{background:#f6f6f6;padding:8px;overflow:auto;white-space:pre-wrap;word-break:break-word;margin:2px 0 8px}
.filters{display:flex;flex-wrap:wrap;gap:10px;align-items:center;margin:8px 0} .filters label{color:#444} .filters input{width:7em}
.sample{border:1px solid #ddd;border-radius:4px;margin:8px 0;padding:6px 10px} .sample h3{font-size:14px;margin:2px 0 6px}
.label{color:#777;font-size:12px;margin-top:4px} .good{color:#17692d} .bad{color:#a31515}
"""

SCRIPT = r"""
(function () {
  const samples = JSON.parse(document.getElementById("samples-data").textContent);
  const $ = (id) => document.getElementById(id);
  const list = $("sample-list"), count = $("sample-count");
  function fill(select, values) {
    for (const v of values) { const o = document.createElement("option"); o.value = String(v); o.textContent = String(v); select.appendChild(o); }
  }
  fill($("f-step"), [...new Set(samples.map((s) => s.step))].sort((a, b) => a - b));
  fill($("f-task"), [...new Set(samples.map((s) => s.task))].sort());
  fill($("f-outcome"), [...new Set(samples.map((s) => String(s.outcome).split(":")[0]))].sort());
  function el(tag, cls, text) { const e = document.createElement(tag); if (cls) e.className = cls; if (text !== undefined) e.textContent = text; return e; }
  function fmt(x) { return typeof x === "number" ? x.toFixed(3) : String(x); }
  function card(s) {
    const div = el("div", "sample"); div.dataset.sampleId = s.sample_id;
    const parts = Object.entries(s.components || {}).map(([k, v]) => k + " " + fmt(v)).join(", ");
    const head = el("h3", s.reward > 0 ? "good" : "bad", [
      "sample " + s.sample_id + (s.copies > 1 ? " \u00d7 " + s.copies + " identical" : ""),
      "step " + s.step, "group " + s.group, s.task, s.outcome,
      "reward " + fmt(s.reward) + (parts ? " (" + parts + ")" : ""),
      "advantage " + (s.advantage === null || s.advantage === undefined ? "-" : fmt(s.advantage)),
      "staleness " + s.staleness].join(" \u00b7 "));
    div.appendChild(head);
    div.appendChild(el("div", "label", "prompt")); div.appendChild(el("pre", "", s.prompt || ""));
    const turns = s.turns || [];
    turns.forEach((t, i) => {
      const n = turns.length > 1 ? " " + (i + 1) : "";
      div.appendChild(el("div", "label", "completion" + n)); div.appendChild(el("pre", "", t.completion || "(empty)"));
      if (t.tool_output) { div.appendChild(el("div", "label", "tool output" + n)); div.appendChild(el("pre", "", t.tool_output)); }
    });
    return div;
  }
  function apply() {
    const step = $("f-step").value, task = $("f-task").value, outcome = $("f-outcome").value;
    const lo = parseFloat($("f-min").value), hi = parseFloat($("f-max").value), text = $("f-text").value.toLowerCase();
    const limit = parseInt($("f-limit").value, 10) || 0;
    let shown = samples.filter((s) => (step === "" || String(s.step) === step) && (task === "" || s.task === task) &&
      (outcome === "" || String(s.outcome).split(":")[0] === outcome) && (isNaN(lo) || s.reward >= lo) &&
      (isNaN(hi) || s.reward <= hi) &&
      (text === "" || JSON.stringify([s.prompt, s.turns]).toLowerCase().includes(text)));
    const order = $("f-order").value;
    if (order === "newest") shown = shown.slice().sort((a, b) => b.step - a.step);
    if (order === "worst") shown = shown.slice().sort((a, b) => a.reward - b.reward);
    if (order === "best") shown = shown.slice().sort((a, b) => b.reward - a.reward);
    const total = shown.length;
    if (limit > 0) shown = shown.slice(0, limit);
    list.replaceChildren(...shown.map(card));
    count.textContent = total + " of " + samples.length + " samples match" + (shown.length < total ? "; showing " + shown.length : "");
  }
  const ids = ["f-step", "f-task", "f-outcome", "f-min", "f-max", "f-text", "f-order", "f-limit"];
  // A link may preset the filters: report.html#step=3&order=worst&min=0&max=0.5
  for (const [key, value] of new URLSearchParams(location.hash.slice(1))) {
    if (ids.includes("f-" + key)) $("f-" + key).value = value;
  }
  for (const id of ids) $(id).addEventListener("input", apply);
  apply();
})();
"""

# summary.json keys shown first, with their labels; the rest follow as they are.
SUMMARY_KEYS = {"eval_before": "held-out accuracy before", "eval_after_sft": "after the warm start",
                "eval_after": "after RL", "steps": "RL steps", "sft_steps": "warm-start steps",
                "samples": "samples", "task": "task", "max_staleness": "max staleness"}
TIMING_KEYS = {"wall_s": "wall", "warm_start_s": "warm start", "eval_s": "evaluations", "rl_wall_s": "RL",
               "rl_eval_s": "evaluations during RL", "learner_busy_s": "learner busy (RL)",
               "learner_idle_s": "learner idle (RL)"}


def esc(value) -> str:
    return html.escape(str(value), quote=True)


def number(value) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 1000 else f"{value:.1f}"
    return esc(value)


def table(rows: Sequence[tuple[str, object]]) -> str:
    cells = "".join(f"<tr><th>{esc(k)}</th><td class=num>{number(v)}</td></tr>" for k, v in rows)
    return f"<table>{cells}</table>"


def summary_section(summary: dict | None) -> str:
    if summary is None:
        return "<h2>Summary</h2><p class=warn>No summary.json: the run has not finished (or was stopped before its end).</p>"
    known = [(label, summary[key]) for key, label in SUMMARY_KEYS.items() if key in summary]
    ledger = summary.get("ledger") or {}
    known += [(f"ledger: {k}", v) for k, v in ledger.items() if isinstance(v, (int, float))]
    timing = [(label, f"{summary[key]:.1f} s") for key, label in TIMING_KEYS.items()
              if isinstance(summary.get(key), (int, float))]
    return (f"<h2>Summary</h2>{table(known)}"
            + (f"<h2>Timings</h2>{table(timing)}" if timing else ""))


def warnings_section(data: dict) -> str:
    items = []
    for row in data["warnings"]:
        causes = "; ".join(row.get("causes") or [])
        items.append(f"step {esc(row.get('step', '?'))}: {esc(row.get('code', 'warning'))}"
                     + (f": {esc(causes)}" if causes else ""))
    reasons = ((data["summary"] or {}).get("ledger") or {}).get("drop_reasons") or {}
    items += [f"{esc(counted(num, 'sample'))} dropped: {esc(reason)}" for reason, num in reasons.items()]
    body = "".join(f"<div class=warn>{item}</div>" for item in items) or "<p>None.</p>"
    return f"<h2>Warnings</h2>{body}"


def evals_section(evals: list[dict]) -> str:
    if not evals:
        return "<h2>Evaluations</h2><p>No evaluation rows in metrics.jsonl.</p>"
    head = ("<tr><th>phase</th><th>step</th><th>accuracy (greedy)</th><th>accuracy (sampled)</th><th>seconds</th>"
            "<th>causes (greedy episodes)</th></tr>")
    rows = "".join(
        f"<tr><td>{esc(str(row.get('phase', '')).replace('_', ' '))}</td><td class=num>{number(row.get('step', ''))}</td>"
        f"<td class=num>{number(row.get('accuracy', ''))}</td><td class=num>{number(row.get('accuracy_sampled', ''))}</td>"
        f"<td class=num>{number(row.get('eval_s', ''))}</td><td>{esc(eval_causes(row))}</td></tr>" for row in evals)
    return f"<h2>Evaluations</h2><table id=evals>{head}{rows}</table>"


def eval_causes(row: dict) -> str:
    """An evaluation row's episodes by the cause their environment named (`causes`; a mixture's
    `causes_<task>`, each task named): 'no_export 5, ok 3'."""
    if isinstance(row.get("causes"), dict):
        return tally(row["causes"])
    return "; ".join(f"{key.removeprefix('causes_')}: {tally(value)}" for key, value in sorted(row.items())
                     if key.startswith("causes_") and isinstance(value, dict))


def tasks_section(data: dict) -> str:
    """A mixture's tasks (actors/tasks/mixture.py): each one's held-out accuracies by phase and its
    RL figures (groups trained, mean reward of its samples); nothing for a run of one task."""
    by_task = (data["summary"] or {}).get("eval_by_task") or {}
    names = sorted(set(by_task) | {key.removeprefix("num_groups_") for row in data["train"] for key in row
                                   if key.startswith("num_groups_")})
    if not names:
        return ""
    phases = ("before", "after_sft", "after")
    head = ("<tr><th>task</th>" + "".join(f"<th>{esc(phase.replace('_', ' '))}</th>" for phase in phases)
            + "<th>groups trained</th><th>mean reward (RL)</th></tr>")
    rows = []
    for name in names:
        groups = sum(row.get(f"num_groups_{name}", 0) for row in data["train"])
        rewards = [(row[f"reward_mean_{name}"], row[f"num_groups_{name}"]) for row in data["train"]
                   if f"reward_mean_{name}" in row]
        mean = sum(r * n for r, n in rewards) / sum(n for _, n in rewards) if rewards else ""
        cells = "".join(f"<td class=num>{number(by_task.get(name, {}).get(phase, ''))}</td>" for phase in phases)
        rows.append(f"<tr><td>{esc(name)}</td>{cells}<td class=num>{number(groups)}</td>"
                    f"<td class=num>{number(mean)}</td></tr>")
    return f"<h2>Tasks</h2><table id=tasks>{head}{''.join(rows)}</table>"


def charts_section(data: dict) -> str:
    charts = "".join(f"<div class=chart data-chart=\"{esc(title)}\">{svg}</div>" for title, svg in data["charts"].items())
    skipped = "".join(f"<li>{esc(title)}: {esc(why)}</li>" for title, why in data["skipped_charts"].items())
    return (f"<h2>Charts</h2><div class=charts>{charts}</div>"
            + (f"<p class=sub>Not drawn:</p><ul class=sub>{skipped}</ul>" if skipped else ""))


def samples_section(data: dict) -> str:
    samples = data["samples"]
    num_shown = sum(sample.get("copies", 1) for sample in samples)   # identical samples are one card
    note = "" if num_shown == data["num_samples"] else (
        f"<p class=sub>{num_shown} of the run's {data['num_samples']} samples are in this page, spread over "
        "the run (postrain report --max-samples 0 embeds all).</p>")
    if not samples:
        return "<h2>Samples</h2><p>No samples.jsonl: the run trained no RL step.</p>"
    payload = json.dumps(samples, ensure_ascii=False).replace("<", "\\u003c")
    return f"""<h2>Samples</h2>{note}
<div class=filters>
<label>step <select id=f-step><option value="">all</option></select></label>
<label>task <select id=f-task><option value="">all</option></select></label>
<label>outcome <select id=f-outcome><option value="">all</option></select></label>
<label>reward from <input id=f-min type=number step=any size=5></label>
<label>to <input id=f-max type=number step=any size=5></label>
<label>text <input id=f-text type=search size=14></label>
<label>order <select id=f-order><option value=newest selected>newest first</option><option value="">run order</option><option value=worst>worst first</option>
<option value=best>best first</option></select></label>
<label>show <input id=f-limit type=number min=0 value=50 size=4></label>
</div>
<p id=sample-count class=sub></p><div id=sample-list></div>
<script type="application/json" id="samples-data">{payload}</script>
<script>{SCRIPT}</script>"""


def render(data: dict) -> str:
    """The whole page of a run."""
    config = (f"<h2>Config</h2><pre id=config>{esc(data['config'])}</pre>" if data["config"] is not None
              else "<h2>Config</h2><p>No config.toml in the run folder.</p>")
    counts = f"{data['num_sft_rows']} warm-start steps, {data['num_train_rows']} RL steps logged"
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width,initial-scale=1">
<title>postrain run {esc(data['name'])}</title><style>{CSS}</style></head>
<body>
<h1>postrain run {esc(data['name'])}</h1>
<p class=sub>{esc(data['folder'])}: {counts}</p>
{summary_section(data['summary'])}
{warnings_section(data)}
{evals_section(data['evals'])}
{tasks_section(data)}
{charts_section(data)}
{samples_section(data)}
{config}
</body></html>
"""
