"""No tracked file names a path of the machines this project is built and tested on.

Logs, captures and bench results are recorded on a development checkout, a CI clone or the GPU
device; their paths mean nothing to a reader and leak where they ran. Recorded text spells them
as placeholders instead (``<repo>/``, ``<venv>/``, ``<tmp>/``, ``$OUT``; see
tests/fixtures/README.md). Paths quoted from other people's machines (excerpts of public issue
threads) are evidence and are not ours, so they are not matched here.
"""

from __future__ import annotations

import re
import subprocess

from conftest import REPO_ROOT

#: Our machines' trees: the development checkout and its venv, the tool folders beside it,
#: the Python install (pyenv), pytest's and CI's temporary folders, the device's copy of the
#: repository, its venv and its output folder. Spelled so that this file does not match itself.
OURS = re.compile(rb"/work[/](main|\.)|/root/[.]pyenv|/tmp/(pytest-of|ci[0-9])|\.gpu[0-9]+/repo"
                  rb"|/opt/torch[/]|/root/(out)")


def test_no_tracked_file_names_a_path_of_our_machines() -> None:
    """Every file git tracks is free of our machines' absolute paths (line numbers say where)."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO_ROOT, capture_output=True,
                            check=True).stdout
    names = [n for n in listed.decode().split("\0") if n]
    assert len(names) > 100, "git ls-files listed almost nothing: not a checkout?"
    hits = []
    for name in names:
        path = REPO_ROOT / name
        if not path.is_file():
            continue
        for n, line in enumerate(path.read_bytes().splitlines(), 1):
            if match := OURS.search(line):
                hits.append(f"{name}:{n}: {match.group().decode(errors='replace')}")
    assert hits == [], f"{len(hits)} lines name our machines' paths:\n" + "\n".join(hits[:40])
