"""The README and docs/ as a reader uses them: every code block runs as written, is an excerpt of a file
that runs, or says why it is a fragment; printed outputs and value comments are what the code gives.

The markers are described in :mod:`tests.helpers.docs`. Single-process pages run in a subprocess
each; the blocks and files that need a process group run on gloo processes (``slow``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ringpack._spawn import free_port
from tests.helpers.docs import MARKERS, PAGES, ROOT, blocks, excerpt_problem, runnable, value_matches

#: Files the docs quote as excerpts, and how many processes run each (``test_quoted_files_run``).
RUN_FILES = {"examples/minimal_loop.py": 2, "examples/fsdp_mesh.py": 2}  # DP=1 x CP=2: the runs are smoke tests
#: Files whose tests live elsewhere and that the docs may quote too.
TESTED_ELSEWHERE = {
    "examples/train.py": "tests/integrations/test_train_exact.py",
    "examples/train_fsdp.py": "tests/integrations/test_fsdp_ddp_exact.py",
    "examples/sequence_layers.py": "tests/attention/test_sequence_layers.py",
}
ALL_BLOCKS = [b for page in PAGES for b in blocks(page)]


def test_every_python_block_runs_or_says_what_it_is():
    """A python block runs, is an excerpt of a tested file, runs on processes, or is a fragment with a reason."""
    problems = []
    for b in ALL_BLOCKS:
        if b.marker is not None and b.marker not in MARKERS:
            problems.append(f"{b.where}: unknown marker {b.marker!r}")
        if b.lang != "python":
            continue
        if b.marker == "not-run" and not b.arg:
            problems.append(f"{b.where}: not-run needs a reason (<!-- not-run: why -->)")
        if b.marker == "excerpt" and b.arg not in {**RUN_FILES, **TESTED_ELSEWHERE}:
            problems.append(f"{b.where}: excerpt of {b.arg!r}, a file no test runs")
        if b.marker == "run" and not re.fullmatch(r"\d+ processes", b.arg or ""):
            problems.append(f"{b.where}: a python run block says how many processes (<!-- run: 2 processes -->)")
        if b.marker == "output":
            problems.append(f"{b.where}: an output block is plain text, not python")
    assert not problems, "\n".join(problems)
    assert sum(b.lang == "python" for b in ALL_BLOCKS) >= 20


def test_excerpts_are_lines_of_their_files():
    problems = [excerpt_problem(b) for b in ALL_BLOCKS if b.marker == "excerpt"]
    assert not [p for p in problems if p], "\n".join(p for p in problems if p)
    assert sum(b.marker == "excerpt" for b in ALL_BLOCKS) >= 4


def test_output_blocks_follow_a_run_block():
    for page in PAGES:
        previous = None
        for b in blocks(page):
            if b.marker == "output":
                assert previous is not None and previous.marker == "run" and previous.lang == "bash", b.where
            previous = b


def test_an_excerpt_that_drifts_from_its_file_is_caught(tmp_path):
    from tests.helpers.docs import Block

    drifted = Block(
        ROOT / "README.md", 1, "python", "cp_group = groups[cp_rank]\n", "excerpt", "examples/minimal_loop.py"
    )
    assert "is not a line of examples/minimal_loop.py" in excerpt_problem(drifted)


def test_a_wrong_value_comment_or_output_fails_the_page(tmp_path, monkeypatch):
    from tests.helpers.docs import run_page

    monkeypatch.chdir(tmp_path)  # run_page works in the folder it is given; the test's folder comes back
    page = tmp_path / "page.md"
    page.write_text("```python\nx = 2\nx + 1  # 3: the sum\nx * 2  # 5\n```\n")
    with pytest.raises(AssertionError, match=r"page.md:4: the comment says '5', the code gives 4"):
        run_page(page, tmp_path)
    page.write_text("<!-- run -->\n```bash\necho one; echo two\n```\n\n<!-- output -->\n```\none\nthree\n```\n")
    with pytest.raises(AssertionError, match=r"page.md:9: the page says 'three', the command prints 'two'"):
        run_page(page, tmp_path)
    page.write_text("<!-- run -->\n```bash\necho a; echo b; echo c\n```\n\n<!-- output -->\n```\na\n...\n```\n")
    assert run_page(page, tmp_path) == 2  # "..." alone: any lines


def test_value_comments_match_with_ellipses():
    assert value_matches("5396 = sum(length - 1)", 5396)
    assert value_matches("(2, 3, 0, 1): the canonical order", (2, 3, 0, 1))
    assert value_matches("Plan(dp=1, ..., hash=...)", "Plan(dp=1, cp=2, hash=3fb3)")
    assert not value_matches("2641 on rank 0", 2705)
    assert not value_matches("(2, 3, 0, 1): x", (2, 3, 1, 0))


@pytest.mark.slow
@pytest.mark.parametrize("page", [p for p in PAGES if runnable(p)], ids=lambda p: str(p.relative_to(ROOT)))
def test_page_code_runs_as_written(page):
    """The page's python blocks and run blocks, in order, in a scratch folder; outputs and values checked."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MPLBACKEND": "Agg", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "tests.helpers.docs", str(page)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.startswith("ok ")


def test_attention_doc_states_the_token_counts_of_its_plan():
    """docs/attention.md's two-process block names each rank's tokens; the plan it makes has those."""
    import ringpack

    block = next(b for b in blocks(ROOT / "docs" / "attention.md") if b.marker == "run")
    call = re.search(r"ringpack\.plan\(.*\)", block.code).group(0)
    counts = re.search(r"this rank's tokens: (\d+) on rank 0, (\d+) on rank 1", block.code).groups()
    microbatch = eval(call, {"ringpack": ringpack}).steps[0].microbatches[0][0]
    assert [ringpack.compile_schedule(microbatch, r).num_tokens for r in (0, 1)] == [int(c) for c in counts]


def test_readme_numbers_are_the_ones_its_commands_print():
    """The introduction quotes the gaps the §1 output block shows (which test_page_code_runs_as_written checks)."""
    readme = (ROOT / "README.md").read_text()
    output = next(b for b in blocks(ROOT / "README.md") if b.marker == "output").code
    gaps = re.findall(r"gap to lower bound: median ([\d.]+%), worst ([\d.]+%)", output)
    assert len(gaps) == 2
    (ours, our_worst), (theirs, their_worst) = gaps
    intro = readme.split("## Quick start")[0]
    assert f"{ours} above\nthe bound ({our_worst} on the worst step) against {theirs} ({their_worst})" in intro


def test_readme_says_how_to_run_the_cli_after_make():
    quick_start = (ROOT / "README.md").read_text().split("## Quick start")[1].split("## Usage")[0]
    assert "source .venv/bin/activate" in quick_start and ".venv/bin/ringpack" in quick_start


def launch(script: Path, world: int, folder: Path, timeout_s: float = 280.0) -> list[str]:
    """Run ``script`` on ``world`` processes as ``torchrun`` would (its environment variables); their outputs."""
    port = free_port()
    procs, logs = [], []
    for rank in range(world):
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            "CUDA_VISIBLE_DEVICES": "",
        }
        log = open(folder / f"rank{rank}.log", "w+")  # noqa: SIM115 (closed below)
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, str(script)], cwd=folder, env=env, stdout=log, stderr=log))
    deadline = time.monotonic() + timeout_s
    try:
        for proc in procs:
            proc.wait(timeout=max(deadline - time.monotonic(), 1.0))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    failed = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode != 0]
    assert not failed, f"{script.name}: ranks {failed} failed:\n" + "\n".join(o[-2000:] for o in outputs)
    return outputs


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(RUN_FILES))
def test_quoted_files_run(name, tmp_path):
    """The files the docs quote run as their docstrings say (gloo on CPU), one loss line per planned step."""
    out = launch(ROOT / name, RUN_FILES[name], tmp_path)
    losses = [float(x) for x in re.findall(r"^step \d+: loss ([\d.]+)$", out[0], re.M)]
    assert len(losses) >= 3 and all(0 < x < 10 for x in losses), out[0][-2000:]


@pytest.mark.slow
def test_multiprocess_blocks_run(tmp_path):
    """Python blocks marked ``run: N processes`` run as a program on N gloo processes."""
    marked = [b for b in ALL_BLOCKS if b.lang == "python" and b.marker == "run"]
    assert marked
    for k, block in enumerate(marked):
        script = tmp_path / f"block{k}.py"
        script.write_text(block.code)
        launch(script, int(block.arg.split()[0]), tmp_path)
