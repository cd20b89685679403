"""Tokens per second of ``ringpack shard``'s engines on one generated corpus, with peak memory (docs/data.md).

    PYTHONPATH=$PWD python benchmarks/shard.py --tokens 20000000 --out shard.json

The corpus: documents of log-normal lengths (median about 1,000 tokens, at most 32,768) as token ids
in Parquet files (8 files, row groups of 256 rows), and as text (words drawn from a Zipf vocabulary)
in JSON-lines files with a byte-level BPE ``tokenizer.json`` trained on it. Cases, each in a fresh
process (so peak memory is its own):

* ``pyarrow``: read the token-id files with pyarrow and write them again (the same writer options as
  the shards): the floor for any engine that reads and rewrites the data;
* ``local``: ``load_source`` (+ ``tokenize_dataset`` for text) and ``write_shards``, as ``ringpack shard``;
* ``ray-1``, ``ray-2``: ``write_shards_ray`` on a local Ray cluster of 1 or 2 CPUs (its start is
  timed apart: a real cluster is running already).

Every case reports seconds, tokens/s, the driver's peak RSS and the largest peak RSS of a Ray
worker (sampled every 50 ms). ``TOKENIZERS_PARALLELISM=false`` everywhere: one tokenizing thread per
process, so workers are what adds cores. Shards: dp=4, cp=2, 16,384 tokens per rank,
``--overflow split``, 256 samples per step, ``--steps-per-file 8``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
CONFIG = dict(dp=4, cp=2, tokens_per_rank=16384, overflow="split", samples_per_step=256, seed=0)
STEPS_PER_FILE = 8
CASES = ("pyarrow", "local", "ray-1", "ray-2")


def make_corpus(work: Path, tokens: int, seed: int = 0) -> dict:
    """Write the token-id and text corpora under ``work``; their paths and sizes."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    lengths = []
    while sum(lengths) < tokens:
        lengths.append(int(np.clip(rng.lognormal(np.log(1000), 1.0), 16, 32768)))
    lengths = np.asarray(lengths)
    ids_dir, text_dir = work / "ids", work / "text"
    ids_dir.mkdir(parents=True)
    text_dir.mkdir()
    words = np.array([f"w{i}" for i in range(20000)])
    zipf = 1.0 / np.arange(1, len(words) + 1)
    zipf /= zipf.sum()
    for k, part in enumerate(np.array_split(np.arange(len(lengths)), 8)):
        rows = [rng.integers(0, 32000, size=lengths[i]).tolist() for i in part]
        pq.write_table(pa.table({"input_ids": rows}), ids_dir / f"part-{k}.parquet", row_group_size=256)
        with open(text_dir / f"part-{k}.jsonl", "w") as f:
            for i in part:
                n = max(1, int(lengths[i] * 0.6))  # a BPE of 8K tokens cuts these words into about 1.6 tokens
                f.write(json.dumps({"text": " ".join(rng.choice(words, size=n, p=zipf))}) + "\n")
    _train_tokenizer(text_dir, work / "tokenizer.json")
    return {"ids": str(ids_dir), "text": str(text_dir), "tokenizer": str(work / "tokenizer.json"), "rows": len(lengths)}


def _train_tokenizer(text_dir: Path, out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    with open(text_dir / "part-0.jsonl") as f:
        lines = [json.loads(line)["text"] for line in f]
    tok.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=8000, show_progress=False))
    tok.save(str(out))


class PeakWorkers:
    """The largest RSS any Ray worker process reached while the block ran (sampled)."""

    def __init__(self) -> None:
        self.peak, self._stop = 0, threading.Event()

    def __enter__(self) -> PeakWorkers:
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        """Every 50 ms the RSS of the workers known; the process table is scanned for new workers
        once a second only (a full scan every 50 ms took a noticeable share of a core from the run)."""
        import psutil

        workers: dict[int, psutil.Process] = {}
        last_scan = 0.0
        while not self._stop.wait(0.05):
            if time.monotonic() - last_scan >= 1.0:
                last_scan = time.monotonic()
                for proc in psutil.process_iter(["name", "cmdline"]):
                    cmd = " ".join(proc.info["cmdline"] or [])
                    if (proc.info["name"] or "").startswith("ray::") or "default_worker.py" in cmd:
                        workers.setdefault(proc.pid, proc)
            for pid, proc in list(workers.items()):
                try:
                    self.peak = max(self.peak, proc.memory_info().rss)
                except psutil.Error:  # ended
                    del workers[pid]


def run_case(case: str, data: str, corpus: dict, work: Path, write_tasks: int | None = None) -> dict:
    """One case in this process: seconds, tokens, peak memory (``write_tasks``: the Ray engine's writing tasks)."""
    from ringpack.data.input_blocks import TokenSpec
    from ringpack.shard_plan import PlanConfig

    text = data == "text"
    source = corpus[data]
    out = work / f"out-{case}-{data}"
    shutil.rmtree(out, ignore_errors=True)
    config = PlanConfig(**CONFIG)
    result: dict = {"case": case, "data": data}
    if case == "pyarrow":
        import pyarrow.json as paj
        import pyarrow.parquet as pq

        start = time.perf_counter()
        files = sorted(Path(source).iterdir())
        options = paj.ReadOptions(block_size=64 << 20)
        tables = [paj.read_json(f, read_options=options) if text else pq.read_table(f) for f in files]
        out.mkdir()
        for k, table in enumerate(tables):
            pq.write_table(table, out / f"{k}.parquet", compression="zstd", compression_level=3, use_dictionary=False)
        tokens = None  # text: counted by the engines' runs (the manifest's num_tokens)
        if not text:
            tokens = sum(int(np.diff(t.column(0).combine_chunks().offsets.to_numpy()).sum()) for t in tables)
        result["seconds"] = time.perf_counter() - start
    elif case == "local":
        import datasets  # noqa: F401  (imported before the clock starts, as ray and pyarrow are)

        from ringpack.data.shard_writer import write_shards
        from ringpack.data.sources import load_source, tokenize_dataset

        start = time.perf_counter()
        ds = load_source(source, cache_dir=str(work / f"hf-{data}"))
        if text:
            ds = tokenize_dataset(ds, "text", corpus["tokenizer"])
        manifest = write_shards(ds, out, config, steps_per_file=STEPS_PER_FILE, progress=False)
        result["seconds"] = time.perf_counter() - start
        tokens = manifest["num_tokens"]
        result["plan_hash"], result["fingerprint"] = manifest["plan_hash"], manifest["dataset_fingerprint"]
    else:
        import ray

        from ringpack.data.ray_shards import RayOptions, write_shards_ray

        start = time.perf_counter()
        ray.init(num_cpus=int(case[-1]), include_dashboard=False, object_store_memory=1 << 30, log_to_driver=False)
        result["cluster_start_s"] = time.perf_counter() - start
        spec = TokenSpec(text_column="text", tokenizer=corpus["tokenizer"]) if text else TokenSpec()
        with PeakWorkers() as workers:
            start = time.perf_counter()
            options = RayOptions(write_tasks=write_tasks)
            manifest = write_shards_ray(
                source, out, config, spec=spec, steps_per_file=STEPS_PER_FILE, progress=False, options=options
            )
            result["seconds"] = time.perf_counter() - start
        ray.shutdown()
        tokens = manifest["num_tokens"]
        result["worker_peak_mib"] = workers.peak / 2**20
        result["plan_hash"], result["fingerprint"] = manifest["plan_hash"], manifest["dataset_fingerprint"]
    result["tokens"] = tokens
    result["tokens_per_s"] = None if tokens is None else tokens / result["seconds"]
    result["driver_peak_mib"] = peak_rss_mib()
    if case != "pyarrow":
        result["files"] = _sha256s(out)
    return result


def peak_rss_mib() -> float:
    """This process's peak resident memory: Linux's ``VmHWM`` (its own address space's, unlike
    ``ru_maxrss``, which a process started by another keeps from the parent's peak at the fork)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _sha256s(folder: Path) -> dict:
    from ringpack._files import file_sha256

    return {p.name: file_sha256(p) for p in sorted(folder.iterdir())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=20_000_000, help="about how many tokens the corpus holds")
    parser.add_argument("--work", default="/tmp/ringpack-shard-bench", help="scratch folder (replaced)")
    parser.add_argument("--data", default="ids,text", help="corpora to run: ids, text")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--write-tasks", type=int, help="the Ray engine's writing tasks (default: two per CPU)")
    parser.add_argument("--out", help="write the results as JSON")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # one case, in a child process
    args = parser.parse_args()
    work = Path(args.work)
    if args.case:
        corpus = json.loads((work / "corpus.json").read_text())
        print(json.dumps(run_case(args.case, args.data, corpus, work, args.write_tasks)))
        return
    shutil.rmtree(work, ignore_errors=True)
    start = time.perf_counter()
    corpus = make_corpus(work, args.tokens)
    (work / "corpus.json").write_text(json.dumps(corpus))
    print(f"corpus: {corpus['rows']:,} documents, made in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    results = []
    for data in args.data.split(","):
        rows = []
        for case in args.cases.split(","):
            argv = [sys.executable, __file__, "--case", case, "--data", data, "--work", str(work)]
            argv += ["--write-tasks", str(args.write_tasks)] if args.write_tasks else []
            child = subprocess.run(argv, capture_output=True, text=True)
            if child.returncode:
                sys.exit(f"{case} on {data} failed:\n{child.stderr[-3000:]}")
            rows.append(json.loads(child.stdout.strip().splitlines()[-1]))
        tokens = next(r["tokens"] for r in rows if r["tokens"] is not None)
        for row in rows:
            row["tokens"] = tokens
            row["tokens_per_s"] = tokens / row["seconds"]
            print(
                f"{data:5} {row['case']:8} {row['seconds']:7.1f} s {row['tokens_per_s'] / 1e6:6.2f} M tokens/s "
                f"driver {row['driver_peak_mib']:6.0f} MiB workers {row.get('worker_peak_mib', 0):6.0f} MiB",
                file=sys.stderr,
            )
        results.extend(rows)
    same = {
        d: len({json.dumps(r["files"]) for r in results if r["data"] == d and "files" in r}) == 1
        for d in args.data.split(",")
    }
    print(f"byte-identical shards across engines: {same}", file=sys.stderr)
    if args.out:
        record = {"config": CONFIG, "write_tasks": args.write_tasks, "results": results, "identical": same}
        Path(args.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
