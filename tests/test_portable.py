"""Records that travel: no committed file under results/ or docs/ names a path of the machine that wrote it, and the
writers of such records (study arms, benchmark JSON / Markdown, report pages, GPU logs) write portable paths
(grail_exp/analysis/portable.py)."""

from __future__ import annotations

import io
import json
import re
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from grail_exp.analysis.portable import main as portable_main
from grail_exp.analysis.portable import portable_path, portable_text

ROOT = Path(__file__).resolve().parent.parent

# An absolute path of a home, temp or work directory where a path starts (not inside a relative path such as
# outputs/tmp/x or a URL such as https://host/home/x): written out here, apart from the code that rewrites them.
MACHINE_PATH = re.compile(
    r"(?<![\w.~<>-])(?:/tmp|/var/tmp|/root|/work|/home/[^/\s]+|/Users/[^/\s]+)(?![\w-])"
    r"|(?<![\w\\])[A-Za-z]:\\{1,2}(?:Users|Temp|Windows|work)\b", re.IGNORECASE)


def _committed(folders=("results", "docs")) -> list[Path]:
    """The tracked files under ``folders`` (every file there when this is not a git checkout, e.g. an sdist)."""
    done = subprocess.run(["git", "ls-files", "-z", *folders], capture_output=True, text=True, cwd=ROOT)
    if done.returncode == 0 and done.stdout:
        return [ROOT / f for f in done.stdout.split("\0") if f]
    return [f for d in folders for f in sorted((ROOT / d).rglob("*")) if f.is_file()]


def machine_paths(files: list[Path]) -> list[str]:
    """``file:line: path`` for every machine path in the text files of ``files`` (binary files are skipped)."""
    found = []
    for f in files:
        raw = f.read_bytes() if f.is_file() else b""
        if b"\0" in raw:
            continue
        text = raw.decode("utf-8", errors="replace")
        for m in MACHINE_PATH.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            found.append(f"{f.relative_to(ROOT) if f.is_relative_to(ROOT) else f}:{line}: {m.group(0)}")
    return found


@pytest.mark.e2e  # asks git which files are committed (a child process); quick: ~1 s
def test_no_committed_file_under_results_or_docs_names_a_machine_path():
    """A record names paths relative to the repository (or a placeholder such as <tmp>), never /root, /home/...,
    /tmp, /work, /Users or C:\\Users of the machine that wrote it."""
    files = _committed()
    assert len(files) > 100, "the scan found almost nothing to scan"
    found = machine_paths(files)
    assert not found, "absolute machine paths in committed records (rewrite with grail_exp.analysis.portable):\n" + \
        "\n".join(found[:40])


def test_the_scan_catches_each_kind_of_machine_path(tmp_path):
    """The scan's pattern, on one line of each kind, and on look-alikes that are not machine paths."""
    bad = ['"run_dir": "/work/wt/study/outputs/x"', "json=/tmp/bench/a.json", "from sqlite:////work/main/mlflow.db",
           "File \"/root/.venv/x.py\"", "HOME=/home/alice/x", "/Users/bob/data", r"C:\Users\carol\run", "in /tmp."]
    fine = ["outputs/tmp/x", "https://host.org/home/x", "<tmp>/bench/a.json", "sqlite:///results/mlflow.db",
            "the temp dir", "/workspace_notes is not ours", "paths.root_dir"]
    (tmp_path / "bad.md").write_text("\n".join(bad))
    (tmp_path / "fine.md").write_text("\n".join(fine))
    assert len(machine_paths([tmp_path / "bad.md"])) == len(bad)
    assert machine_paths([tmp_path / "fine.md"]) == []


def test_portable_path_and_text_by_hand(tmp_path):
    root = tmp_path / "repo"
    (root / "outputs").mkdir(parents=True)
    assert portable_path(root / "outputs" / "run", root) == "outputs/run"
    assert portable_path(root, root) == "."
    assert portable_path("outputs/run", root) == "outputs/run"  # relative: as given
    assert portable_path("/home/alice/models/x", root) == "<home>/models/x"
    text = (f"json={root}/results/a.json markdown=/tmp/b/a.md from sqlite:///{root}/results/mlflow.db; "
            f"File \"/opt/venv/lib/python3.12/site-packages/torch/nn.py\"; /root/out/x; /work/notes/y; "
            r"C:\Users\carol\run; /tmp; outputs/tmp/z; https://h.org/home/u")
    assert portable_text(text, root) == (
        "json=results/a.json markdown=<tmp>/b/a.md from sqlite:///results/mlflow.db; "
        "File \"<site-packages>/torch/nn.py\"; <home>/out/x; <work>/notes/y; "
        r"<home>\run; <tmp>; outputs/tmp/z; https://h.org/home/u")
    # another checkout of the project (a worktree) counts as the project
    assert portable_text("/srv/wt/study/outputs/a and /srv/wt/study", root, ("/srv/wt/study",)) == "outputs/a and ."


def test_the_filter_rewrites_a_log_line_by_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO(f"run directory: {tmp_path}/outputs/r\npolicy /tmp/c/m: 1 M\n"))
    portable_main(["--root", str(tmp_path)])
    assert capsys.readouterr().out == "run directory: outputs/r\npolicy <tmp>/c/m: 1 M\n"


def test_benchmark_records_are_written_portable(tmp_path, monkeypatch):
    """bench's json= and markdown= files: the command line's absolute paths relative to the project (the working
    directory) or with their head named."""
    from grail_exp.bench.real import write_outputs

    monkeypatch.chdir(tmp_path)
    bench = SimpleNamespace(json=str(tmp_path / "out" / "b.json"), markdown=str(tmp_path / "out" / "b.md"))
    payload = {"command": f"python -m grail_exp.bench model.name_or_path=/tmp/smollm2_hf json={bench.json}",
               "model_dir": str(tmp_path / "models" / "m")}
    write_outputs(bench, payload, "load: 1.0", "| table |")
    written = json.loads(Path(bench.json).read_text())
    assert written["command"] == "python -m grail_exp.bench model.name_or_path=<tmp>/smollm2_hf json=out/b.json"
    assert written["model_dir"] == "models/m"
    assert Path(bench.markdown).read_text().splitlines()[0] == f"`{written['command']}`"


def test_a_study_arm_records_its_model_directory_portable_and_is_still_skipped(tmp_path):
    """identity(): a configuration value that is an absolute path is recorded as it travels, and the skip check
    compares like with like (the same job finds its own record)."""
    from grail_exp.analysis.study import arm_dir, finished, identity
    from helpers.compose import compose

    cfg = compose(["model.name_or_path=/tmp/models/smollm2_hf", f"study.dir={tmp_path}/study"], tmp_path)
    ident = identity(cfg)
    assert ident["model.name_or_path"] == "<tmp>/models/smollm2_hf"
    folder = arm_dir(cfg)
    folder.mkdir(parents=True)
    (folder / "arm.json").write_text(json.dumps({"config": ident, "metrics": {}}))
    assert finished(cfg) is not None
    elsewhere = compose(["model.name_or_path=/tmp/models/other", f"study.dir={tmp_path}/study"], tmp_path)
    with pytest.raises(Exception, match=r"model.name_or_path: '<tmp>/models/smollm2_hf' vs '<tmp>/models/other'"):
        finished(elsewhere)


def test_a_recorded_path_inside_the_code_checkout_is_relative_and_opens_again(tmp_path, monkeypatch):
    """The shipped tiny model's directory lies in the code's checkout, not under paths.root_dir: recorded relative to
    the checkout, and resolve_recorded opens it again from any working directory."""
    from grail_exp.analysis.portable import resolve_recorded
    from grail_exp.analysis.study import identity
    from helpers.compose import compose

    tiny = ROOT / "grail_exp" / "data" / "embedded" / "tiny"
    recorded = identity(compose([f"model.name_or_path={tiny}"], tmp_path))["model.name_or_path"]
    assert recorded == "grail_exp/data/embedded/tiny"
    monkeypatch.chdir(tmp_path)
    assert Path(resolve_recorded(recorded)) == tiny
    assert resolve_recorded("<tmp>/smollm2_hf") == "<tmp>/smollm2_hf" and resolve_recorded("pkg:smollm2") == "pkg:smollm2"
