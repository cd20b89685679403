"""CLI test helpers: run the CLI in process, judge how it ended, build small inputs."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ringpack.cli import main
from ringpack.cost import CostModel
from ringpack.shard_plan import Plan, PlanConfig

#: A small mesh every fixture plan and shard directory uses.
DP, CP, TOKENS = 2, 2, 256
LENGTHS = np.random.default_rng(0).integers(1, 400, size=40)


@dataclass
class CliRun:
    """How one ``ringpack`` command ended: exit code, stdout, stderr."""

    code: int
    out: str
    err: str


def run_cli(argv: list) -> CliRun:
    """``ringpack.cli.main(argv)`` in this process, its output captured; exceptions propagate (a traceback)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in argv])
        except SystemExit as exc:  # argparse: --help, usage errors
            code = exc.code if isinstance(exc.code, int) else 1
    return CliRun(code, out.getvalue(), err.getvalue())


def assert_clean(run: CliRun) -> None:
    """Exit 0, or exit 1 (bad input) / 2 (usage) with exactly one ``ringpack ...: error:`` line, last; no traceback."""
    assert "Traceback" not in run.err, run.err
    assert run.code in (0, 1, 2), (run.code, run.err)
    if run.code:
        lines = [line for line in run.err.splitlines() if line.strip()]
        errors = [line for line in lines if "error:" in line]
        assert len(errors) == 1 and lines[-1] == errors[0], run.err
        assert errors[0].startswith("ringpack") and len(errors[0]) > len("ringpack x: error: ") + 5, run.err


def digests(folder: Path) -> dict[str, str]:
    """sha256 of every file in ``folder`` by name."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def token_rows(n: int = 40, seed: int = 0) -> list[list[int]]:
    """``n`` rows of token ids, 1 to 120 tokens each."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 50_000, size=int(k)).tolist() for k in rng.integers(1, 120, size=n)]


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def small_plan(**options) -> Plan:
    """A plan of :data:`LENGTHS` on the small mesh (20 samples a step); ``options``: more ``PlanConfig`` fields."""
    from ringpack.planner import make_plan

    options = {"samples_per_step": 20, "cost": CostModel.preset("tiny"), **options}
    return make_plan(LENGTHS, PlanConfig(dp=DP, cp=CP, tokens_per_rank=TOKENS, **options))


def lengths_inputs(root: Path) -> dict[str, Path]:
    """Lengths files, good and bad, by name (a good one of every format, then one of each way to be wrong)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root.mkdir(parents=True, exist_ok=True)
    files = {}

    def put(name: str, data: str | bytes) -> None:
        path = root / name
        path.write_bytes(data if isinstance(data, bytes) else data.encode())
        files[name] = path

    np.save(root / "good.npy", LENGTHS)
    files["good.npy"] = root / "good.npy"
    put("good.json", json.dumps(LENGTHS.tolist()))
    put("good.jsonl", "".join(json.dumps({"length": int(n)}) + "\n" for n in LENGTHS))
    pq.write_table(pa.table({"length": LENGTHS}), root / "good.parquet")
    files["good.parquet"] = root / "good.parquet"
    with pa.ipc.new_file(root / "good.arrow", pa.schema([("length", pa.int64())])) as writer:
        writer.write_table(pa.table({"length": LENGTHS}))
    files["good.arrow"] = root / "good.arrow"
    put("empty.npy", b"")
    put("truncated.npy", files["good.npy"].read_bytes()[:100])
    np.save(root / "matrix.npy", np.ones((3, 3), dtype=np.int64))
    files["matrix.npy"] = root / "matrix.npy"
    put("fraction.json", "[1.5, 3]")
    put("zero.json", "[0, 3]")
    put("negative.json", "[-4, 3]")
    put("nan.json", "[1, NaN]")
    put("inf.json", "[1, Infinity]")
    put("huge.json", "[1e30, 2]")
    put("bools.json", "[true, 3]")
    put("strings.json", '["a", 3]')
    put("ragged.json", "[[1, 2], [3]]")
    put("scalar.json", "7")
    put("empty.json", "")
    put("empty_list.json", "[]")
    put("malformed.jsonl", '{"length": 3}\n{"length": \n')
    put("mixed.jsonl", '{"length": 3}\n[4]\n')
    put("missing_key.jsonl", '{"length": 3}\n{"size": 4}\n')
    put("deep.json", "[" * 100_000 + "]" * 100_000)
    put("latin1.json", b"[1, \xff]")
    put("garbage.parquet", b"PAR1 not a parquet file PAR1")
    put("garbage.arrow", b"ARROW1 nope")
    put("unknown.txt", "1 2 3")
    (root / "folder.npy").mkdir(exist_ok=True)
    files["folder.npy"] = root / "folder.npy"
    files["missing.npy"] = root / "missing.npy"
    return files


def cost_profiles(root: Path) -> dict[str, Path]:
    """Cost-model profile files, a good one and one of each way to be wrong."""
    root.mkdir(parents=True, exist_ok=True)
    good = CostModel.from_dict({**CostModel.preset("tiny").to_dict(), "unit": "s", "token": 1e-6, "pair": 1e-9})
    good.save(root / "profile.json")
    texts = {
        "unknown_key.json": json.dumps({**good.to_dict(), "bogus": 1}),
        "missing_key.json": json.dumps({"token": 1.0}),
        "nan.json": '{"token": NaN, "pair": 1.0}',
        "negative.json": '{"token": -1.0, "pair": 1.0}',
        "string.json": '{"token": "1", "pair": 1.0}',
        "list.json": "[1, 2]",
        "malformed.json": "{not json",
        "zero_speed.json": json.dumps({**good.to_dict(), "unit": "flop", "flops_per_second": 0}),
    }
    files = {"profile.json": root / "profile.json"}
    for name, text in texts.items():
        (root / name).write_text(text)
        files[name] = root / name
    return files


def dataset_inputs(root: Path) -> dict[str, Path]:
    """JSON-lines datasets for ``ringpack shard``: good token ids, text, and each way ids can be wrong."""
    root.mkdir(parents=True, exist_ok=True)
    rows = token_rows(24)
    files = {
        "ids.jsonl": write_jsonl(root / "ids.jsonl", [{"input_ids": r} for r in rows]),
        "text.jsonl": write_jsonl(root / "text.jsonl", [{"text": " ".join(map(str, r[:30]))} for r in rows]),
        "big_ids.jsonl": write_jsonl(root / "big_ids.jsonl", [{"input_ids": [5, 2**40, 6]}, {"input_ids": [1, 2]}]),
        "float_ids.jsonl": write_jsonl(root / "float_ids.jsonl", [{"input_ids": [5, 2.5]}, {"input_ids": [1, 2]}]),
        "negative_ids.jsonl": write_jsonl(root / "negative_ids.jsonl", [{"input_ids": [1, 2]}, {"input_ids": [-3]}]),
        "empty_row.jsonl": write_jsonl(root / "empty_row.jsonl", [{"input_ids": [1, 2]}, {"input_ids": []}]),
        "null_row.jsonl": write_jsonl(root / "null_row.jsonl", [{"input_ids": [1, 2]}, {"input_ids": None}]),
        "string_ids.jsonl": write_jsonl(root / "string_ids.jsonl", [{"input_ids": ["a", "b"]}]),
        "scalar_ids.jsonl": write_jsonl(root / "scalar_ids.jsonl", [{"input_ids": 3}, {"input_ids": 4}]),
    }
    (root / "empty.jsonl").write_text("")
    (root / "malformed.jsonl").write_text('{"input_ids": [1, 2]}\n{"input_ids": [\n')
    files["empty.jsonl"], files["malformed.jsonl"] = root / "empty.jsonl", root / "malformed.jsonl"
    return files
