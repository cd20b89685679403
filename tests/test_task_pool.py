"""ringpack._spawn.run_tasks: every result home, a task's exception as raised, a dead worker as one line."""

from __future__ import annotations

import os
import signal

import pytest

from ringpack._spawn import WorkerDied, run_tasks


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
