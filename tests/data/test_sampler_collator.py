"""BalancedBatchSampler + PackedDataset + PackedCollator: coverage, determinism, resume, workers."""

from __future__ import annotations

import pickle
import warnings

import datasets
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from ringpack.attention import ScheduleOptions, compile_schedule
from ringpack.data import BalancedBatchSampler, DataError, MicroBatchTicket, PackedCollator, PackedDataset
from ringpack.shard_plan import PlanError
from tests.helpers.data import Coverage, batch_signature, random_samples

DP, CP, T = 2, 2, 256


def make(samples, dp_rank=0, cp_rank=0, dp=DP, cp=CP, tokens=T, **kw):
    kw.setdefault("samples_per_step", 40)
    lengths = [len(s) for s in samples]
    sampler = BalancedBatchSampler(lengths, dp_rank=dp_rank, dp_size=dp, cp_size=cp, tokens_per_rank=tokens, **kw)
    return sampler, PackedDataset(samples), PackedCollator(cp_rank, cp, compile_schedules=False)


def collate_all(samples, sampler, dataset, collator, start_state=None):
    if start_state is not None:
        sampler.load_state_dict(start_state)
    return [collator(dataset.__getitems__(ticket)) for ticket in sampler]


@pytest.fixture(scope="module")
def samples():
    return random_samples(160, seed=1)


@pytest.mark.parametrize("strategy", ["balanced", "zigzag", "contiguous"])
def test_every_token_exactly_once_across_ranks(samples, strategy):
    cov = Coverage(samples)
    counts = []
    for d in range(DP):
        for c in range(CP):
            sampler, ds, coll = make(samples, d, c, strategy=strategy)
            batches = collate_all(samples, sampler, ds, coll)
            counts.append(len(batches))
            assert len(batches) == len(sampler)
            cov.add_all(batches)
            for b in batches:
                assert b["microbatch_loss_tokens"] == sum(len(samples[s]) - 1 for s in b["microbatch"].samples)
    assert len(set(counts)) == 1, f"ranks run different numbers of micro-batches: {counts}"
    cov.check_exactly_once()


def test_loss_token_denominators(samples):
    per_step: dict[int, int] = {}
    denominators = {}
    for d in range(DP):
        for c in range(CP):
            sampler, ds, coll = make(samples, d, c)
            for b in collate_all(samples, sampler, ds, coll):
                per_step[b["step"]] = per_step.get(b["step"], 0) + b["num_loss_tokens"]
                denominators.setdefault(b["step"], set()).add(b["step_loss_tokens"])
    for step, total in per_step.items():
        assert denominators[step] == {total}, "step_loss_tokens equals the non-ignored labels of the whole global batch"
    assert sum(per_step.values()) == sum(len(s) - 1 for s in samples)


def test_steps_equal_and_deterministic_per_epoch(samples):
    a, _, _ = make(samples, 0)
    b, _, _ = make(samples, 1)
    assert a.num_steps == b.num_steps > 1 and a.plan_hash == b.plan_hash
    per_step = [np.bincount([t.step for t in s], minlength=a.num_steps) for s in (a, b)]
    assert np.array_equal(per_step[0], per_step[1]), "every DP rank runs the same micro-batches per step"
    first = [list(t) for t in a]
    again, _, _ = make(samples, 0)
    assert [list(t) for t in again] == first, "same (lengths, config, seed, epoch): same micro-batches"
    a.set_epoch(1)
    assert a.plan_hash != again.plan_hash and [list(t) for t in a] != first, "a new epoch reshuffles"
    b.set_epoch(1)
    epoch1 = sorted(x for s in (a, b) for t in s for x in t)
    assert epoch1 == list(range(len(samples))), "every sample once per epoch across DP ranks"


def test_resume_mid_epoch_is_bit_exact(samples):
    sampler, ds, coll = make(samples, 1, 1)
    sampler.set_epoch(3)
    full = [batch_signature(b) for b in collate_all(samples, sampler, ds, coll)]
    for k in (0, 1, len(full) // 2, len(full) - 1, len(full)):
        s1, ds1, c1 = make(samples, 1, 1)
        s1.set_epoch(3)
        it = iter(s1)
        head = [batch_signature(c1(ds1.__getitems__(next(it)))) for _ in range(k)]
        state = s1.state_dict()
        assert state["cursor"] == k and state["epoch"] == 3
        s2, ds2, c2 = make(samples, 1, 1)  # a fresh process
        tail = [batch_signature(b) for b in collate_all(samples, s2, ds2, c2, start_state=state)]
        assert head + tail == full, f"resume after {k} micro-batches"


def test_state_mismatches_are_clear_errors(samples):
    sampler, _, _ = make(samples)
    state = sampler.state_dict()
    other, _, _ = make(samples, dp=4)
    with pytest.raises(DataError, match="dp_size=2"):
        other.load_state_dict(state)
    changed, _, _ = make(samples[:-1])
    with pytest.raises(DataError, match="num_samples"):
        changed.load_state_dict(state)
    edited = [s.copy() for s in samples]
    edited[0] = np.concatenate([edited[0], [1]])
    changed, _, _ = make(edited)
    with pytest.raises(DataError, match="for other lengths"):
        changed.load_state_dict(state)
    with pytest.raises(DataError, match="cursor"):
        sampler.load_state_dict({**state, "cursor": 10**6})
    # any DP rank's state resumes any DP rank (cursors are equal in lockstep)
    rank1, _, _ = make(samples, dp_rank=1)
    rank1.load_state_dict(state)


def test_dataloader_with_workers_and_cursor_resume(samples):
    sampler, ds, coll = make(samples, 0, 1)
    loader = DataLoader(ds, batch_sampler=sampler, collate_fn=coll, num_workers=2, prefetch_factor=2)
    full = [batch_signature(b) for b in loader]
    ref_sampler, ref_ds, ref_coll = make(samples, 0, 1)
    assert full == [batch_signature(b) for b in collate_all(samples, ref_sampler, ref_ds, ref_coll)]

    # Interrupt after k batches: the sampler ran ahead (prefetch), the batch cursor did not.
    k = 3
    s1, ds1, c1 = make(samples, 0, 1)
    loader = DataLoader(ds1, batch_sampler=s1, collate_fn=c1, num_workers=2, prefetch_factor=2)
    it = iter(loader)
    head = [next(it) for _ in range(k)]
    assert s1.state_dict()["cursor"] > k, "workers prefetch: the sampler is ahead of the loop"
    state = s1.state_dict(cursor=head[-1]["cursor"])
    del it
    s2, ds2, c2 = make(samples, 0, 1)
    s2.load_state_dict(state)
    loader2 = DataLoader(ds2, batch_sampler=s2, collate_fn=c2, num_workers=2)
    assert [batch_signature(b) for b in head] + [batch_signature(b) for b in loader2] == full


def test_stateful_dataloader_protocol(samples):
    """What torchdata's StatefulDataLoader does with a Stateful batch sampler: snapshot its state
    when it hands out an index, restore it with load_state_dict, then iter() again."""
    sampler, ds, coll = make(samples)
    it = iter(sampler)
    snapshots = []
    for _ in range(4):
        next(it)
        snapshots.append(sampler.state_dict())
    restored, _, _ = make(samples)
    restored.load_state_dict(snapshots[1])
    rest = [list(t) for t in restored]
    fresh, _, _ = make(samples)
    assert rest == [list(t) for t in fresh][2:]
    assert len(restored) == len(fresh)


def test_ticket_pickles_as_plain_data(samples):
    sampler, ds, coll = make(samples)
    ticket = next(iter(sampler))
    assert isinstance(ticket, MicroBatchTicket) and list(ticket) == list(ticket.microbatch.samples)
    copy = pickle.loads(pickle.dumps(ticket))
    assert copy.microbatch == ticket.microbatch and copy.cursor == ticket.cursor and list(copy) == list(ticket)
    blob = pickle.dumps(ticket)
    assert b"ringpack.planner" not in blob, "no plan objects in the pickle"
    assert b"_plans" not in pickle.dumps(sampler) or not pickle.loads(pickle.dumps(sampler))._plans


def test_overflow_split_and_drop():
    samples = random_samples(30, seed=3, max_len=200)
    samples[5] = np.arange(1000) % 97  # longer than cp * tokens_per_rank = 512
    with pytest.raises(PlanError, match="sample 5"):
        make(samples, tokens=T)[0].plan()
    cov = Coverage(samples)
    for d in range(DP):
        for c in range(CP):
            sampler, ds, coll = make(samples, d, c, overflow="split", samples_per_step=0)
            for b in collate_all(samples, sampler, ds, coll):
                # documents cut from sample 5 are planned as their own samples: map back to rows
                ticket_rows = b["microbatch"].samples
                assert ticket_rows is not None
                cu = b["cu_seqlens"].numpy()
                # rebuild coverage per dataset row using the ticket offsets
                cov_batch = dict(b)
                cov_batch["sample_ids"] = torch.tensor(
                    [sampler._doc_map(sampler.plan())[0][s] for s in b["sample_ids"].tolist()]
                )
                pos = b["position_ids"].clone()
                offs = sampler._doc_map(sampler.plan())[1]
                for k, s in enumerate(b["sample_ids"].tolist()):
                    pos[cu[k] : cu[k + 1]] += int(offs[s])
                cov_batch["position_ids"] = pos
                # a cut ends a document: its last label is ignored; patch the expectation
                labels = b["labels"].numpy()
                for k, s in enumerate(cov_batch["sample_ids"].tolist()):
                    p_end = int(pos[cu[k + 1] - 1])
                    if labels[cu[k + 1] - 1] == -100 and p_end + 1 < len(samples[s]):
                        labels = labels.copy()
                        labels[cu[k + 1] - 1] = samples[s][p_end + 1]
                cov_batch["labels"] = torch.from_numpy(np.asarray(labels))
                cov_batch["num_loss_tokens"] = int((np.asarray(labels) != -100).sum())
                cov.add(cov_batch)
    cov.check_exactly_once()
    dropped = make(samples, overflow="drop", samples_per_step=0)[0]
    assert dropped.dropped == (5,)
    assert 5 not in {x for t in dropped for x in t}


def test_collator_errors(samples):
    sampler, ds, coll = make(samples)
    with pytest.raises(DataError, match="PackedDataset"):
        coll([samples[0], samples[1]])
    ticket = next(iter(sampler))
    bad = PackedDataset([s[:-1] if len(s) > 1 else s for s in samples])
    with pytest.raises(DataError, match="dataset changed"):
        coll(bad.__getitems__(ticket))
    with pytest.raises(DataError, match="cp_rank"):
        PackedCollator(2, 2)
    with pytest.raises(DataError, match="no column"):
        PackedDataset(__import__("datasets").Dataset.from_dict({"text": ["a"]}))
    with pytest.raises(DataError, match="sample 3 has length 0"):
        BalancedBatchSampler([4, 5, 6, 0], 0, 1, 1, 100)
    with pytest.raises(DataError, match="dp_rank"):
        BalancedBatchSampler([4, 5], 2, 2, 1, 100)


def test_schedule_compiled_unless_disabled(samples):
    sampler, ds, _ = make(samples)
    ticket = next(iter(sampler))
    ref = compile_schedule(ticket.microbatch, 1)
    for flag in ("auto", True):
        batch = PackedCollator(1, CP, compile_schedules=flag)(ds.__getitems__(ticket))
        assert type(batch["schedule"]) is type(ref) and batch["schedule"].fingerprint == ref.fingerprint
    assert PackedCollator(1, CP, compile_schedules=False)(ds.__getitems__(ticket))["schedule"] is None


def test_old_schedule_keyword_still_works_with_a_warning(samples):
    """schedule= is the old name of compile_schedules=: it still decides, with a DeprecationWarning
    that points at the caller; giving both names, or a bad value under the new one, is a DataError."""
    sampler, ds, _ = make(samples)
    ticket = next(iter(sampler))
    with pytest.warns(DeprecationWarning, match="compile_schedules") as caught:
        collator = PackedCollator(1, CP, schedule=False)
    assert caught[0].filename == __file__
    assert collator(ds.__getitems__(ticket))["schedule"] is None
    with pytest.raises(DataError, match="compile_schedules= only"):
        PackedCollator(1, CP, compile_schedules=True, schedule=False)
    with pytest.raises(DataError, match="compile_schedules must be"):
        PackedCollator(1, CP, compile_schedules="yes")


def test_schedule_options_reach_compile_schedule(samples):
    """ScheduleOptions pass compile_schedule's kernel-split options through (exact shapes, a low
    threshold) without a warning; the old dict spelling warns and compiles the same schedule;
    unknown options are refused when the collator is built."""
    sampler, ds, _ = make(samples)
    ticket = next(iter(sampler))
    keywords = {"dense_threshold": 2, "dense_buckets": None}

    def dense_parts(schedule) -> list:
        return [c.dense for c in (schedule.local, *(c for st in schedule.steps for c in st.calls)) if c is not None]

    for rank in range(CP):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            collator = PackedCollator(rank, CP, schedule_options=ScheduleOptions(**keywords))
        got = collator(ds.__getitems__(ticket))["schedule"]
        want = compile_schedule(ticket.microbatch, rank, **keywords)
        assert dense_parts(got) == dense_parts(want)
        assert any(dense_parts(got)), "threshold 2 makes dense parts in these plans"
        with pytest.warns(DeprecationWarning, match="ScheduleOptions"):
            old = PackedCollator(rank, CP, schedule_options=keywords)
        assert old.schedule_options == collator.schedule_options
        assert dense_parts(old(ds.__getitems__(ticket))["schedule"]) == dense_parts(got)
    with pytest.raises(DataError, match="unknown schedule option"), pytest.warns(DeprecationWarning):
        PackedCollator(0, CP, schedule_options={"dense_bucket": 8})


def test_hf_dataset_source(samples):
    hf = datasets.Dataset.from_dict({"input_ids": [s.tolist() for s in samples], "meta": list(range(len(samples)))})
    sampler = BalancedBatchSampler(hf, 0, 1, CP, T, samples_per_step=40)
    ds = PackedDataset(hf)
    cov = Coverage(samples)
    for c in range(CP):
        coll = PackedCollator(c, CP, compile_schedules=False)
        loader = DataLoader(ds, batch_sampler=sampler, collate_fn=coll, num_workers=1)
        cov.add_all(loader)
    cov.check_exactly_once()


@pytest.mark.parametrize("workers", [0, 2])
def test_real_stateful_dataloader_resume(samples, workers):
    """torchdata's StatefulDataLoader: stop after k batches, save, restore into a fresh loader,
    and the rest of the epoch is bit-identical to an uninterrupted run."""

    def loader():
        sampler, ds, coll = make(samples, 1, 0)
        kwargs = dict(num_workers=workers, prefetch_factor=2) if workers else {}
        return StatefulDataLoader(ds, batch_sampler=sampler, collate_fn=coll, **kwargs)

    full = [batch_signature(b) for b in loader()]
    k = 3
    first = loader()
    it = iter(first)
    head = [batch_signature(next(it)) for _ in range(k)]
    state = first.state_dict()
    del it
    second = loader()
    second.load_state_dict(state)
    assert head + [batch_signature(b) for b in second] == full


@pytest.mark.parametrize("bad", [-1, 1000, 2**40])
@pytest.mark.parametrize("source", ["list", "arrow"])
def test_a_token_id_outside_the_vocabulary_is_refused_naming_its_row(samples, bad, source):
    rows = [np.asarray(s, dtype=np.int64) % 1000 for s in samples]
    row = 17
    rows[row] = rows[row].copy()
    rows[row][len(rows[row]) // 2] = bad
    data = rows if source == "list" else datasets.Dataset.from_dict({"input_ids": [r.tolist() for r in rows]})
    dataset = PackedDataset(data)
    sampler = make(samples)[0]
    collators = [PackedCollator(cp_rank, CP, compile_schedules=False, vocab_size=1000) for cp_rank in range(CP)]
    ticket = next(t for t in sampler if row in t)
    with pytest.raises(DataError, match=rf"^row {row}: token id {bad} is not in \[0, 1000\) \(the model's vocab"):
        collators[1](dataset.__getitems__(ticket))  # whichever CP rank holds its tokens
    others = next(t for t in make(samples)[0] if row not in t)
    assert collators[0](dataset.__getitems__(others))["input_ids"].max() < 1000
    unbounded = PackedCollator(0, CP, compile_schedules=False)  # no vocabulary: the int32 id range
    if bad < 0 or bad >= 2**31:
        with pytest.raises(DataError, match=rf"row {row}: token id {bad} is not in \[0, {2**31}\) \(the int32"):
            unbounded(dataset.__getitems__(ticket))
    else:
        unbounded(dataset.__getitems__(ticket))


@pytest.mark.parametrize("value", [1.5, float("nan"), 2**70, "7"])
def test_a_token_id_that_is_no_integer_is_refused_naming_its_row(value):
    rows = [[1, 2, 3], [4, value, 6]]
    with pytest.raises(DataError, match=r"^row 1: token id .* is not an integer"):
        PackedDataset(rows)[1]
    if not isinstance(value, str):
        table = datasets.Dataset.from_dict({"input_ids": [[1.0, 2.0, 3.0], [4.0, float(value), 6.0]]})
        with pytest.raises(DataError, match=r"^row 1: token id .* is not an integer"):
            PackedDataset(table).__getitems__([0, 1])
    assert PackedDataset([[1.0, 2.0]])[0].tolist() == [1, 2]


def test_vocab_size_must_be_a_positive_integer():
    with pytest.raises(DataError, match="vocab_size must be None or a positive integer"):
        PackedCollator(0, 1, vocab_size=0)


def test_the_sampler_takes_the_plan_config_whole_and_the_old_spelling_warns():
    import warnings

    from ringpack import PlanConfig

    lengths = np.random.default_rng(5).integers(10, 900, 300)
    config = PlanConfig(dp=2, cp=2, tokens_per_rank=2048, samples_per_step=40, seed=3)
    new = BalancedBatchSampler(lengths, config, 1)
    with pytest.warns(DeprecationWarning, match=r"pass BalancedBatchSampler\(lengths, PlanConfig\("):
        old = BalancedBatchSampler(lengths, 1, 2, 2, 2048, seed=3, samples_per_step=40)
    assert new.config == old.config == config and new.plan_key == old.plan_key
    assert [list(t) for t in new] == [list(t) for t in old]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new spelling warns of nothing
        BalancedBatchSampler(lengths, config, 0)
    with pytest.raises(DataError, match=r"dp_rank must be in \[0, 2\)"):
        BalancedBatchSampler(lengths, config, 2)
    with pytest.raises(DataError, match="takes nothing more, got 'zigzag'"):
        BalancedBatchSampler(lengths, config, 0, "zigzag")
    later = BalancedBatchSampler(lengths, PlanConfig(dp=2, cp=2, tokens_per_rank=2048, epoch=2), 0)
    assert later.epoch == 2 and later.config.epoch == 0, "the config's epoch is the first one iterated"
