"""Public loaders and entry points meet bad input with a documented exception that names the problem."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest

from ringpack.analysis.report import render_markdown
from ringpack.analysis.simulate import simulate, synthetic_lengths
from ringpack.cost import CostModel
from ringpack.errors import DataError, PlanError
from ringpack.lengths import check_lengths, lengths_from_file, read_lengths
from ringpack.shard_plan import Plan, PlanConfig
from tests.helpers.cli import LENGTHS, assert_clean, cost_profiles, lengths_inputs, run_cli, small_plan


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("loaders")
    return {"lengths": lengths_inputs(root / "lengths"), "profiles": cost_profiles(root / "profiles"), "root": root}


def test_every_bad_lengths_file_is_a_data_error_naming_it(files):
    for name, path in files["lengths"].items():
        if name.startswith("good"):
            assert (lengths_from_file(path) == LENGTHS).all()
            continue
        if name == "missing.npy":
            with pytest.raises(FileNotFoundError):
                read_lengths(path)
            continue
        if name == "empty_list.json":  # no samples is a valid answer here; the commands refuse it
            assert lengths_from_file(path).size == 0
            continue
        with pytest.raises(DataError) as info:
            lengths_from_file(path)
        assert path.name in str(info.value), (name, str(info.value))
        assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("values", "sample"),
    [([3, float("nan")], 1), ([1, 2, 2.5], 2), ([1, 0], 1), ([5, -2], 1), ([2.0**70, 1], 0), ([True, 2], 0)],
)
def test_check_lengths_names_the_sample(values, sample):
    with pytest.raises(DataError, match=f"sample {sample}"):
        check_lengths(values)


def test_cost_profiles(files):
    for name, path in files["profiles"].items():
        if name == "profile.json":
            assert CostModel.load(path).unit == "s"
            continue
        with pytest.raises(ValueError, match=re.escape(str(path))):
            CostModel.load(path)
    for bad in ({"token": 1.0, "pair": math.inf}, {"token": -1.0, "pair": 1.0}, {"token": 1.0, "pair": 1.0, "x": 2}):
        with pytest.raises(ValueError):
            CostModel.from_dict(bad)
    with pytest.raises(ValueError, match="flops_per_second"):
        CostModel(token=1.0, pair=1.0, flops_per_second=float("nan"))


@pytest.mark.parametrize(
    "fields",
    [
        {"dp": True},
        {"cp": 2.0},
        {"tokens_per_rank": "64"},
        {"solver_time_limit_s": float("nan")},
        {"solver_time_limit_s": "1"},
        {"cp_token_slack": float("inf")},
        {"cp_token_slack": True},
        {"seed": -1},
        {"cost": {"token": 1.0, "pair": 1.0}},
    ],
)
def test_plan_config_refuses(fields):
    with pytest.raises(PlanError, match=next(iter(fields))):
        PlanConfig(**{"dp": 2, "cp": 2, "tokens_per_rank": 64, **fields})


def test_plan_config_from_dict_names_missing_and_unknown_fields():
    with pytest.raises(PlanError, match="lacks 'tokens_per_rank'"):
        PlanConfig.from_dict({"dp": 1, "cp": 1})
    with pytest.raises(PlanError, match="unknown keys"):
        PlanConfig.from_dict({"dp": 1, "cp": 1, "tokens_per_rank": 8, "colour": "red"})
    with pytest.raises(PlanError, match="config must be an object"):
        PlanConfig.from_dict([1, 2])


def test_plan_load_always_validates(tmp_path):
    """An edited plan with its hash deleted is refused, naming the file; so are a directory and a missing file."""
    plan = small_plan()
    plan.save(tmp_path / "plan.json")
    doc = json.loads((tmp_path / "plan.json").read_text())
    doc["lengths"][0] += 1
    del doc["hash"]
    (tmp_path / "edited.json").write_text(json.dumps(doc))
    with pytest.raises(PlanError, match="edited.json: plan lacks 'hash'"):
        Plan.load(tmp_path / "edited.json")
    (tmp_path / "folder.parquet").mkdir()
    with pytest.raises(PlanError, match="is a directory"):
        Plan.load(tmp_path / "folder.parquet")
    with pytest.raises(FileNotFoundError):
        Plan.load(tmp_path / "missing.parquet")
    assert Plan.load(tmp_path / "plan.json") == plan


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"n": -1}, "samples"),
        ({"n": 2**70}, "samples"),
        ({"n": 5, "median": -1.0, "source": "lognormal"}, "median"),
        ({"n": 5, "median": float("nan"), "source": "lognormal"}, "median"),
        ({"n": 5, "sigma": -0.5, "source": "lognormal"}, "sigma"),
        ({"n": 5, "sigma": 60.0, "source": "lognormal"}, "sigma"),
        ({"n": 5, "max_len": 0}, "max_len"),
        ({"n": 5, "source": "uniform"}, "source"),
    ],
)
def test_synthetic_lengths_refuses(kwargs, match):
    with pytest.raises(ValueError, match=match):
        synthetic_lengths(**kwargs)


def test_synthetic_lengths_follow_the_median():
    lengths = synthetic_lengths(2000, "lognormal", median=300.0, sigma=0.5)
    assert 250 <= np.median(lengths) <= 360 and lengths.min() >= 1


def test_simulate_refuses_bad_arguments():
    config = PlanConfig(dp=2, cp=2, tokens_per_rank=1024, samples_per_step=8)
    for kwargs in ({"chunk_steps": 0}, {"jobs": 0}, {"chunk_steps": 1.5}, {"variants": []}):
        with pytest.raises(ValueError):
            simulate(LENGTHS, config, progress=False, **kwargs)
    for lengths in ([], [3, 0], [1.5, 2]):
        with pytest.raises(ValueError):
            simulate(lengths, config, progress=False)


CRAFTED = "evil\n```\n<script>alert(1)</script>\n`````` [click](http://x) *bold*"


def test_markdown_report_quotes_names_safely(files, tmp_path):
    """A cost model whose name closes a code block and carries HTML stays inside the block, inert."""
    profile = tmp_path / "crafted.json"
    CostModel(token=1e-6, pair=1e-9, unit="s", name=CRAFTED).save(profile)
    out = tmp_path / "report"
    argv = ["report", "--lengths", files["lengths"]["good.npy"], "--dp", "2", "--cp", "2"]
    run = run_cli([*argv, "--tokens-per-rank", "512", "--cost-profile", profile, "--out", out, "--no-plots", "--quiet"])
    assert_clean(run)
    assert run.code == 0
    markdown = (out / "report.md").read_text()
    fence = re.search(r"^(`{3,})$", markdown, re.M).group(1)
    assert len(fence) > max(len(r) for r in re.findall(r"`+", CRAFTED))
    inside = markdown.split(fence + "\n")[1]
    outside = markdown.replace(inside, "")
    assert "<script>" in inside and "<script>" not in outside and "](http" not in outside
    assert "<script>" not in (out / "report.html").read_text()


def test_markdown_escapes_the_title_and_definitions(monkeypatch):
    import ringpack.analysis.report as report

    monkeypatch.setattr(report, "format_table", lambda doc, steps_shown=0: "table")  # only quoted text is tested
    text = render_markdown({"title": "T <b>x</b>\n# y", "definitions": {"a*b": "<i>c</i> [d](e)"}}, {})
    assert text.splitlines()[0] == "# T &lt;b&gt;x&lt;/b&gt; \\# y"
    assert "- **a\\*b**: &lt;i&gt;c&lt;/i&gt; \\[d\\](e)" in text
