"""The READMEs' sample output and quoted numbers are the reference run's results, committed
as figures/reference.json (a name no run writes: a reader's own run rewrites
figures/results.json and the figures, never the reference), rendered the way a run prints it,
so they cannot go stale.

Two kinds of marks, both invisible in rendered Markdown:
- a block of output between `<!-- output: all -->` (the whole run: banner, ceilings, every
  table) or `<!-- output: from "PREFIX" lines N -->` (the N lines from the first line that
  starts with PREFIX) and `<!-- output: end -->`, its fence lines aside;
- a number followed at once by `<!--= PATH FORMAT -->`: the value at PATH in results.json
  (dots between keys; `rows[batch=32,context=128]` is the row of a list with those fields),
  formatted as a table cell is (a format() spec or a unit of nn40.tables' UNITS).

After the reference changes, `python tests/test_readme.py` rewrites every block and number in
place from figures/reference.json; `python tests/test_readme.py figures/results.json` first
takes that run's results as the reference. The test below then passes again.
"""
import json
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import NN_40_serving as S  # noqa: E402
from nn40.tables import ceilings_line, render  # noqa: E402
from nn40.tables_c import format_tables  # noqa: E402
from nn40.text_ko import TEXT  # noqa: E402

READMES = [ROOT / "README.md", ROOT / "figures" / "README.md", ROOT / "tests" / "README.md"]
RESULTS = ROOT / "figures" / "reference.json"
BLOCK = re.compile(r"^<!-- output: (all|from \"(?P<prefix>[^\"]+)\" lines (?P<n>\d+)) -->\n"
                   r"(?P<body>.*?)^<!-- output: end -->$", re.S | re.M)
VALUE = re.compile(r"(?P<number>[-+]?[\d,]*\.?\d+%?)<!--= (?P<path>\S+) (?P<fmt>\S+) -->")


def sample_output(results, lang="en"):
    """What a run prints on stdout before its last line ("wrote ..."): the banner, the
    ceilings (when A or B ran) and every table, from the results dictionary alone."""
    T = TEXT[lang]
    lines = [S.banner(results, T)]
    if "ceilings" in results["environment"]:
        lines.append(ceilings_line(T, results["environment"]["ceilings"],
                                     results["environment"].get("device_type")))
    return "\n".join(lines) + "\n\n" + format_tables(results, lang)


def excerpt(output, prefix, n):
    lines = output.split("\n")
    start = next((i for i, line in enumerate(lines) if line.startswith(prefix)), None)
    if start is None:
        raise KeyError(f"no line of the output starts with {prefix!r}")
    return "\n".join(lines[start:start + n])


def lookup(results, path):
    """The value at a dotted path; `key[field=value,...]` picks a list's row by its fields."""
    value = results
    for part in path.split("."):
        key, _, select = part.partition("[")
        value = value[key] if key else value
        if select:
            wanted = dict(kv.split("=", 1) for kv in select.rstrip("]").split(","))
            value = next(r for r in value if all(str(r[k]) == v for k, v in wanted.items()))
    return value


def expected_block(output, match):
    text = output if match.group(1) == "all" else excerpt(output, match["prefix"], int(match["n"]))
    return "```\n" + text.rstrip("\n") + "\n```\n"


def stale(text, results, output):
    """[(what, README's text, the results' text)] for every block and number that differs."""
    found = []
    for m in BLOCK.finditer(text):
        want = expected_block(output, m)
        if [line.rstrip() for line in m["body"].split("\n")] != want.split("\n"):
            found.append((m.group(1), m["body"], want))
    for m in VALUE.finditer(text):
        want = render(lookup(results, m["path"]), m["fmt"])
        if m["number"] != want:
            found.append((m["path"], m["number"], want))
    return found


def refreshed(text, results, output):
    """The text with every block and number rendered again from the results (LookupError
    naming the first mark they cannot fill)."""
    text = BLOCK.sub(lambda m: m.group(0).replace(m["body"], expected_block(output, m)), text)
    return VALUE.sub(lambda m: marked(results, m) + m.group(0)[len(m["number"]):], text)


def marked(results, m):
    """A number's mark rendered from the results; LookupError where they hold no value there
    (a run that chose another type, or shrunk by --quick, lacks rows the reference has)."""
    try:
        return render(lookup(results, m["path"]), m["fmt"])
    except (KeyError, StopIteration, TypeError, IndexError, ValueError) as e:
        raise LookupError(f"no value for the mark {m['path']} {m['fmt']} "
                          f"({type(e).__name__})") from None


def render_again(source, reference=RESULTS, readmes=READMES):
    """Every README's marks rendered from the results at `source`, which become the reference:
    all rendered before anything is written, so results that cannot fill a mark write nothing.
    -> the READMEs rewritten."""
    text = pathlib.Path(source).read_text(encoding="utf-8")
    results = json.loads(text)
    output = sample_output(results)
    new = {}
    for path in readmes:
        if path.exists():
            old = path.read_text(encoding="utf-8")
            try:
                new[path] = (old, refreshed(old, results, output))
            except LookupError as e:  # (KeyError too: an excerpt with no such line)
                raise LookupError(f"{path.name}: {str(e).strip(chr(34) + chr(39))}") from None
    if pathlib.Path(source).resolve() != pathlib.Path(reference).resolve():
        pathlib.Path(reference).write_text(text, encoding="utf-8")
    changed = [path for path, (old, rendered) in new.items() if rendered != old]
    for path in changed:
        path.write_text(new[path][1], encoding="utf-8")
    return changed


def committed():
    results = json.loads(RESULTS.read_text(encoding="utf-8"))
    return results, sample_output(results)


def test_the_readmes_output_and_numbers_are_the_committed_results():
    results, output = committed()
    marks = 0
    for path in READMES:
        if not path.exists():
            continue
        text = path.read_text(encoding="utf-8")
        marks += len(BLOCK.findall(text)) + len(VALUE.findall(text))
        assert not stale(text, results, output), (
            f"{path.relative_to(ROOT)} differs from figures/reference.json; "
            "run `python tests/test_readme.py` to render it again")
    assert marks >= 10  # the front page's excerpts and claims, and the full reference output


def test_the_check_fails_when_a_block_or_a_number_is_edited():
    results, output = committed()
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = BLOCK.search(text)
    body = block["body"]
    digit = next(i for i, c in enumerate(body) if c.isdigit() and i > body.index("\n"))
    edited = body[:digit] + str((int(body[digit]) + 1) % 10) + body[digit + 1:]
    assert stale(text.replace(body, edited, 1), results, output)
    value = VALUE.search(text)
    wrong = text[:value.start()] + "9" + text[value.start():]  # 3.93 -> 93.93
    assert stale(wrong, results, output)
    assert not stale(refreshed(wrong, results, output), results, output)


def test_the_rendering_is_what_a_run_prints(tiny_args, capsys):
    """sample_output, applied to a run's results, gives that run's stdout line for line."""
    results = S.main(tiny_args + ["--experiments", "ABCD", "--engine-requests", "8",
                                  "--no-figures"])
    printed = capsys.readouterr().out.rstrip("\n").split("\n")
    assert printed[-1].startswith("wrote ")
    saved = json.loads((pathlib.Path(tiny_args[-1]) / "results.json").read_text())
    assert sample_output(saved).rstrip("\n") == "\n".join(printed[:-1]).rstrip("\n")
    assert results["environment"]["date"] == saved["environment"]["date"]


def test_ci_runs_the_quick_start_in_its_order_on_a_fresh_clone():
    """.ci/run runs the README's run command, then its test command, on a clone with no
    ../shared beside it (a new reader's first steps), before the test command here."""
    quick = re.search(r"## Quick start\n.*?```\n(?P<run>[^\n]+)\n(?P<test>[^\n]+)\n```",
                      (ROOT / "README.md").read_text(encoding="utf-8"), re.S)
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    fresh = [line for line in ci.split("\n") if '"$fresh"' in line and "python" in line]
    assert len(fresh) == 2, fresh
    assert quick["run"] in fresh[0] and quick["test"] in fresh[1]
    assert ci.rstrip().split("\n")[-1] == quick["test"]


def test_a_run_into_the_reference_folder_leaves_the_reference(tmp_path, capsys):
    (tmp_path / "reference.json").write_bytes(RESULTS.read_bytes())
    S.main(["--experiments", "C", "--requests", "60", "--slots", "4", "--out", str(tmp_path)])
    assert (tmp_path / "reference.json").read_bytes() == RESULTS.read_bytes()
    assert (tmp_path / "results.json").exists() and (tmp_path / "occupancy.png").exists()


def test_results_that_cannot_fill_a_mark_write_nothing(tmp_path):
    """A run whose results lack a value the READMEs quote (its probe chose float32, so no
    bfloat16 timing) is refused in one line, the reference and every README as they were."""
    results = json.loads(RESULTS.read_text(encoding="utf-8"))
    results["environment"]["dtype_probe"]["vs_float32"]["bfloat16"] = None
    candidate = tmp_path / "results.json"
    candidate.write_text(json.dumps(results), encoding="utf-8")
    reference = tmp_path / "reference.json"
    reference.write_bytes(RESULTS.read_bytes())
    readme = tmp_path / "README.md"
    readme.write_bytes((ROOT / "README.md").read_bytes())
    with pytest.raises(LookupError, match="README.md: no value for the mark environment."
                                          "dtype_probe.vs_float32.bfloat16"):
        render_again(candidate, reference, [readme])
    assert reference.read_bytes() == RESULTS.read_bytes()
    assert readme.read_bytes() == (ROOT / "README.md").read_bytes()
    assert render_again(reference, reference, [readme]) == []  # (the reference: as it is)


if __name__ == "__main__":  # render every README's marks again from the reference, or from
    # a run's results.json, which then becomes the reference
    source = sys.argv[1] if len(sys.argv) > 1 else RESULTS
    try:
        for path in render_again(source):
            print(f"rendered {path.relative_to(ROOT)} again from figures/reference.json")
    except (OSError, ValueError, LookupError) as e:
        sys.exit(f"tests/test_readme.py: {source}: {e}; nothing written")


def documented_suite():
    """The suite's count and time as README.md and tests/README.md state them, each once:
    [(passed, skipped and expected to fail, time)] from each."""
    found = []
    for path in (ROOT / "README.md", ROOT / "tests" / "README.md"):
        text = " ".join(path.read_text(encoding="utf-8").split())
        hits = re.findall(r"([\d,]+) passed, ([\d,]+) skipped(?:,| and) ([\d,]+) expected to "
                          r"fail", text)
        times = re.findall(r"(\d+ min \d+ s)", text)
        assert len(hits) == 1, (path.name, hits)
        passed, skipped, failing = (int(n.replace(",", "")) for n in hits[0])
        found.append((passed, skipped + failing, times[0] if times else None))
    return found


def test_the_suites_count_is_said_once_and_is_the_suites_own():
    (readme_pass, readme_skip, readme_time), (tests_pass, tests_skip, tests_time) = \
        documented_suite()
    assert (readme_pass, readme_skip, readme_time) == (tests_pass, tests_skip, tests_time)
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                           "-p", "no:cacheprovider"], cwd=ROOT, capture_output=True, text=True)
    collected = int(re.search(r"(\d+) tests? collected", done.stdout).group(1))
    assert collected == readme_pass + readme_skip, (collected, readme_pass, readme_skip)
