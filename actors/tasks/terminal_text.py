"""Terminal tasks of file and text work: find, grep, sed, awk, sort/uniq pipelines, renaming by
pattern, JSON and CSV transforms. Each `make_*(index)` builds one seeded instance (see
`terminal_build` for the task dict); `KINDS` lists them for the suite (`terminal.py`).
"""
from __future__ import annotations

import json
from typing import Any

from .terminal_build import NAMES, WORDS, Step, listing, make_task, python_check, rng_for, sha256

LEVELS = ("INFO", "DEBUG", "WARN")


def make_count_errors(index: int) -> dict:
    """Count ERROR lines across nested .log files; INFO lines that mention ERROR do not count."""
    rng = rng_for("count_errors", index)
    files, total = {}, 0
    for path in ("logs/app.log", "logs/worker/worker-1.log", "logs/worker/worker-2.log"):
        rows = []
        for i in range(rng.randint(12, 24)):
            level = "ERROR" if rng.random() < 0.3 else rng.choice(LEVELS)
            total += level == "ERROR"
            note = "retry after ERROR_TIMEOUT" if level == "INFO" and rng.random() < 0.3 else f"event {i}"
            rows.append(f"2026-11-{rng.randint(10, 28)} 12:{i:02d}:00 {level} {note}")
        files[path] = listing(rows)
    files["logs/old/archive.txt"] = listing([f"2026-10-01 00:00:0{i} ERROR old" for i in range(5)])
    prompt = ("Count the log lines whose level is ERROR in all .log files under logs/ (the level is "
              "the third field of a line; other files do not count). Write just the number to "
              "error_count.txt.")
    check = python_check(f"expect_lines('error_count.txt', [{str(total)!r}])")
    solution = [Step("find logs -name '*.log' -exec cat {} + | grep -c ' ERROR ' > error_count.txt"),
                Step("cat error_count.txt", f"{total}\n")]
    return make_task("count_errors", index, prompt, files, check, solution)


def make_todo_files(index: int) -> dict:
    """List (sorted) the files under docs/ that contain TODO."""
    rng = rng_for("todo_files", index)
    files, with_todo = {}, []
    for i, word in enumerate(rng.sample(WORDS, 9)):
        path = f"docs/{'guide/' if i % 3 == 0 else ''}{word}.md"
        body = [f"# {word}", "", f"Notes about {word}."]
        if rng.random() < 0.5 or i == 0:
            body.insert(2, "TODO: write the examples")
            with_todo.append(path)
        files[path] = listing(body)
    with_todo.sort()
    prompt = ("Write the paths of the files under docs/ that contain the text TODO to todo_files.txt, "
              "one path per line (like docs/x.md), sorted.")
    check = python_check(f"expect_lines('todo_files.txt', {with_todo!r})")
    solution = [Step("grep -rl TODO docs | sort > todo_files.txt"),
                Step("cat todo_files.txt", listing(with_todo))]
    return make_task("todo_files", index, prompt, files, check, solution)


def make_delete_backups(index: int) -> dict:
    """Delete every *.bak file in a tree, keep the rest untouched."""
    rng = rng_for("delete_backups", index)
    files = {}
    for folder in ("project", "project/src", "project/src/util", "project/docs"):
        for word in rng.sample(WORDS, 3):
            files[f"{folder}/{word}.txt"] = f"{word} {rng.randint(0, 999)}\n"
            if rng.random() < 0.6:
                files[f"{folder}/{word}.txt.bak"] = f"old {word}\n"
    files["project/notes.bak.txt"] = "not a backup: it ends in .txt\n"
    keep = sorted(p for p in files if not p.endswith(".bak"))
    kept = {p: sha256(files[p]) for p in keep}
    prompt = ("Delete every file whose name ends in .bak anywhere under project/. Leave all other files "
              "as they are.")
    check = python_check(f"""
kept = {kept!r}
for path in files_under('project'):
    if path.endswith('.bak'):
        fail(path + ' is still there')
for path, digest in kept.items():
    unchanged(path, digest)
if len(files_under('project')) != len(kept):
    fail('files other than the .bak ones were removed or added')
""")
    solution = [Step("find project -name '*.bak' -delete"),
                Step("find project -type f | sort", listing(keep))]
    return make_task("delete_backups", index, prompt, files, check, solution)


def make_large_files(index: int) -> dict:
    """List the files larger than a size."""
    rng = rng_for("large_files", index)
    files, big = {}, []
    for i, word in enumerate(rng.sample(WORDS, 10)):
        size = rng.choice((rng.randint(100, 900), rng.randint(1100, 5000)))
        path = f"data/{'raw/' if i % 2 else ''}{word}.dat"
        files[path] = ("x" * 63 + "\n") * (size // 64) + "y" * (size % 64)
        if len(files[path]) > 1000:
            big.append(path)
    big.sort()
    prompt = ("Write the paths of the files under data/ that are larger than 1000 bytes to big.txt, one "
              "path per line (like data/x.dat), sorted.")
    check = python_check(f"expect_lines('big.txt', {big!r})")
    solution = [Step("find data -type f -size +1000c | sort > big.txt"),
                Step("cat big.txt", listing(big))]
    return make_task("large_files", index, prompt, files, check, solution)


def make_replace_host(index: int) -> dict:
    """sed: change one key's value in every .ini file, and nothing else."""
    rng = rng_for("replace_host", index)
    new_host = ("db.internal", "pg.prod.local", "10.0.0.5")[index % 3]
    files, want = {}, {}
    for name in rng.sample(("api", "worker", "billing", "search", "auth"), 3):
        before = ["[database]", "host = localhost", f"port = {rng.randint(5000, 6000)}",
                  "backup_host = localhost", "# localhost is used in development", "", "[cache]",
                  "host = localhost"]
        after = list(before)
        after[1] = after[7] = f"host = {new_host}"
        files[f"config/{name}.ini"], want[f"config/{name}.ini"] = listing(before), after
    files["config/README"] = "host = localhost\n"
    prompt = (f"In every .ini file under config/, change each line `host = localhost` to "
              f"`host = {new_host}`. Other lines (backup_host, comments) and other files stay as they are.")
    check = python_check(f"""
for path, want in {want!r}.items():
    expect_lines(path, want)
unchanged('config/README', {sha256(files['config/README'])!r})
""")
    solution = [Step(f"sed -i 's/^host = localhost$/host = {new_host}/' config/*.ini"),
                Step("grep -c '^host = ' config/*.ini",
                     listing([f"{p}:2" for p in sorted(want)]))]
    return make_task("replace_host", index, prompt, files, check, solution)


def make_top_words(index: int) -> dict:
    """sort | uniq -c | sort -rn | head: the most frequent words with their counts."""
    rng = rng_for("top_words", index)
    chosen = rng.sample(WORDS, 7)
    counts = dict(zip(chosen, rng.sample(range(2, 30), 7)))   # distinct counts: one right answer
    words = [w for w, n in counts.items() for _ in range(n)]
    rng.shuffle(words)
    top = [f"{n} {w}" for w, n in sorted(counts.items(), key=lambda kv: -kv[1])[:3]]
    prompt = ("words.txt holds one word per line. Write the 3 most frequent words to top3.txt, most "
              "frequent first, one per line as `COUNT WORD` (for example `12 apple`).")
    check = python_check(f"expect_lines('top3.txt', {top!r})")
    solution = [Step("sort words.txt | uniq -c | sort -rn | head -n 3 | sed 's/^ *//' > top3.txt"),
                Step("cat top3.txt", listing(top))]
    return make_task("top_words", index, prompt, {"words.txt": listing(words)}, check, solution)


def make_sum_by_region(index: int) -> dict:
    """awk: sum a CSV column grouped by another."""
    rng = rng_for("sum_by_region", index)
    regions = rng.sample(("north", "south", "east", "west", "central"), 4)
    rows, totals = ["date,region,amount"], dict.fromkeys(regions, 0)
    for day in range(rng.randint(15, 30)):
        region, amount = rng.choice(regions), rng.randint(5, 500)
        totals[region] += amount
        rows.append(f"2026-11-{day % 28 + 1:02d},{region},{amount}")
    want = [f"{r} {totals[r]}" for r in sorted(totals) if totals[r]]
    prompt = ("sales.csv has a header line and the columns date,region,amount. Write the total amount "
              "of each region to totals.txt, one line per region as `REGION TOTAL`, sorted by region.")
    check = python_check(f"expect_lines('totals.txt', {want!r})")
    solution = [Step("tail -n +2 sales.csv | awk -F, '{sum[$2] += $3} END {for (r in sum) print r, sum[r]}' "
                     "| sort > totals.txt"),
                Step("cat totals.txt", listing(want))]
    return make_task("sum_by_region", index, prompt, {"sales.csv": listing(rows)}, check, solution)


def make_rename_ext(index: int) -> dict:
    """Rename by pattern: one extension to another, keeping the stem and the contents."""
    rng = rng_for("rename_ext", index)
    old_ext, new_ext = ((".JPG", ".jpg"), (".jpeg", ".jpg"), (".TXT", ".txt"))[index % 3]
    files, want = {}, {}
    for i in sorted(rng.sample(range(1, 9999), 6)):
        stem = f"IMG_{i:04d}"
        files[f"photos/{stem}{old_ext}"] = f"picture {i}\n"
        want[f"photos/{stem}{new_ext}"] = sha256(f"picture {i}\n")
    files["photos/index.html"] = "<html></html>\n"
    want["photos/index.html"] = sha256(files["photos/index.html"])
    prompt = (f"Rename every file in photos/ that ends in {old_ext} so that it ends in {new_ext} "
              f"instead, keeping the rest of its name (IMG_0001{old_ext} -> IMG_0001{new_ext}).")
    check = python_check(f"""
want = {want!r}
if files_under('photos') != sorted(want):
    fail('photos/ holds ' + repr(files_under('photos')) + ', expected ' + repr(sorted(want)))
for path, digest in want.items():
    unchanged(path, digest)
""")
    solution = [Step(f'for f in photos/*{old_ext}; do mv "$f" "${{f%{old_ext}}}{new_ext}"; done'),
                Step("ls photos", listing(sorted(p.removeprefix("photos/") for p in want)))]
    return make_task("rename_ext", index, prompt, files, check, solution)


def make_json_filter(index: int) -> dict:
    """A JSON transform: select and sort by fields."""
    rng = rng_for("json_filter", index)
    users: list[dict[str, Any]] = [{"name": n, "active": rng.random() < 0.5, "age": rng.randint(18, 80)}
             for n in rng.sample(NAMES, 10)]
    users[0]["active"] = True
    want = sorted(u["name"] for u in users if u["active"])
    prompt = ("users.json is a list of objects with the fields name, active and age. Write the names of "
              "the active users to active.txt, one per line, sorted alphabetically.")
    script = ("import json; users = json.load(open('users.json')); "
              "print('\\n'.join(sorted(u['name'] for u in users if u['active'])))")
    check = python_check(f"expect_lines('active.txt', {want!r})")
    solution = [Step(f'python3 -c "{script}" > active.txt'),
                Step("cat active.txt", listing(want))]
    return make_task("json_filter", index, prompt, {"users.json": json.dumps(users, indent=2) + "\n"},
                     check, solution)


def make_csv_column(index: int) -> dict:
    """cut a column of the CSV rows that match a field."""
    rng = rng_for("csv_column", index)
    country = ("DE", "FR", "JP")[index % 3]
    rows, want = ["name,email,country"], []
    for name in rng.sample(NAMES, 12):
        where = rng.choice(("DE", "FR", "JP", "US", "BR"))
        rows.append(f"{name},{name}@{where.lower()}.example,{where}")
        if where == country:
            want.append(f"{name}@{where.lower()}.example")
    if not want:
        rows.append(f"zoe,zoe@{country.lower()}.example,{country}")
        want.append(f"zoe@{country.lower()}.example")
    prompt = (f"people.csv has a header line and the columns name,email,country. Write the emails of "
              f"the people whose country is {country} to emails.txt, one per line, in the file's order.")
    check = python_check(f"expect_lines('emails.txt', {want!r})")
    solution = [Step(f"grep ',{country}$' people.csv | cut -d, -f2 > emails.txt"),
                Step("cat emails.txt", listing(want))]
    return make_task("csv_column", index, prompt, {"people.csv": listing(rows)}, check, solution)


def make_dedupe(index: int) -> dict:
    """Remove duplicate lines in place, keeping the first of each in order."""
    rng = rng_for("dedupe", index)
    unique = [f"{n}@mail.example" for n in rng.sample(NAMES, 8)]
    rows = list(unique)
    for _ in range(7):
        rows.insert(rng.randint(1, len(rows)), rng.choice(unique[:5]))
    first_seen = list(dict.fromkeys(rows))
    prompt = ("emails.txt has duplicate lines. Remove the duplicates in place: keep the first occurrence "
              "of each line, in the original order.")
    check = python_check(f"expect_lines('emails.txt', {first_seen!r})")
    solution = [Step("awk '!seen[$0]++' emails.txt > emails.new && mv emails.new emails.txt"),
                Step("wc -l < emails.txt", f"{len(first_seen)}\n")]
    return make_task("dedupe", index, prompt, {"emails.txt": listing(rows)}, check, solution)


def make_json_to_csv(index: int) -> dict:
    """JSON to CSV: one row per object, chosen columns, sorted."""
    rng = rng_for("json_to_csv", index)
    items = {f"SKU-{rng.randint(100, 999)}": rng.randint(0, 90) for _ in range(8)}
    inventory = [{"sku": sku, "qty": qty, "bin": f"B{rng.randint(1, 9)}"} for sku, qty in items.items()]
    rng.shuffle(inventory)
    want = ["sku,qty"] + [f"{sku},{items[sku]}" for sku in sorted(items)]
    prompt = ("inventory.json is a list of objects with the fields sku, qty and bin. Write inventory.csv "
              "with the header line `sku,qty` and one line `SKU,QTY` per object, sorted by sku.")
    script = ("import json; rows = sorted(json.load(open('inventory.json')), key=lambda r: r['sku']); "
              "print('sku,qty'); [print(r['sku'] + ',' + str(r['qty'])) for r in rows]")
    check = python_check(f"expect_lines('inventory.csv', {want!r})")
    solution = [Step(f'python3 -c "{script}" > inventory.csv'),
                Step("head -n 2 inventory.csv", listing(want[:2]))]
    return make_task("json_to_csv", index, prompt,
                     {"inventory.json": json.dumps(inventory, indent=1) + "\n"}, check, solution)


KINDS = (make_count_errors, make_todo_files, make_delete_backups, make_large_files, make_replace_host,
         make_top_words, make_sum_by_region, make_rename_ext, make_json_filter, make_csv_column,
         make_dedupe, make_json_to_csv)
