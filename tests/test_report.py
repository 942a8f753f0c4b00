"""benchmarks/report.py on the committed GPU results; CPU only, no vLLM.

Run: python -m pytest tests/test_report.py -q
Covers: "x plain" divides only by the plain record of the same run, commit, GPU and engine
settings, and is blank, with the reason, where that run has none; benchmarks/README.md's generated
block and benchmarks/results/README-table.md are what report.py makes of
benchmarks/results/h200.json (regenerate them after adding records); the README block is
replaced, not appended to; records older than the status field and files_ready_s render as before.
"""

from __future__ import annotations

import os

import pytest
import records as bench_records  # benchmarks/ (pytest's pythonpath, pyproject.toml)
import report

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "benchmarks", "results", "h200.json")


@pytest.fixture(scope="module")
def records():
    return report.load([RESULTS])


def test_plain_of_the_same_run(records):
    ours = [r for r in records if r["variant"] == "ours" and r.get("run") == "run13d"]
    assert ours and ours[0]["write_target"] == "disk"
    plain = report.plain_for(ours[0], records)
    assert plain["run"] == "run13d" and plain["variant"] == "plain"
    # An older record keeps its own run's plain, not the newest one.
    old = next(r for r in records if r["variant"] == "ours" and r.get("run") == "run8")
    assert report.plain_for(old, records)["run"] == "run8"


def test_versions_are_paired_and_cut_runs_are_not_faults(records):
    # Ours on 0.26.0 divides by plain 0.26.0 of its own run (run 17), and never by another
    # run's: run 22 measured no plain, so its ratio is blank (run 21's plain is not used).
    ours26 = [r for r in records if r["variant"] == "ours" and r["versions"]["vllm"] == "0.26.0"]
    assert {r["run"] for r in ours26} >= {"run17", "run22"}
    ours17 = next(r for r in ours26 if r["run"] == "run17" and bench_records.ok(r))
    assert report.plain_for(ours17, records)["versions"]["vllm"] == "0.26.0"
    ours22 = next(r for r in ours26 if r["run"] == "run22" and r["workload"] == "32x8192")
    assert report.pair(ours22, records) == (None, "run run22 has no plain record")
    # A plain record of the same run but of the other release is never the divisor.
    other = {**ours22, "variant": "plain", "versions": {"vllm": "0.20.1"}}
    assert report.pair(ours22, [*records, other]) == (
        None,
        "run run22's plain differs in vLLM version",
    )
    # A variant the --budget cut off is reported as cut, a crash as failed.
    cut = next(r for r in ours26 if r["run"] == "run18")
    assert report.note(cut).endswith("timed out after 210 s (--timeout/--budget)")
    assert report.note(next(r for r in ours26 if r["run"] == "run20")).endswith(
        "cut off by --budget after 310 s (not a fault: time ran out)"
    )
    assert "failed: Boom" in report.note({**cut, "error": "Boom", "error_summary": None})
    hang = {**cut, "error": "timed out after 540 s (--timeout)", "error_summary": None}
    assert "failed: timed out" in report.note(hang)


def test_a_profiled_record_says_so(records):
    # Run 31's ours ran with py-spy attached: its row says so; plain of that run does not.
    run31 = {r["variant"]: r for r in records if r.get("run") == "run31"}
    assert "profiled (py-spy" in report.note(run31["ours"])
    assert "profiled" not in report.note(run31["plain"])


def test_a_busy_gpu_is_named(records):
    # Run 38's engines started with 43,515 MiB held by a test server left running.
    run38 = [r for r in records if r.get("run") == "run38"]
    assert run38 and all("held by another process" in report.note(r) for r in run38)
    run36 = [r for r in records if r.get("run") == "run36"]
    assert run36 and not any("held by another process" in report.note(r) for r in run36)


def test_generated_files_are_current(records):
    rows = report.select(records)
    with open(os.path.join(REPO, "benchmarks", "README.md")) as f:
        readme = f.read()
    block = readme.split(report.README_BEGIN, 1)[1].split(report.README_END, 1)[0]
    expected = report.readme_block(rows, records)
    assert block.strip() == expected.strip(), "run python benchmarks/report.py --readme"
    with open(os.path.join(REPO, "benchmarks", "results", "README-table.md")) as f:
        table = f.read()
    assert table.strip() == report.markdown(rows, records, "h200.json").strip()


def test_splice_replaces_the_block(tmp_path):
    path = tmp_path / "README.md"
    path.write_text(f"a\n{report.README_BEGIN}\nold\n{report.README_END}\nb\n")
    report.splice_readme(str(path), "new")
    report.splice_readme(str(path), "newer")
    assert path.read_text() == f"a\n{report.README_BEGIN}\nnewer\n{report.README_END}\nb\n"
    bare = tmp_path / "bare.md"
    bare.write_text("no block")
    with pytest.raises(SystemExit, match=r"no .* block"):
        report.splice_readme(str(bare), "x")


def test_old_statuses_and_drain_key_render_as_new_ones(records):
    """Records written before the status field and files_ready_s (drain_s then) render as the
    same records in the new form."""
    old_ok = next(r for r in records if r.get("run") == "run17" and r["variant"] == "ours")
    assert "drain_s" in old_ok and "status" not in old_ok
    new_ok = {k: v for k, v in old_ok.items() if k != "drain_s"}
    new_ok.update(status="ok", files_ready_s=old_ok["drain_s"])
    assert report.row(old_ok, records) == report.row(new_ok, records)
    assert f"| {old_ok['drain_s']:.2f} |" in report.row(old_ok, records)
    assert bench_records.files_ready_s(old_ok) == old_ok["drain_s"]
    old = {
        "skipped: vllm-gdn-hs is not installed": "skipped",
        "cut off by --budget after 310 s (not a fault: time ran out)": "cut",
        "timed out after 210 s (--timeout/--budget)": "cut",  # run 18: the two not told apart
        "timed out after 540 s (--timeout)": "timed_out",
        "worker exited with status 1": "failed",
    }
    base = {k: v for k, v in old_ok.items() if k not in ("gen_s", "drain_s")}
    for text, status in old.items():
        r_old = {**base, "error": text, "error_summary": text}
        r_new = {**base, "error": text, "error_summary": text, "status": status, "note": text}
        assert bench_records.status(r_old) == status, text
        assert not report.ok(r_old)
        assert report.note(r_old) == report.note(r_new), text
        assert report.row(r_old, records) == report.row(r_new, records), text
        failed = status in ("timed_out", "failed")
        assert report.note(r_old).endswith(("failed: " if failed else "") + text)


def test_a_ratio_never_crosses_runs(records):
    """The ratio rule on made-up records: the plain record must be of the same run, commit,
    GPU and engine settings (GDN backend, batch sizes, ...); else the ratio is blank and the
    row and the summary say why. No timing is asserted, only which record divides which."""
    base = next(r for r in records if r.get("run") == "run39" and r["variant"] == "plain")
    default = {**bench_records.record_settings(base), "gdn_backend": "default"}
    plain = {**base, "run": "r48", "commit": "abc1234", "settings": default}
    ours = {**plain, "variant": "ours", "gen_s": base["gen_s"] * 1.01}
    assert report.plain_for(ours, [plain, ours]) is plain
    assert report.pair({**ours, "run": None}, [plain])[0] is None
    cases = {
        "run run49 has no plain record": {"run": "run49"},
        "run r48's plain differs in commit": {"commit": "def5678"},
        "run r48's plain differs in GPU": {"gpu": "NVIDIA H100 80GB HBM3"},
        "run r48's plain differs in settings": {"settings": {**default, "max_num_seqs": 256}},
    }
    for why, change in cases.items():
        other = {**ours, **change}
        assert report.pair(other, [plain, other]) == (None, why), why
        assert f"x plain blank: {why}" in report.row(other, [plain, other])
        assert f"n/a ({why})" in report.summary(report.select([plain, other]), [plain, other])
    # A newer plain of another run, same everything else, is still not the divisor.
    newer = {**plain, "run": "r49", "date": "2027-01-01T00:00:00+00:00"}
    assert report.plain_for(ours, [plain, newer, ours]) is plain
    # Two backends in one run: each divides by plain of its own backend.
    tri = {**plain, "settings": {**default, "gdn_backend": "triton"}}
    ours_tri = {**tri, "variant": "ours"}
    assert report.plain_for(ours_tri, [plain, tri, ours, ours_tri]) is tri
    assert report.plain_for(ours, [plain, tri, ours, ours_tri]) is plain


def test_memory_table_counts_each_figure_in_kv_blocks_against_plain_of_its_run():
    """vLLM's memory lines per variant, each against the plain record of the same run and GPU,
    in KV cache blocks (the figures of the 2026-12 H100 check at 27B shape)."""
    common = dict(run="r", gpu="H100", kv_block_gib=0.05)
    records = [
        dict(common, variant="plain", peak_activation_gib=2.10, cudagraph_gib=1.33,
             warmup_transient_kept_gib=3.24, kv_cache_blocks=422, kv_cache_tokens=298916),
        dict(common, variant="ours", peak_activation_gib=2.88, cudagraph_gib=2.15,
             warmup_transient_kept_gib=4.30, kv_cache_blocks=374, kv_cache_tokens=264916),
        dict(common, variant="ours", run="other"),  # no memory lines: not a row
    ]  # fmt: skip
    lines = report.memory_table(records).splitlines()
    assert len(lines) == 4
    assert lines[2] == (
        "| r | H100 | ours | 2.88 (+15.6 blocks) | 2.15 (+16.4 blocks) | 4.30 (+21.2 blocks) "
        "| 374 (88.6%) | 264,916 |"
    )
    assert lines[3].startswith("| r | H100 | plain | 2.10 | 1.33 | 3.24 | 422 |")
