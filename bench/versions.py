"""Another commit's hookline, to measure beside this one in the same run (``bench.run --before REF``):
its files taken from git (``git archive``) into ``bench/.versions/<commit>/`` and installed there into
a venv of its own, once; later runs reuse it."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VERSIONS = ROOT / "bench" / ".versions"


def commit_of(ref: str) -> str:
    done = subprocess.run(
        ["git", "rev-parse", "--verify", f"{ref}^{{commit}}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.strip()


def hookline_of(ref: str) -> str:
    """The ``hookline`` command of commit ``ref``, installed if it is not yet."""
    commit = commit_of(ref)
    home = VERSIONS / commit[:12]
    command = home / ".venv" / "bin" / "hookline"
    if command.exists():
        return str(command)
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir(parents=True)
    with tempfile.TemporaryFile() as archive:
        subprocess.run(["git", "archive", commit], cwd=ROOT, stdout=archive, check=True)
        archive.seek(0)
        with tarfile.open(fileobj=archive) as tar:
            tar.extractall(home, filter="data")
    print(f"installing {commit[:12]} into {home} …", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(home / ".venv")], check=True)
    pip = [str(home / ".venv" / "bin" / "python"), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, "-c", str(home / "constraints.txt"), str(home)], check=True)
    return str(command)
