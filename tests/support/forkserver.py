"""Service processes forked from one that has already imported hookline: one fork server per pytest
process, started on first use.

``hookline <service>`` spends about a second of CPU importing its libraries before it does anything,
and the suite starts some two hundred services: on this two-core machine that was a third of the CPU
of a run, and most of every system's start. A forked child runs what the console script runs
(``hookline.cli.main.main([service])``) with its own environment, log file and pid: it is signalled,
killed and reads its settings as a process started from the shell. It is the fork server's child, not
the test's, so its exit status comes back through the server.

``HOOKLINE_TEST_FORK=0`` starts every service with ``hookline <service>`` instead.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

# What the server imports once, so that its children need not (each service's wiring module).
PRELOADED = (
    "hookline.cli.main",
    "hookline.ingest.service",
    "hookline.dispatcher.service",
    "hookline.health_monitor.service",
    "hookline.outbox_relay.service",
)


def enabled() -> bool:
    return os.environ.get("HOOKLINE_TEST_FORK", "1") != "0"


class ForkedProcess:
    """The part of :class:`subprocess.Popen` the tests use, for a child of the fork server."""

    def __init__(self, server: _Client, pid: int) -> None:
        self._server = server
        self.pid = pid

    @property
    def returncode(self) -> int | None:
        return self._server.exit_code(self.pid)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        code = self._server.wait_exit(self.pid, timeout)
        if code is None:
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0)
        return code

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            # Reaped by the server with its exit code still on the way: as Popen, a no-op.
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _Client:
    """The test process's end: requests out on the server's stdin, pids and exit codes back."""

    def __init__(self) -> None:
        self._server = subprocess.Popen(
            [sys.executable, __file__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])},
        )
        assert self._server.stdin is not None
        assert self._server.stdout is not None
        self._requests: IO[bytes] = self._server.stdin
        self._answers: IO[bytes] = self._server.stdout
        self._lock = threading.Lock()  # one request and its answer at a time
        self._exited: dict[int, int] = {}
        self._changed = threading.Condition()
        self._started: list[int] = []
        self._reader = threading.Thread(target=self._read, name="forkserver-reader", daemon=True)
        self._reader.start()

    def start(self, argv: list[str], env: Mapping[str, str], log_path: Path) -> ForkedProcess:
        request = {"argv": argv, "env": dict(env), "log": str(log_path), "cwd": str(Path.cwd())}
        with self._lock, self._changed:
            before = len(self._started)
            self._requests.write(json.dumps(request).encode() + b"\n")
            self._requests.flush()
            if not self._changed.wait_for(lambda: len(self._started) > before, timeout=60):
                raise RuntimeError("the fork server did not answer")
            return ForkedProcess(self, self._started[before])

    def exit_code(self, pid: int) -> int | None:
        with self._changed:
            return self._exited.get(pid)

    def wait_exit(self, pid: int, timeout: float | None) -> int | None:
        with self._changed:
            self._changed.wait_for(lambda: pid in self._exited, timeout=timeout)
            return self._exited.get(pid)

    def _read(self) -> None:
        for line in self._answers:
            answer: dict[str, Any] = json.loads(line)
            with self._changed:
                if "started" in answer:
                    self._started.append(int(answer["started"]))
                else:
                    self._exited[int(answer["exited"])] = int(answer["code"])
                self._changed.notify_all()


_client: _Client | None = None
_client_lock = threading.Lock()


def start(argv: list[str], env: Mapping[str, str], log_path: Path) -> ForkedProcess:
    """``hookline ARGV`` forked from this pytest process's server, its output appended to ``log_path``."""
    global _client
    with _client_lock:
        if _client is None:
            _client = _Client()
    return _client.start(argv, env, log_path)


# The server's side. Single-threaded on purpose: a thread running at a fork could leave a lock (the
# stdout buffer's, the import lock) held forever in the child.


def _serve() -> None:
    for module in PRELOADED:
        __import__(module)
    assert threading.active_count() == 1, f"an import started a thread: {threading.enumerate()}"
    requests = sys.stdin.buffer
    answers = sys.stdout.buffer
    pending = b""
    while True:
        readable, _, _ = select.select([requests], [], [], 0.05)
        if readable:
            chunk = os.read(requests.fileno(), 65536)
            if not chunk:
                return  # the pytest process is gone: its services were stopped or will be orphans
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                pid = _fork(json.loads(line))
                answers.write(json.dumps({"started": pid}).encode() + b"\n")
                answers.flush()
        _reap(answers)


def _reap(answers: IO[bytes]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        code = os.waitstatus_to_exitcode(status)  # -N for a signal N, as Popen.returncode
        answers.write(json.dumps({"exited": pid, "code": code}).encode() + b"\n")
        answers.flush()


def _fork(request: dict[str, Any]) -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        sys.argv = [str(Path(sys.executable).with_name("hookline")), *request["argv"]]
        from hookline.cli.main import main

        try:
            main(request["argv"])
            code = 0
        except SystemExit as done:
            code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        # What the interpreter does at exit, then out without returning into the server's loop.
        import atexit

        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    raise AssertionError("unreachable")


if __name__ == "__main__":
    _serve()
