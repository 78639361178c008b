"""Terminal tasks that need several steps by construction: small repositories to fix (a failing
unit test, a wrong config value, a broken shell script), a chain of clues to follow, scripts that
cannot run. In each, the agent must inspect (run the tests, run the program, read a file), then
act, then check; the reference steps do exactly that. `KINDS` lists them for the suite.
"""
from __future__ import annotations

import json

from .terminal_build import WORDS, Step, listing, make_task, python_check, rng_for, sha256

_STATS = '''\
def mean(xs):
    return sum(xs) / {mean_div}


def clamp(x, lo, hi):
    return max(lo, min(x, {clamp_hi}))


def is_even(n):
    return n % 2 == {even_rest}
'''
_STATS_RIGHT = {"mean_div": "len(xs)", "clamp_hi": "hi", "even_rest": "0"}
_STATS_BUGS = (("mean_div", "(len(xs) + 1)", "s/(len(xs) + 1)/len(xs)/"),
               ("clamp_hi", "lo", "s/min(x, lo)/min(x, hi)/"),
               ("even_rest", "1", "s/n % 2 == 1/n % 2 == 0/"))
_TESTS = '''\
import unittest

from mathlib.stats import clamp, is_even, mean


class StatsTest(unittest.TestCase):
    def test_mean(self):
        self.assertEqual(mean({xs!r}), {mean!r})

    def test_clamp(self):
        self.assertEqual(clamp({x}, 0, 100), {x})
        self.assertEqual(clamp(150, 0, 100), 100)

    def test_is_even(self):
        self.assertTrue(is_even({even}))
        self.assertFalse(is_even({odd}))


if __name__ == "__main__":
    unittest.main()
'''


def make_fix_unit_test(index: int) -> dict:
    """A package whose unit tests fail on one bug: run them, read the code, fix it, run again."""
    rng = rng_for("fix_unit_test", index)
    field, wrong, fix = _STATS_BUGS[index % len(_STATS_BUGS)]
    stats = _STATS.format(**{**_STATS_RIGHT, field: wrong})
    xs = [rng.randint(1, 20) * 2 for _ in range(4)]
    tests_x, even, odd = rng.randint(1, 99), rng.randrange(2, 100, 2), rng.randrange(1, 100, 2)
    tests = _TESTS.format(xs=xs, mean=sum(xs) / len(xs), x=tests_x, even=even, odd=odd)
    files = {"mathlib/__init__.py": "", "mathlib/stats.py": stats, "tests/__init__.py": "",
             "tests/test_stats.py": tests}
    prompt = ("The unit tests of this repository fail (`python3 -m unittest`). Find the bug in the "
              "package mathlib/ and fix it there; do not change the tests.")
    # The verdict must not come from a process that imported the package (it could patch unittest
    # or exit 0): a child computes the tests' calls and a few unseen ones and prints the values;
    # this process, which never imports mathlib, compares them.
    xs2 = [x + 3 for x in xs]
    calls = (f"[mean({xs!r}), clamp({tests_x}, 0, 100), clamp(150, 0, 100), is_even({even}), "
             f"is_even({odd}), mean({xs2!r}), clamp(-7, 0, 100), is_even({even + 2}), is_even({odd + 2})]")
    want = [sum(xs) / len(xs), tests_x, 100, True, False, sum(xs2) / len(xs2), 0, True, False]
    probe = ("import json, sys; sys.path.insert(0, '/work'); from mathlib.stats import clamp, is_even, mean; "
             f"print(); print(json.dumps({calls}))")
    check = python_check(f"""
unchanged('tests/test_stats.py', {sha256(tests)!r})
result = run(['python3', '-I', '-c', {probe!r}])
try:
    got = json.loads(result.stdout.strip().splitlines()[-1])
except (ValueError, IndexError):
    got = None
if result.returncode != 0 or got != {want!r}:
    fail('the unit tests still fail: ' + result.stderr[-300:])
""")
    solution = [Step("python3 -m unittest 2>&1 | tail -n 1", "FAILED (failures=1)\n"),
                Step("cat mathlib/stats.py", stats),
                Step(f"sed -i '{fix}' mathlib/stats.py"),
                Step("python3 -m unittest 2>&1 | tail -n 1", "OK\n")]
    return make_task("fix_unit_test", index, prompt, files, check, solution)


_APP = '''\
import json
import sys

with open("settings.json") as f:
    cfg = json.load(f)
problems = []
if not 1024 <= cfg["port"] <= 65535:
    problems.append(f"port must be between 1024 and 65535, got {cfg['port']}")
if not (isinstance(cfg["workers"], int) and cfg["workers"] >= 1):
    problems.append(f"workers must be a whole number >= 1, got {cfg['workers']!r}")
if cfg["log_level"] not in ("debug", "info", "warning"):
    problems.append(f"log_level must be debug, info or warning, got {cfg['log_level']!r}")
if problems:
    print("config error: " + problems[0], file=sys.stderr)
    sys.exit(2)
print(f"{cfg['name']}: serving on port {cfg['port']} with {cfg['workers']} workers")
'''
_CONFIG_BUGS = (("port", 80, 8080, "port must be between 1024 and 65535, got 80"),
                ("workers", 0, 4, "workers must be a whole number >= 1, got 0"),
                ("log_level", "verbose", "debug", "log_level must be debug, info or warning, got 'verbose'"))


def make_fix_config(index: int) -> dict:
    """A program refuses its config: run it, read the error, fix the one wrong value, run it again."""
    rng = rng_for("fix_config", index)
    key, wrong, right, error = _CONFIG_BUGS[index % len(_CONFIG_BUGS)]
    good = {"name": rng.choice(WORDS), "port": rng.randint(1025, 9999), "workers": rng.randint(1, 8),
            "log_level": rng.choice(("info", "warning"))}
    settings = json.dumps({**good, key: wrong}, indent=2) + "\n"
    fixed = {**good, key: right}
    line = json.dumps({key: wrong})[1:-1]
    prompt = ("`python3 app.py` refuses to start. Fix the wrong value in settings.json so that it runs; "
              "do not change app.py or the other settings.")
    check = python_check(f"""
unchanged('app.py', {sha256(_APP)!r})
try:
    cfg = json.loads(text('settings.json'))
except ValueError as exc:
    fail('settings.json is not valid JSON: ' + str(exc))
for name, value in {({k: v for k, v in good.items() if k != key})!r}.items():
    if cfg.get(name) != value:
        fail('settings.json: ' + name + ' was changed; the task says to leave it')
result = run(['python3', '-I', 'app.py'])
if result.returncode != 0:
    fail('python3 app.py still fails: ' + result.stderr[-300:])
""")
    solution = [Step("python3 app.py", stderr=f"config error: {error}\n", exit_code=2),
                Step(f"sed -i 's/{line}/{json.dumps({key: right})[1:-1]}/' settings.json"),
                Step("python3 app.py", f"{fixed['name']}: serving on port {fixed['port']} with "
                                       f"{fixed['workers']} workers\n")]
    return make_task("fix_config", index, prompt, {"app.py": _APP, "settings.json": settings}, check,
                     solution)


_SUMMARY = '''\
#!/bin/bash
# Writes out/summary.txt: one line "NAME LINES" per .txt file in data/, by name.
set -e
out=out/summary.txt
mkdir -p {folder}
: > "$out"
for f in data/*.{ext}; do
  n=$(wc -l < "$f")
  echo "$(basename "$f" .txt) $n" {redirect} "$out"
done
'''
_SUMMARY_RIGHT = {"folder": "out", "ext": "txt", "redirect": ">>"}
# (field, wrong value, sed fix, the failing run's stderr (exit 1) or None: it runs, output wrong)
_SCRIPT_BUGS = (("folder", "output", "s/mkdir -p output/mkdir -p out/",
                 "scripts/summary.sh: line 6: out/summary.txt: No such file or directory\n"),
                ("ext", "text", "s/data\\/\\*\\.text/data\\/*.txt/",
                 "scripts/summary.sh: line 8: data/*.text: No such file or directory\n"),
                ("redirect", ">", 's/\\$n" > /$n" >> /', None))


def make_fix_script(index: int) -> dict:
    """A broken shell script: run it, read it, fix it, run it again and look at what it wrote."""
    rng = rng_for("fix_script", index)
    field, wrong, fix, error = _SCRIPT_BUGS[index % len(_SCRIPT_BUGS)]
    script = _SUMMARY.format(**{**_SUMMARY_RIGHT, field: wrong})
    counts = {w: rng.randint(1, 12) for w in sorted(rng.sample(WORDS, 4))}
    files = {f"data/{w}.txt": listing([f"{w} {i}" for i in range(n)]) for w, n in counts.items()}
    files["data/README.md"] = "Not counted: not a .txt file.\n"
    files["scripts/summary.sh"] = script
    want = [f"{w} {n}" for w, n in counts.items()]
    prompt = ("`bash scripts/summary.sh` should write out/summary.txt with one line `NAME LINES` per .txt "
              "file in data/ (its name without .txt, and its number of lines). It is broken: fix the "
              "script so that it does that.")
    check = python_check(f"""
import shutil
shutil.rmtree('out', ignore_errors=True)
result = run(['bash', 'scripts/summary.sh'])
if result.returncode != 0:
    fail('bash scripts/summary.sh fails: ' + result.stderr[-300:])
expect_lines('out/summary.txt', {want!r})
""")
    first = (Step("bash scripts/summary.sh", stderr=error, exit_code=1) if error else
             Step("bash scripts/summary.sh && cat out/summary.txt", listing(want[-1:])))
    solution = [first, Step("cat scripts/summary.sh", script), Step(f"sed -i '{fix}' scripts/summary.sh"),
                Step("bash scripts/summary.sh && cat out/summary.txt", listing(want))]
    return make_task("fix_script", index, prompt, files, check, solution)


def make_follow_clues(index: int) -> dict:
    """A chain of files, each naming the next: it can only be solved by reading them in order."""
    rng = rng_for("follow_clues", index)
    names = [f"clues/c{i:02d}.txt" for i in rng.sample(range(1, 40), 12)]
    chain = names[:4]

    def code():
        return "".join(rng.choice("ABCDEFGHJKLMNPQRSTUVWXYZ23456789") for _ in range(6))

    answer = code()
    files = {"start.txt": f"The next clue is in {chain[0]}\n"}
    for here, there in zip(chain, chain[1:]):
        files[here] = f"The next clue is in {there}\n"
    files[chain[-1]] = f"The code is {answer}\n"
    for decoy in names[4:]:
        files[decoy] = (f"The code is {code()}\n" if rng.random() < 0.6 else
                        f"The next clue is in {rng.choice(names[4:])}\n")
    prompt = ("Start at start.txt and follow the clues (each names the file of the next one) until one "
              "gives a code. Write the code alone to code.txt. Only the chain from start.txt counts.")
    check = python_check(f"expect_lines('code.txt', [{answer!r}])")
    solution = [Step("cat start.txt", files["start.txt"])]
    solution += [Step(f"cat {path}", files[path]) for path in chain]
    solution.append(Step(f"echo {answer} > code.txt"))
    return make_task("follow_clues", index, prompt, files, check, solution)


_RUN = '''\
#!/bin/bash
set -e
{steps}
echo "all steps done"
'''


def make_exec_bits(index: int) -> dict:
    """Scripts that lose their execute bit: run, read the error, chmod, run again."""
    rng = rng_for("exec_bits", index)
    tools = sorted(rng.sample(("fetch", "build", "lint", "pack", "test"), 3))
    version = f"{rng.randint(1, 4)}.{rng.randint(0, 9)}"
    files = {f"tools/{t}.sh": f"#!/bin/bash\necho \"{t}: ok ({version})\"\n" for t in tools}
    files["run.sh"] = _RUN.format(steps="\n".join(f"./tools/{t}.sh" for t in tools))
    setup = "chmod 755 run.sh && chmod 644 tools/*.sh"
    out = listing([f"{t}: ok ({version})" for t in tools] + ["all steps done"])
    prompt = "`./run.sh` fails. Make it run to its end without editing any of the scripts."
    digests = {path: sha256(body) for path, body in files.items()}
    check = python_check(f"""
for path, digest in {digests!r}.items():
    unchanged(path, digest)
result = run(['./run.sh'])
if result.returncode != 0 or result.stdout != {out!r}:
    fail('./run.sh does not run to its end: ' + (result.stderr or result.stdout)[-300:])
""")
    solution = [Step("./run.sh", stderr=f"./run.sh: line 3: ./tools/{tools[0]}.sh: Permission denied\n",
                     exit_code=126),
                Step("ls -l tools | cut -c1-10 | tail -n +2", listing(["-rw-r--r--"] * len(tools))),
                Step("chmod +x tools/*.sh"),
                Step("./run.sh", out)]
    return make_task("exec_bits", index, prompt, files, check, solution, setup=setup)


KINDS = (make_fix_unit_test, make_fix_config, make_fix_script, make_follow_clues, make_exec_bits)
