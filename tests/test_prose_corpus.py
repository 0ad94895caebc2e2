"""The prose corpus builder (tools/build_prose_corpus.py and tools/prose_corpus/) on small
synthetic inputs: markup is stripped, non-prose and duplicates are removed, the same packages
give the same digest, the output is what lrattn-preprocess reads, and bad flags are one-line
errors. Also the study's prose, learning-rate sweep and per-arm learning-rate knobs
(tools/gpu_box/run.sh) and its report (tools/study_report.py), with downstream evaluations."""
from __future__ import annotations

import gzip
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "build_prose_corpus.py"

sys.path.insert(0, str(ROOT / "tools"))
import study_report as report  # noqa: E402
from build_prose_corpus import build, fetch  # noqa: E402
from prose_corpus.clean import clean_documents, normalise, paragraph_verdict  # noqa: E402
from prose_corpus.convert import (BuildError, html_paragraphs, info_paragraphs,  # noqa: E402
                                  pod_paragraphs, roff_paragraphs)
from prose_corpus.sources import SOURCES, Source  # noqa: E402

PROSE = ("The package manager keeps a list of the available packages and fetches each one "
         "from the archive when it is needed. It checks every file against the signed index, "
         "so a corrupted download is refused before anything is installed.")
PROSE2 = ("A manual page describes one command or one function. Its sections follow a fixed "
          "order, and the description explains in full sentences what the program does and "
          "which files it reads when it starts.")
PROSE4 = ("Each chapter ends with a short summary. The summary repeats the commands that were "
          "introduced, says when to use each of them, and points to the page that explains "
          "the options in more detail.")
PROSE5 = ("A program that runs for a long time should write its progress to the terminal, so "
          "that the person who started it can tell whether it is still working or has stopped "
          "on an error.")
PROSE6 = ("The archive keeps older releases for a while. When a release is retired, its packages "
          "move to a separate server, where they stay available for anyone who still needs to "
          "rebuild an old system.")
PROSE3 = ("Nothing in this chapter depends on the previous one. The reader who knows the shell "
          "may skip ahead, while a newcomer should try each example in a terminal and compare "
          "the output with the text.")


def test_roff_is_stripped_and_no_fill_blocks_dropped():
    page = "\n".join([
        '.\\" a comment', ".TH LS 1 2024", ".SH NAME", "ls \\- list directory contents",
        ".SH DESCRIPTION", ".B ls", "lists the files of a folder in \\fBalphabetical\\fR order,",
        "one \\(em or more \\(lqper line\\(rq.", ".PP", ".nf", "int main(void) { return 0; }",
        ".fi", ".TS", "tab(;); l l.", "a;b", ".TE", "Another paragraph\\-with a dash."])
    paras = roff_paragraphs(page)
    joined = "\n".join(paras)
    assert "ls lists the files of a folder in alphabetical order, one \u2014 or more " \
           "\u201cper line\u201d." in paras
    assert "Another paragraph-with a dash." in paras
    for leftover in ("\\f", ".TH", "comment", "int main", "tab(;)", "a;b"):
        assert leftover not in joined
    assert roff_paragraphs(".so man1/other.1\n") == []


def test_html_keeps_prose_and_drops_code_tables_and_navigation():
    page = f"""<html class="sidebar-visible"><head><title>T</title></head><body>
    <nav>Home | Next | Prev</nav><div class="sphinxsidebar"><p>{PROSE2}</p></div>
    <h1>Title<a class="headerlink" href="#">\u00b6</a></h1><p>{PROSE}</p>
    <pre>for x in range(10): print(x)</pre><div class="highlight-python"><pre>a = 1</pre></div>
    <table><tr><td>cell one</td></tr></table><ul><li>{PROSE3}</li></ul></body></html>"""
    paras = [normalise(p) for p in html_paragraphs(page)]
    paras = [p for p in paras if p]
    assert paras == ["Title", PROSE, PROSE3]


def test_pod_and_info_keep_text_and_drop_code():
    pod = ("=head1 NAME\n\nperlfoo - a page\n\n=head1 DESCRIPTION\n\nUse C<print> and "
           "L<the manual|perlfunc> with E<lt>angle E<gt> brackets.\n\n    my $x = 1;\n\n"
           "=begin html\n\n<p>raw</p>\n\n=end html\n\n=cut\n\nsub code { 1 }\n")
    assert pod_paragraphs(pod) == [
        "NAME", "perlfoo - a page", "DESCRIPTION",
        "Use print and the manual with <angle > brackets."]
    info = ("\x1f\nFile: r.info, Node: Intro, Next: Two\n\n1 Intro\n*******\n\n"
            f"{PROSE}\n\n     x <- c(1, 2)\n     y <- x\n\n* Menu:\n\n* Two::  the next\n"
            "\x1f\nTag Table:\nNode: Intro\x7f1\n")
    assert info_paragraphs(info) == ["1 Intro", PROSE]


@pytest.mark.parametrize("text, verdict", [
    (PROSE, None),
    ("The APT and DPKG tools install packages from the Debian archive.", None),
    ("Installation", "too_short"),
    ("for (int i = 0; i < n; ++i) { sum += a[i]; } return sum; // $x @y", "code_symbols"),
    ("0x1f 0x2e 0x3d 0x4c 0x5b 0x6a 0x79 0x88 0x97 0xa6 stop.", "not_words"),
    ("the option that sets the size of the buffer used for reading", "no_sentence"),
    ("WARNING THIS PROGRAM DELETES ALL THE FILES IN THE FOLDER NOW.", "upper_case"),
])
def test_paragraph_rules(text, verdict):
    assert paragraph_verdict(text) == verdict


def test_boilerplate_duplicates_and_short_documents_are_removed():
    licence = ("This page is part of the documentation project and may be copied under the "
               "terms of its licence, which is shipped with every copy.")
    docs = [
        ("a", "one.html", [PROSE, PROSE2, PROSE3, PROSE4, licence]),
        ("a", "two.html", [PROSE2, PROSE, PROSE3, licence]),            # contained in one
        ("a", "three.html", [PROSE, PROSE2, PROSE3, PROSE4, licence]),  # exact duplicate
        ("b", "five.html", [PROSE5, PROSE4 + " " + PROSE, licence]),    # two thirds shared
        ("b", "short.html", [PROSE5, licence]),                        # too short
    ]
    counts = Counter()
    kept = clean_documents(docs, counts)
    assert [(s, p) for s, p, _ in kept] == [("a", "one.html"), ("b", "five.html")]
    assert counts["exact_duplicate"] == 1
    assert counts["boilerplate_paragraphs"] == 4      # the licence, in four distinct documents
    assert counts["too_short"] == 1 and counts["near_duplicate"] == 1
    assert kept[0][2] == "\n\n".join([PROSE, PROSE2, PROSE3, PROSE4])


def _ar(members: dict[str, bytes]) -> bytes:
    out = [b"!<arch>\n"]
    for name, body in members.items():
        head = f"{name + '/':<16}{0:<12}{0:<6}{0:<6}{100644:<8}{len(body):<10}`\n"
        out += [head.encode(), body, b"\n" if len(body) % 2 else b""]
    return b"".join(out)


def _fixture_deb(path: Path) -> None:
    files = {
        "usr/share/doc/demo/html/a.html": f"<html><body><p>{PROSE}</p><p>{PROSE2}</p>"
                                          f"<p>{PROSE3}</p><pre>x = 1</pre></body></html>",
        "usr/share/doc/demo/html/b.html": f"<html><body><p>{PROSE3}</p><p>{PROSE}</p>"
                                          f"<p>{PROSE2}</p></body></html>",
        "usr/share/doc/demo/html/genindex.html": f"<p>{PROSE}</p>",
        "usr/share/man/man1/demo.1.gz": gzip.compress(
            f".TH DEMO 1\n.SH DESCRIPTION\n\\fBdemo\\fR {PROSE4}\n.PP\n{PROSE5}\n.PP\n{PROSE6}\n"
            .encode(),
            mtime=0),
    }
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:xz") as tar:
        for name, body in sorted(files.items()):
            data = body.encode() if isinstance(body, str) else body
            info = tarfile.TarInfo("./" + name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    path.write_bytes(_ar({"debian-binary": b"2.0\n", "data.tar.xz": buf.getvalue()}))


DEMO = Source("demo", "1:1.0-1", None, "public domain",
              (("usr/share/doc/demo/html/*.html", "html"), ("usr/share/man/man*.gz", "roff")),
              ("*/genindex.html",))


def test_same_package_same_digest_and_preprocess_reads_it(tmp_path):
    debs = tmp_path / "debs"
    debs.mkdir()
    _fixture_deb(debs / "demo_1%3a1.0-1_all.deb")
    first = build([DEMO], debs, tmp_path / "one", download=False)
    second = build([DEMO], debs, tmp_path / "two", download=False)
    assert first == second
    out = first["output"]
    assert out["documents"] == 2 and first["filters"]["documents"]["near_duplicate"] == 1
    assert first["sources"]["demo"]["files_read"] == 3
    rows = [json.loads(line) for line in (tmp_path / "one" / "prose.jsonl").open()]
    html, man = (r["path"] for r in rows)      # a.html and b.html: one near-duplicate kept
    assert html.endswith(("/a.html", "/b.html")) and man == "usr/share/man/man1/demo.1.gz"
    assert rows[1]["text"].startswith("demo " + PROSE4[:20])
    assert all(set(r) == {"text", "source", "path"} for r in rows)
    assert (tmp_path / "one" / "prose.jsonl.gz").read_bytes() == \
        (tmp_path / "two" / "prose.jsonl.gz").read_bytes()

    from megatron_lrattn.data.preprocess import preprocess
    from megatron_lrattn.data.tokenizer import train_bpe_tokenizer

    train_bpe_tokenizer([r["text"] for r in rows], tmp_path / "tok", 300)
    stats = preprocess(tmp_path / "one" / "prose.jsonl.gz", tmp_path / "ds", tmp_path / "tok")
    assert stats.documents == 2 and stats.tokens > 100


def test_pinned_digest_is_checked(tmp_path):
    _fixture_deb(tmp_path / "demo_1.0-1_all.deb")
    pinned = Source("demo", "1:1.0-1", "0" * 64, "x", DEMO.include)
    with pytest.raises(BuildError, match="differs from the pinned"):
        fetch(pinned, tmp_path, download=False)


def _cli(*args, cwd=ROOT):
    return subprocess.run([sys.executable, str(TOOL), *args], cwd=cwd, capture_output=True,
                          text=True, timeout=60)


@pytest.mark.parametrize("args, message", [
    (["--vocab-size", "-3"], "must be >= 0"),
    (["--vocab-size", "lots"], "expected an integer"),
    (["--vocab-size", "100"], "--vocab-size must be 0 or >= 258"),
    (["--jobs", "0"], "--jobs must be >= 1"),
    (["--sources", "nonesuch,maint-guide"], "unknown source(s) nonesuch"),
    (["--sources", ","], "unknown source(s) (none given)"),
    (["--no-download", "--debs", "/nonexistent/debs"], "is not a folder"),
    (["--no-download", "--sources", "maint-guide", "--debs", "{tmp}"], "no maint-guide"),
    (["--out", "{file}"], "is not a folder"),
])
def test_cli_bad_flags_are_one_line_errors(tmp_path, args, message):
    (tmp_path / "file").write_text("x")
    args = [a.format(tmp=tmp_path, file=tmp_path / "file") for a in args]
    proc = _cli(*args, "--out" if "--out" not in args else "--no-progress",
                *([str(tmp_path / "out")] if "--out" not in args else []))
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("build_prose_corpus: error: ") and message in last, last


def test_list_names_every_source_with_version_and_licence():
    proc = _cli("--list")
    assert proc.returncode == 0
    lines = proc.stdout.splitlines()
    assert len(lines) == len(SOURCES) and "maint-guide=1.2.53\tGPL-2+" in lines


def _start_sh(out, **env):
    full = dict(os.environ, NO_WHEEL="1", OUT=str(out), GIT_SHA="test", **env)
    return subprocess.Popen(["bash", str(ROOT / "tools" / "gpu_box" / "run.sh"), "study"],
                            cwd=ROOT, env=full, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _finish_sh(proc):
    try:
        stdout, stderr = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def _run_sh(tmp_path, **env):
    return _finish_sh(_start_sh(tmp_path / "out", **env))


def test_study_refuses_a_missing_prose_folder_and_an_unknown_arm(tmp_path):
    # side by side, each with its own $OUT (each run.sh spends seconds importing torch)
    missing = _start_sh(tmp_path / "out_missing", CORPUS="prose",
                        PROSE_DIR=str(tmp_path / "none"))
    bogus = _start_sh(tmp_path / "out_bogus", CORPUS="prose", ARMS="standard bogus")
    proc = _finish_sh(missing)
    assert proc.returncode == 2
    assert "needs prose.jsonl.gz, tokenizer/ and manifest.json" in proc.stdout
    proc = _finish_sh(bogus)
    assert proc.returncode == 2 and "unknown arm bogus" in proc.stdout


def test_study_report_reads_a_learning_rate_sweep(tmp_path):
    for arm, losses in {"standard": {"1e-3": 3.1, "2e-3": 3.0, "4e-3": 3.2},
                        "lr_sliced": {"1e-3": 2.9, "2e-3": 2.95, "4e-3": 3.3}}.items():
        for lr, loss in losses.items():
            rows = [{"type": "train", "iteration": 10, "loss": loss + 0.1, "consumed_samples": 8},
                    {"type": "valid", "iteration": 10, "loss": loss}]
            (tmp_path / f"{arm}_lr{lr}_seed1.jsonl").write_text(
                "".join(json.dumps(r) + "\n" for r in rows))
    summary = report.summarise(report.load_runs(tmp_path))
    assert summary["sweep"]["standard"]["best_lr"] == "2e-3"
    assert summary["sweep"]["lr_sliced"]["best_lr"] == "1e-3"
    assert list(summary["arms"])[:3] == ["standard_lr1e-3", "standard_lr2e-3", "standard_lr4e-3"]
    table = report.sweep_table(summary)
    assert "| standard residual | 3.1000 | **3.0000** | 3.2000 | 2e-3 |" in table


def test_study_report_writes_every_step_as_csv(tmp_path):
    import csv

    rows = [{"type": "run", "git_sha": "abc"}, {"type": "valid", "iteration": 0, "loss": 8.4},
            {"type": "train", "iteration": 1, "loss": 8.45, "grad_norm": 7.0, "lr": 2e-5,
             "step_time_s": 4.6, "consumed_samples": 8},
            {"type": "train", "iteration": 2, "loss": 8.1, "grad_norm": 6.0, "lr": 2.5e-4,
             "step_time_s": 0.2, "consumed_samples": 16},
            {"type": "valid", "iteration": 2, "loss": 8.0}]
    for name in ("lr_sliced_seed2", "standard_seed1"):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert report.main([str(tmp_path), "--out", str(tmp_path / "out")]) == 0
    with open(tmp_path / "out" / "study_steps.csv") as f:
        got = list(csv.DictReader(f))
    assert [(r["arm"], r["seed"], r["type"], r["iteration"]) for r in got] == [
        (arm, seed, t, i) for arm, seed in (("standard", "1"), ("lr_sliced", "2"))
        for t, i in (("valid", "0"), ("train", "1"), ("train", "2"), ("valid", "2"))]
    assert {r["lr"] for r in got} == {"2.5e-4"}
    assert got[1]["loss"] == "8.45000" and got[1]["grad_norm"] == "7.0000"
    assert got[0]["grad_norm"] == "" and got[2]["step_time_s"] == "0.2000"


# each case is one run.sh call (2 s: its provenance header imports torch); one in the fast tier
_SLOW = pytest.mark.slow


@pytest.mark.parametrize("env, message", [
    pytest.param({"LRS": "1e-3", "ARM_LRS": "standard=1e-3"}, "set LRS (a sweep) or ARM_LRS",
                 marks=_SLOW),
    pytest.param({"ARMS": "standard attnres", "ARM_LRS": "standard=1e-3"},
                 "has no LR for arm attnres", marks=_SLOW),
    pytest.param({"ARMS": "standard", "ARM_LRS": "standard=1e-3 bogus=2e-3"},
                 "ARM_LRS names unknown arm bogus", marks=_SLOW),
    ({"ARMS": "standard", "ARM_LRS": "standard"}, "ARM_LRS entry 'standard' is not arm=LR"),
    pytest.param({"ARMS": "standard", "ARM_LRS": "standard=fast"},
                 "ARM_LRS entry 'standard=fast' is not arm=LR", marks=_SLOW),
    pytest.param({"ARMS": "standard", "LRS": "1e-3 standard=fast"},
                 "LRS entry 'standard=fast' is not LR or arm=LR", marks=_SLOW),
    pytest.param({"ARMS": "standard lr_sliced", "LRS": "1e-3 attnres=2e-3"},
                 "LRS entry 'attnres=2e-3' names arm attnres, which is not in ARMS",
                 marks=_SLOW),
    pytest.param({"PRESET": "study-1t"}, "unknown PRESET study-1t (one of ['0.5b',", marks=_SLOW),
])
def test_study_refuses_bad_per_arm_learning_rates(tmp_path, env, message):
    proc = _run_sh(tmp_path, CORPUS="prose", PROSE_DIR=str(tmp_path / "none"), **env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("study:")]
    assert len(lines) == 1 and message in lines[0], proc.stdout
    # refused before the corpus: nothing was preprocessed or trained
    assert "needs prose.jsonl.gz" not in proc.stdout and "lrattn-preprocess" not in proc.stdout


def _eval_json(bpb, last_word, next_line, next_line_norm):
    return {"model": "/tmp/study/hf_x", "model_type": "lrattn", "settings": {"limit": 500},
            "tasks": {"heldout": {"bits_per_byte": bpb, "perplexity": 9.0, "tokens": 100},
                      "last_word": {"items": 500, "acc": last_word, "acc_stderr": 0.02},
                      "next_line": {"items": 500, "choices": 4, "acc": next_line,
                                    "acc_stderr": 0.02, "acc_norm": next_line_norm,
                                    "acc_norm_stderr": 0.02}},
            "seconds": 1.0}


def _seed_runs(folder, losses):
    for name, loss in losses.items():
        rows = [{"type": "train", "iteration": 10, "loss": loss + 0.1, "consumed_samples": 8},
                {"type": "valid", "iteration": 10, "loss": loss}]
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_study_report_adds_downstream_columns_from_eval_files(tmp_path):
    losses = {"standard_seed1": 3.0, "standard_seed2": 3.2,
              "lr_sliced_seed1": 2.8, "lr_sliced_seed2": 2.9}
    plain, evald = tmp_path / "plain", tmp_path / "evald"
    for folder in (plain, evald):
        folder.mkdir()
        _seed_runs(folder, losses)
    for name, vals in {"standard_seed1": (1.2, 0.30, 0.50, 0.40),
                       "standard_seed2": (1.4, 0.34, 0.54, 0.44),
                       "lr_sliced_seed1": (1.0, 0.40, 0.60, 0.58)}.items():
        (evald / f"{name}_eval.json").write_text(json.dumps(_eval_json(*vals)))

    # without eval files: the table and JSON as before
    summary = report.summarise(report.load_runs(plain), report.load_evals(plain))
    assert report.load_evals(plain) == {}
    assert all("downstream" not in a for a in summary["arms"].values())
    assert report.table(summary).splitlines()[0] == "| arm | mean | sd | seed 1 | seed 2 |"
    assert report.table(summary) == report.table(report.summarise(report.load_runs(plain)))

    assert report.main([str(evald), "--out", str(tmp_path / "out")]) == 0
    summary = json.loads((tmp_path / "out" / "study.json").read_text())
    std = summary["arms"]["standard"]["downstream"]
    assert set(std) == {"heldout_bpb", "last_word_acc", "next_line_acc", "next_line_acc_norm"}
    assert std["heldout_bpb"]["per_seed"] == {"1": 1.2, "2": 1.4}
    assert std["heldout_bpb"]["mean"] == pytest.approx(1.3)
    assert std["last_word_acc"]["sd"] == pytest.approx(0.04 / 2 ** 0.5)
    sliced = summary["arms"]["lr_sliced"]["downstream"]
    assert sliced["next_line_acc_norm"]["n"] == 1 and sliced["next_line_acc_norm"]["sd"] is None
    lines = (tmp_path / "out" / "study_table.md").read_text().splitlines()
    assert lines[0] == ("| arm | mean | sd | seed 1 | seed 2 | held-out bits/byte | "
                        "last_word acc | next_line acc | next_line acc_norm |")
    assert lines[1] == "|---" * 9 + "|"
    assert lines[2] == ("| standard residual | 3.1000 | 0.1414 | 3.0000 | 3.2000 | "
                        "1.3000 ± 0.1414 | 0.3200 ± 0.0283 | 0.5200 ± 0.0283 | "
                        "0.4200 ± 0.0283 |")
    assert lines[3].endswith("| 1.0000 | 0.4000 | 0.6000 | 0.5800 |")


def test_study_report_welch_t_matches_the_formula_and_lists_the_papers_pairs(tmp_path):
    a, b = [1.0, 1.2, 1.1], [2.0, 2.4]
    se = (statistics.variance(a) / 3 + statistics.variance(b) / 2) ** 0.5
    assert report.welch_t(a, b) == pytest.approx((1.1 - 2.2) / se)
    assert report.welch_t([1.0], b) is None and report.welch_t([1.0, 1.0], [2.0, 2.0]) is None
    arms = {name: {"mean": statistics.fmean(v), "label": name,
                   "final_valid_loss": dict(enumerate(v, 1))}
            for name, v in (("standard", b), ("lr_sliced", a))}
    rows = report.comparisons(arms)
    assert [(r["a"], r["b"]) for r in rows] == [("lr_sliced", "standard")]
    assert rows[0]["diff"] == pytest.approx(-1.1) and rows[0]["n_a"] == 3
    assert "Welch t" in report.comparison_table({"arms": arms, "comparisons": rows})


def test_fetch_of_a_version_newer_than_the_package_lists_says_to_update_them(tmp_path,
                                                                               monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    apt = bin_dir / "apt-get"
    apt.write_text("#!/bin/sh\necho \"E: Version '$2' was not found\" >&2\nexit 100\n")
    apt.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    source = SOURCES[0]
    with pytest.raises(BuildError) as err:
        fetch(source, tmp_path / "debs", download=True)
    message = str(err.value)
    assert "\n" not in message and "run apt-get update first" in message
    assert f"{source.package}={source.version}" in message
