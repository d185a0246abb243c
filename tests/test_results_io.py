"""bench/results_io.py: every bench writes its raw results the same way, the figures with
where, from which commit and by which command they were measured."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys

from bench import results_io


def test_a_result_is_written_with_its_provenance(tmp_path):
    path = tmp_path / "deep" / "result.json"
    results_io.save(path, {"rows": [{"ms": 1.5}], "odd": {1, 2}})
    written = json.loads(path.read_text())
    assert written["rows"] == [{"ms": 1.5}]
    assert written["odd"] == "{1, 2}"  # a value JSON cannot hold is kept as its text
    run = written["provenance"]
    git = subprocess.run(["git", "-C", str(results_io.REPO), "rev-parse", "HEAD"],
                         capture_output=True, text=True)
    assert run["commit"] == (git.stdout.strip() if git.returncode == 0 else None)
    assert shlex.split(run["command"])[1:] == sys.argv
    assert run["machine"] and run["cpus"] >= 1


def test_no_path_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    results_io.save(None, {"x": 1})
    assert list(tmp_path.iterdir()) == []
