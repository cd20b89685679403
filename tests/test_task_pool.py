"""ringpack._spawn.run_tasks: every result home, a task's exception as raised, a dead worker as one line."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time

import pytest

from ringpack._spawn import STALL_ENV, STALL_S, WorkerDied, WorkerStalled, run_tasks, stall_seconds


def square(x: int) -> int:
    return x * x


def fail_on_three(x: int) -> int:
    if x == 3:
        raise KeyError("three is refused")
    return x


def killed_on_two(x: int) -> int:
    if x == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    return x


def exits_on_one(x: int) -> int:
    if x == 1:
        os._exit(3)
    return x


def test_run_tasks_in_process_keeps_order():
    got = []
    run_tasks(square, [3, 1, 2], 1, lambda i, r: got.append((i, r)))
    assert got == [(0, 9), (1, 1), (2, 4)]


@pytest.mark.slow
def test_run_tasks_hands_every_result_home():
    got = {}
    run_tasks(square, list(range(9)), 3, got.__setitem__)
    assert got == {i: i * i for i in range(9)}


@pytest.mark.slow
def test_a_task_error_is_raised_as_it_is():
    with pytest.raises(KeyError, match="three is refused"):
        run_tasks(fail_on_three, [1, 2, 3, 4], 2, lambda i, r: None)


@pytest.mark.slow
@pytest.mark.parametrize(
    "fn, task, how",
    [
        (killed_on_two, 2, "was killed by SIGKILL (most often the system running out of memory)"),
        (exits_on_one, 1, "exited with code 3"),
    ],
)
def test_a_dead_worker_is_one_line_naming_its_task(fn, task, how):
    with pytest.raises(WorkerDied) as info:
        run_tasks(
            fn,
            [0, 1, 2, 3],
            2,
            lambda i, r: None,
            describe=lambda t: f"squaring {t}",
            hint="run with fewer jobs",
            name="test worker",
        )
    text = str(info.value)
    assert "\n" not in text
    assert text.startswith("test worker process ")
    assert f"{how} while squaring {task}; run with fewer jobs" in text
    assert isinstance(info.value, OSError)  # the command line prints it as one line


def stop_on_one(x: int) -> int:
    if x == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(0.05)
    return x


def _gone(pid: int) -> bool:
    """Whether ``pid`` has exited (a zombie waiting for a reaper counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except OSError:
        return True


@pytest.mark.slow
def test_a_stopped_worker_is_named_within_the_stall_limit():
    t0 = time.monotonic()
    with pytest.raises(WorkerStalled) as info:
        run_tasks(stop_on_one, [0, 1, 2, 3], 2, lambda i, r: None, describe=lambda t: f"task {t}", stall_s=3.0)
    assert time.monotonic() - t0 < 15
    text = str(info.value)
    assert "\n" not in text
    assert "sent no heartbeat for 3 s (it is stopped: SIGSTOP or a debugger) while task 1" in text
    assert STALL_ENV in text
    assert isinstance(info.value, WorkerDied) and isinstance(info.value, TimeoutError)
    assert not multiprocessing.active_children()  # the stopped worker was killed and reaped


@pytest.mark.slow
def test_the_stall_limit_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv(STALL_ENV, "2.5")
    with pytest.raises(WorkerStalled, match="no heartbeat for 2.5 s"):
        run_tasks(stop_on_one, [1, 0], 2, lambda i, r: None)


@pytest.mark.slow
def test_slow_tasks_beat_the_stall_limit():
    got = {}
    run_tasks(slow_square, [1, 2], 2, got.__setitem__, stall_s=3.0)  # each task outlasts the limit, beating
    assert got == {0: 1, 1: 4}


def slow_square(x: int) -> int:
    time.sleep(4.5)
    return x * x


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "soon"])
def test_a_bad_stall_limit_is_refused_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv(STALL_ENV, value)
    with pytest.raises(ValueError, match=f"^{STALL_ENV}="):
        stall_seconds()
    monkeypatch.delenv(STALL_ENV)
    assert stall_seconds() == STALL_S and stall_seconds(2) == 2.0


SLEEPY_PARENT = """
import os, sys, time
from ringpack._spawn import run_tasks

def sleepy(x):
    os.write(1, b"%d\\n" % os.getpid())  # one write: the two workers' lines never interleave
    time.sleep(60)
    return x

if __name__ == "__main__":
    run_tasks(sleepy, [0, 1], 2, lambda i, r: None)
"""


@pytest.mark.slow
@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL])
def test_workers_end_with_their_parent(tmp_path, how):
    script = tmp_path / "parent.py"
    script.write_text(SLEEPY_PARENT)
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        workers = [int(parent.stdout.readline()) for _ in range(2)]
        parent.send_signal(how)
        parent.wait(10)
        deadline = time.monotonic() + 5
        while not all(_gone(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(_gone(pid) for pid in workers), f"workers {workers} outlived their parent"
    finally:
        parent.kill()
        parent.wait()
