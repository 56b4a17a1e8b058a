"""benchmarks/report.py: the committed result pages are exactly what the generator writes from the committed JSON
(so a page cannot drift from its results), their links resolve, and the helpers mark checkpoints and format
numbers as the pages say."""

import importlib.util
import json
import os
import re
import shutil

import pytest

from braid.results import unclean

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = os.path.join(ROOT, "docs", "results")
ALLOWED_OUTSIDE = {"../calibration.md", "../streaming.md", "../operations.md", "../bring-your-own-model.md"}


def _load():
    spec = importlib.util.spec_from_file_location("report", os.path.join(ROOT, "benchmarks", "report.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


report = _load()


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    """The pages the generator writes now, into a temporary folder: (folder, {name: content})."""
    out = tmp_path_factory.mktemp("results-pages")
    r = report.Report()
    pages = r.pages()
    report.write(pages, str(out))
    return str(out), pages, r


def test_committed_pages_equal_what_the_generator_writes(generated):
    out, pages, _ = generated
    stale = report.differing(pages, DOCS)
    assert not stale, f"stale result pages (run `python benchmarks/report.py`): {stale}"
    assert sorted(n for n in os.listdir(DOCS) if n.endswith(".md")) == sorted(n for n in pages if n.endswith(".md"))


def test_check_names_a_page_that_differs(generated, capsys):
    out, pages, _ = generated
    assert report.differing(pages, out) == []
    with open(os.path.join(out, "engine.md"), "a") as f:
        f.write("a hand-typed line\n")
    assert report.differing(pages, out) == [os.path.relpath(os.path.join(out, "engine.md"), ROOT)]
    report.write(pages, out)


def test_the_pages_links_resolve(generated):
    """Relative links only, among the result pages (their anchors included), to the docs pages named in the brief,
    to the plots the benchmarks wrote (served at plots/) and to the plot the generator draws."""
    out, pages, _ = generated
    anchors = {name: {report.slug(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}
               for name, text in pages.items() if name.endswith(".md")}
    bad = []
    for name, text in pages.items():
        if not name.endswith(".md"):
            continue
        for target in re.findall(r"\]\(([^)]+)\)", text):
            page, _, anchor = target.partition("#")
            if target.startswith("plots/"):
                ok = os.path.exists(os.path.join(ROOT, "benchmarks", "results", target.removeprefix("plots/")))
            elif page in anchors:
                ok = not anchor or anchor in anchors[page]
            else:
                ok = target in ALLOWED_OUTSIDE or target in pages
            if not ok:
                bad.append(f"{name}: {target}")
    assert not bad, bad


def test_every_results_file_is_covered_or_listed(generated):
    _, pages, r = generated
    index = pages["index.md"]
    for name in r.files():
        stem, ext = os.path.splitext(name)
        assert (ext == ".json" and stem in r.used) or f"`{name}`" in index, name


def test_the_headline_table_links_into_the_pages(generated):
    _, pages, r = generated
    headline = report.headline_table(r)
    assert headline.startswith("| result | value | commit (clean tree) | measured | more |")
    assert "](docs/results/engine.md#" in headline
    assert report.headline_table(r, base="") in pages["index.md"]


def headline_parts(headline: str) -> tuple[str, str]:
    """(the headline's table, the list of rows it holds back)."""
    table, _, held = headline.partition("Not in the headline until measured again on a clean tree:")
    return table, held


def test_no_headline_row_reads_an_unclean_file(generated):
    """Issue 58: the headline shows figures only from files measured on a clean tree under the stamp contract; every
    other row is listed after it with why (the committed results)."""
    _, _, r = generated
    table, held = headline_parts(report.headline_table(r))
    shown = re.findall(r"`(\w+)\.json`", table)
    assert shown and all(unclean(r.load(name)) is None for name in shown)
    for row in report.headline_rows(r, "docs/results/"):
        why = report.held_back(r, row)
        assert (f"| {row.result} |" in table) == (not why), row.result
        assert all(f"`{name}.json`: {reason}" in held for name, reason in why.items())


def test_the_headline_holds_back_a_dirty_or_backfilled_file(tmp_path):
    """The same on a synthetic case: a headline file's stamp made clean, dirty or backfilled in a copy of the
    results; of two files measuring one thing, the clean one written last is read."""
    results = tmp_path / "results"
    shutil.copytree(report.RESULTS, results, ignore=shutil.ignore_patterns("*.png", "*.log"))
    fuzz = results / "fuzz_cpu.json"
    data = json.loads(fuzz.read_text())
    clean = {"commit": "f" * 40, "dirty": False, "model": "none", "calibration": "none", "device": "cpu",
             "device_name": "cpu", "torch": "2.13.0+cpu", "written": "2099-01-01T00:00:00+00:00"}
    for stamp, reason in [(clean, None), ({**clean, "dirty": True}, "dirty tree at commit fffffff"),
                          ({**clean, "dirty": None, "backfilled": True}, "backfilled stamp")]:
        fuzz.write_text(json.dumps({**data, "stamp": stamp}))
        table, held = headline_parts(report.headline_table(report.Report(results=str(results))))
        row = next(line for line in (table + held).splitlines() if "Fuzzing the API" in line)
        if reason is None:
            assert row.startswith("| Fuzzing the API | **pass** | `fffffff` | `fuzz_cpu.json`: cpu,") and row in table
        else:
            assert row in held and reason in row
    cuda = results / "synthesis_ttft_cuda.json"
    cuda.write_text(json.dumps({**json.loads(cuda.read_text()), "stamp": clean}))
    assert report.Report(results=str(results)).newest_clean(["synthesis_ttft_cuda_h100", "synthesis_ttft_cuda"]) \
        == "synthesis_ttft_cuda"


def test_a_baseline_is_named_by_what_it_is(generated):
    """Issue 58: no page names a revision compared against by a bare hash ("9959479's engine"): every `against` in
    the results is named (BASELINES), and a commit stands only in a column of its own or after "commit"."""
    _, pages, r = generated
    for name in r.files():
        if name.endswith(".json"):
            result = r.load(name.removesuffix(".json"))
            if isinstance(result.get("against"), str):
                assert not report.HEX.match(report.baseline(result)), name
    for name, text in pages.items():
        if name.endswith(".md"):
            bare = re.findall(r"(?:against|@|vs) [0-9a-f]{7}\b|\b[0-9a-f]{7}'s", text)
            assert not bare, (name, bare)


def test_the_summary_plot_is_the_same_bytes_every_time(generated):
    _, pages, r = generated
    again = report.speedup_plot(r)
    assert again == pages[report.PLOT] and again.startswith(b"\x89PNG")


COMMITTED, CALIBRATION = "88fae767c592f2e3fe0e25331a531fb7", "459129168a17c602"


def stamped(**stamp):
    return {"stamp": {"commit": "0123456789abcdef0123456789abcdef01234567", "dirty": False, "model": "unknown",
                      "calibration": "unknown", "device": "cpu", "device_name": "cpu", "torch": "2.13.0+cpu",
                      "written": "2026-11-27T12:00:00+00:00", **stamp}}


@pytest.mark.parametrize("result, mark", [
    (stamped(model=COMMITTED), "committed"),
    (stamped(model="cb233efb1ecce3c32891b117a7b3938b"), "other (fingerprint cb233ef)"),
    (stamped(model="none"), "none"),
    (stamped(), "unknown"),
    ({}, "unknown"),  # a file written before stamps
    ({"fingerprint": COMMITTED}, "committed"),  # no stamp: the file's own fingerprint
    ({**stamped(), "fingerprint": "cb233efb1ecce3c32891b117a7b3938b"}, "other (fingerprint cb233ef)"),
    ({**stamped(model="abcdef0123456789"), "shape": "100m"}, "random weights"),
    ({**stamped(), "config": {"shape": "100m", "checkpoint": None}}, "random weights"),
    ({**stamped(), "model": "random tiny-shape llama"}, "random weights"),
    ({**stamped(model=COMMITTED), "config": {"shape": "100m", "checkpoint": "models/braid-reference"}}, "committed"),
])
def test_checkpoint_marking(result, mark):
    assert report.checkpoint_mark(result, COMMITTED) == mark


@pytest.mark.parametrize("result, mark", [
    (stamped(calibration=CALIBRATION), "committed"),
    (stamped(calibration="0c182e3a00000000"), "other (digest 0c182e3)"),
    (stamped(calibration="none"), "none"),
    (stamped(), "unknown"),
    ({"calibration": "random weights, trained shape"}, "random weights"),
])
def test_calibration_marking(result, mark):
    assert report.calibration_mark(result, CALIBRATION) == mark


def test_provenance_names_the_commit_device_and_what_was_measured():
    line = report.provenance({**stamped(model="cb233efb1ecce3c32891b117a7b3938b", dirty=True,
                                        device="cuda:0", device_name="NVIDIA H200", backfilled=True)}, COMMITTED)
    assert line == ("commit 0123456 with uncommitted changes, NVIDIA H200, torch 2.13.0+cpu, model cb233ef (not the "
                    "committed 88fae76), calibration unknown, written 2026-11-27 (stamped afterwards)")
    # no stamp: what the file itself says
    assert report.provenance({"device": "cpu", "torch": "2.13.0+cpu"}) == (
        "commit unknown, cpu, torch 2.13.0+cpu, model unknown, calibration unknown")


def test_number_formats():
    assert report.pct(29 / 30) == "97" and report.pct(0.982, 1) == "98.2"
    assert report.points(-0.0) == "+0" and report.points(-1 / 30) == "-3" and report.points(0.35) == "+35"
    assert report.pct_ci(0.9667, (0.9, 1.0)) == "97 [90, 100]"
    assert report.pct_ci(0.995, (0.985, 1.0), 1, "%") == "99.5% [98.5, 100.0]"
    assert report.points_ci(-1 / 30, (-0.1, 0.0)) == "-3 [-10, +0]"
    assert report.pvalue(1.862645149230957e-09) == "1.9e-09" and report.pvalue(1.0) == "1"
    assert report.ms(9.21) == "9.2 ms" and report.ms(1093.57) == "1094 ms"
    assert report.times(3.8166) == "3.82x" and report.overhead(0.1733) == "+17%" and report.overhead(-0.014) == "-1%"
    assert report.span([6.5, 37.4], lambda x: report.times(x, 1)) == "6.5x-37.4x"
    assert report.span([0.97, 0.97], report.pct) == "97"
    assert report.span([-0.1, 0.0], report.points, " to ") == "-10 to +0"
    assert report.listing(["a"]) == "a" and report.listing(["a", "b", "c"]) == "a, b and c"
    assert report.count(20816) == "20,816"


def test_tables_escape_pipes_and_slugs_match_mkdocs():
    assert report.table(["a", "b"], [["x|y", "1"]]) == "| a | b |\n|---|---|\n| x\\|y | 1 |"
    assert report.slug("Committed calibration: verification") == "committed-calibration-verification"
    assert report.slug("What MultiQA's branch caches lack: a probe") == "what-multiqas-branch-caches-lack-a-probe"


def test_the_readme_headline_is_what_the_generator_writes(generated):
    """The README's one results table is generated too: a hand edit to it, or a changed result, fails here."""
    _, _, r = generated
    with open(report.README) as f:
        readme = f.read()
    assert readme == report.with_headline(readme, report.headline_table(r)), \
        "the README's headline table is stale (run `python benchmarks/report.py`)"
