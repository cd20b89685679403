"""The communication model's link classes and exchanges on hand-computed cases (ringpack/comm_model.py)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import ringpack
from ringpack.comm_model import (
    ATTN_FORWARD_SHARE,
    CommModel,
    ExchangeVolumes,
    exchange_volumes,
    head_parallel_bytes,
    kv_cross_tokens,
    microbatch_seconds,
    node_exchange_inputs,
    relayout_bytes,
)
from ringpack.cost import CostModel, piece_pairs
from ringpack.planner.bounds import rank_grid
from ringpack.shard_plan import Piece, Plan, PlanConfig, Step, microbatch_from_shards

#: one cost unit is one second, attention only: a rank's 35 pairs are 10 s forward, 25 s backward
MODEL = CostModel(token=0.0, pair=1.0, unit="s")
LINKS = dict(
    bandwidth=100.0, latency=1.0, kv_bytes_per_token_layer=1.0, layers=1, inter_bandwidth=10.0, inter_latency=5.0
)
ZERO = np.zeros((1, 4))
PAIRS = np.full((1, 4), 35)
CROSS = np.array([[10, 0, 0, 0]])  # rank 0's buffer: 10 bytes a layer


def seconds(mode: str, node: int | None, volumes: ExchangeVolumes | None = None) -> np.ndarray:
    comm = CommModel(mode=mode, gpus_per_node=node, **LINKS)
    return microbatch_seconds(ZERO, PAIRS, ZERO, CROSS, MODEL, comm, volumes)[0][0]


def test_a_ring_over_two_nodes_waits_for_the_link_between_them():
    # 4 ring steps, each a quarter of the attention: forward 2.5 s a step against 1 + 10/100 s
    # within a node, 5 + 10/10 s across; backward 6.25 s against twice the bytes
    assert seconds("ring", None) == pytest.approx([35.0] * 4)  # fully hidden
    assert seconds("ring", 2) == pytest.approx([2.5 + 3 * 6 + 6.25 + 3 * 7] * 4)
    assert seconds("ring", 4) == pytest.approx([35.0] * 4)  # the group inside one node: as flat


def test_an_all_gather_prices_the_node_and_the_other_nodes_apart():
    flat = 3 * (1 + 10 / 100)  # three buffers over the one link, each with its latency
    split = (1 + 10 / 100) + 2 * 10 / 10 + 5  # one buffer in the node, two across, one latency across
    assert seconds("allgather", None) == pytest.approx([35 + 2 * flat] * 4)
    assert seconds("allgather", 2) == pytest.approx([35 + 2 * split] * 4)


def test_the_targeted_exchange_overlaps_local_attention_only():
    """Rank 0 sends 10 tokens within its node and 10 across, rank 1 receives the first and sends 10
    across, rank 2 (the only receiver on node 1, so the proxy of both) receives 20 across; 0%, 40%
    (keys on rank 0, same node), 80% (keys on node 0) and 0% of their pairs are remote. No relays."""
    z = np.zeros((1, 4), dtype=np.int64)
    volumes = ExchangeVolumes(
        send_intra=np.array([[10, 0, 0, 0]]),
        send_inter=np.array([[10, 10, 0, 0]]),
        recv_intra=np.array([[0, 10, 0, 0]]),
        recv_inter=np.array([[0, 0, 20, 0]]),
        relay_send=z,
        relay_recv=z,
        remote_intra_pairs=np.array([[0, 14, 0, 0]]),
        remote_inter_pairs=np.array([[0, 0, 28, 0]]),
    )
    # stage 1: max(1 + 10/100, 5 + 10/10) = 6 s for ranks 0 and 1, 5 + 20/10 = 7 s for rank 2; no stage 2.
    # forward max(local, stage 1) + remote; backward the same, then G1 (dK/dV back in the node,
    # 1 + 10/100 = 1.1 s for ranks 0 and 1) and G2 (back over IB: 6 s, 6 s, 7 s), one after the other
    expected = [
        max(10, 6) + (max(25, 6) + 1.1 + 6),
        (max(6, 6) + 4) + (max(15, 6) + 10 + 1.1 + 6),
        (max(2, 7) + 8) + (max(5, 7) + 20 + 7),
        10 + 25,
    ]
    assert seconds("p2p", 2, volumes) == pytest.approx(expected)
    assert volumes.remote_pairs.tolist() == [[0, 14, 28, 0]]
    with pytest.raises(ValueError, match="p2p communication model needs the exchange volumes"):
        seconds("p2p", 2)


def _relayed_plan() -> Plan:
    """Nodes of 2 ranks: sample 0 is [0, 10) on rank 0, [10, 20) on rank 2, [20, 30) on rank 3;
    sample 1, [0, 10) on rank 1, stays there."""
    shards = [[Piece(0, 0, 10)], [Piece(1, 0, 10)], [Piece(0, 10, 20)], [Piece(0, 20, 30)]]
    mb = microbatch_from_shards([0, 1], shards, [30, 10])
    return Plan(config=PlanConfig(dp=1, cp=4, tokens_per_rank=64), lengths=(30, 10), steps=(Step(((mb,),)),))


def test_the_relayed_exchange_by_hand():
    """Volumes: [0, 10) crosses once to node 1, to rank 2 (proxy_index: receivers [2, 3] of source
    0, index 0 % 2 = 0), which relays it to rank 3; [10, 20) goes from rank 2 to rank 3 directly.
    Pairs: 55, 55, 155 (100 against keys on node 0), 255 (100 against rank 2's keys, 100 against
    node 0's).

    Times, one layer of 1 byte a token, a pair 0.07 s: forward 0.02 s a pair, backward 0.05 s.
    Links: stage 1 of rank 0 is 5 + 10/10 = 6 s (IB), of rank 2 max(1 + 10/100, 6) = 6 s, of rank 3
    1.1 s; relays 1.1 s on ranks 2 and 3, after node 1's stage 1 (6 s): stage 2 ends at 7.1 s.
    Forward: rank 0 max(1.1, 6) = 6; rank 1 its 1.1 s alone; rank 2 max(1.1, 6) = 6, then max(6,
    7.1) + 2 = 9.1; rank 3 max(1.1, 1.1) + 2 = 3.1 (node keys), then max(3.1, 7.1) + 2 = 9.1.
    Backward: rank 0 max(2.75, 6) = 6, no G1, G2 6 s: 12; rank 1 2.75; rank 3 max(2.75, 1.1) + 5 =
    7.75, max(7.75, 7.1) + 5 = 12.75, G1 (dK/dV of 20 tokens to rank 2) 1.2 s: 13.95; rank 2
    max(2.75, 6) = 6, max(6, 7.1) + 5 = 12.1, G1 (those 20 tokens in) 1.2 s: 13.3, G2 once rank 3
    is through G1: 13.95 + 6 = 19.95. Totals 18, 3.85, 29.05, 23.05.
    """
    plan = _relayed_plan()
    v = exchange_volumes(plan.piece_arrays, 4, (1, 1, 1), gpus_per_node=2)
    rows = {k: getattr(v, k).reshape(-1).tolist() for k in ExchangeVolumes.__dataclass_fields__}
    assert rows == {
        "send_intra": [0, 0, 10, 0],
        "send_inter": [10, 0, 0, 0],
        "recv_intra": [0, 0, 0, 10],
        "recv_inter": [0, 0, 10, 0],
        "relay_send": [0, 0, 10, 0],
        "relay_recv": [0, 0, 0, 10],
        "remote_intra_pairs": [0, 0, 0, 100],
        "remote_inter_pairs": [0, 0, 100, 100],
    }
    pairs = np.array([55, 55, 155, 255]).reshape(1, 1, 1, 4)
    zero = np.zeros_like(pairs)
    comm = CommModel(mode="p2p", gpus_per_node=2, **LINKS)
    model = CostModel(token=0.0, pair=0.07, unit="s")
    got, exposed = microbatch_seconds(zero, pairs, zero, zero, model, comm, v)
    assert got.reshape(-1) == pytest.approx([18.0, 3.85, 29.05, 23.05])
    assert exposed.reshape(-1) == pytest.approx([18 - 3.85, 0.0, 29.05 - 10.85, 23.05 - 17.85])


def _one_batch_exchange(attn, pairs, v: ExchangeVolumes, comm: CommModel) -> np.ndarray:
    """The targeted exchange as one batch per layer and direction (no nodes): forward
    ``max(local, exchange) + remote``, backward ``max(local, exchange) + remote + exchange``."""
    b = comm.kv_bytes_per_token_layer
    sent = np.maximum(v.send_intra, v.recv_intra) * b
    exchange = np.where(sent > 0, comm.latency + sent / comm.bandwidth, 0.0)
    share = np.divide(v.remote_pairs, pairs, out=np.zeros_like(attn), where=pairs > 0)
    total = np.zeros_like(attn)
    for part, grads in ((ATTN_FORWARD_SHARE, 0.0), (1.0 - ATTN_FORWARD_SHARE, 1.0)):
        a = attn * part / comm.layers
        remote = a * share
        total += comm.layers * (np.maximum(a - remote, exchange) + remote + grads * exchange)
    return total


@pytest.mark.parametrize("node", [None, 8])
def test_flat_groups_time_exactly_as_one_batch(node):
    """Without nodes (or a group inside one) no piece is relayed and the staged timeline is the one-batch exchange."""
    lengths = np.random.default_rng(3).integers(50, 3000, 120)
    plan = ringpack.plan(lengths, dp=2, cp=8, tokens_per_rank=4096, samples_per_step=40, strategy="zigzag")
    a = plan.piece_arrays
    M = max(len(step.microbatches[0]) for step in plan.steps)
    shape = (plan.num_steps, 2, M)
    per_rank, _, _ = rank_grid(a, 2, 8, shape)
    tokens, pairs, segments = (
        per_rank(a["stop"] - a["start"]),
        per_rank(piece_pairs(a["start"], a["stop"])),
        per_rank(None),
    )
    model = CostModel.preset("llama3-8b")
    comm = CommModel.for_model(model, mode="p2p", gpus_per_node=node)
    v = exchange_volumes(a, 8, shape, node)
    assert not (v.relay_send.any() or v.send_inter.any() or v.remote_inter_pairs.any())
    assert v.remote_intra_pairs.sum() > 0
    got, _ = microbatch_seconds(tokens, pairs, segments, np.zeros_like(tokens), model, comm, v)
    linear = model.seconds(model.cost(tokens, 0, segments))
    attn = model.seconds(model.cost(0, pairs, 0))
    assert np.array_equal(got, linear + _one_batch_exchange(attn, pairs, v, comm))


def test_without_a_topology_the_model_reads_and_writes_as_before():
    comm = CommModel.for_model(CostModel.preset("llama3-8b"))
    assert sorted(comm.to_dict()) == ["bandwidth", "kv_bytes_per_token_layer", "latency", "layers", "mode"]
    assert comm.describe() == "ring, 300 GB/s, 10 us latency, 4096 B of K/V per token per layer x 32 layers"
    nodes = CommModel.for_model(CostModel.preset("llama3-8b"), mode="p2p", gpus_per_node=8)
    assert nodes.to_dict()["inter_bandwidth"] == 45e9 and nodes.describe().endswith(
        "across nodes of 8 GPUs 45 GB/s, 20 us"
    )
    with pytest.raises(ValueError, match="mode must be one of"):
        CommModel(mode="tree")


def test_exchange_volumes_in_blocks_of_micro_batches_are_the_whole_table_s(monkeypatch):
    """A plan's volumes computed a few micro-batches at a time (memory in the block's pairs) equal
    those of the whole table at once, nodes or none."""
    import ringpack
    from ringpack import comm_model

    rng = np.random.default_rng(3)
    lengths = np.clip(np.round(rng.lognormal(np.log(300), 1.2, 400)), 1, 3000).astype(np.int64)
    plan = ringpack.plan(lengths, dp=2, cp=8, tokens_per_rank=512, samples_per_step=80, gpus_per_node=2)
    a = plan.piece_arrays
    M = max(len(step.microbatches[0]) for step in plan.steps)
    shape = (plan.num_steps, 2, M)
    for node in (None, 2):
        whole = comm_model.exchange_volumes(a, 8, shape, node)
        monkeypatch.setattr(comm_model, "PAIR_BLOCK", 50)
        blocked = comm_model.exchange_volumes(a, 8, shape, node)
        monkeypatch.undo()
        for field in dataclasses.fields(whole):
            assert np.array_equal(getattr(whole, field.name), getattr(blocked, field.name)), (node, field.name)
        assert whole.send_intra.any() and (node is None or whole.send_inter.any())


# ------------------------------------------------------------------------------- head-parallel modes

#: Q 8 bytes and K/V 4 bytes a token and layer, 4 query heads over 2 K/V heads
HEADS = dict(LINKS, q_bytes_per_token_layer=8.0, kv_bytes_per_token_layer=4.0, heads=4, kv_heads=2)


def test_the_all_to_all_moves_the_other_ranks_heads_of_every_token():
    comm = CommModel(mode="ulysses", **HEADS)
    moved = head_parallel_bytes(np.array([[3, 1]]), comm, 2)
    # each rank keeps half of its own tokens' heads: 1.5 and 0.5 tokens' Q, K, V leave, the
    # other rank's half of the other's tokens come in; O goes the other way
    assert moved.qkv_send.tolist() == [[18.0, 6.0]] and moved.qkv_recv.tolist() == [[6.0, 18.0]]
    assert moved.o_send.tolist() == [[4.0, 12.0]] and moved.o_recv.tolist() == [[12.0, 4.0]]
    assert moved.per_layer.tolist() == [[40.0, 40.0]]


def test_kv_heads_fewer_than_the_ranks_go_replicated():
    comm = CommModel(mode="ulysses", **HEADS)  # 2 K/V heads over 4 ranks: each sent twice
    moved = head_parallel_bytes(np.array([[4, 0, 0, 0]]), comm, 4)
    assert moved.qkv_send[0, 0] == pytest.approx(3.0 * (8.0 + 2 * 4.0))


def test_what_every_all_to_all_sends_it_receives():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 1000, size=(5, 8))
    moved = head_parallel_bytes(tokens, CommModel(mode="ulysses", **HEADS), 4)
    for send, recv in ((moved.qkv_send, moved.qkv_recv), (moved.o_send, moved.o_recv)):
        assert send.reshape(5, 2, 4).sum(-1) == pytest.approx(recv.reshape(5, 2, 4).sum(-1))


def test_ulysses_gives_every_rank_the_same_attention_whatever_the_split():
    comm = CommModel(mode="ulysses", **dict(HEADS, bandwidth=1e30, latency=0.0, relayout_bandwidth=1e30))
    tokens = np.array([[10, 0, 0, 0]])
    seconds, exposed = microbatch_seconds(tokens, np.array([[40, 30, 20, 10]]), ZERO, None, MODEL, comm)
    assert seconds.tolist() == [[25.0] * 4] and exposed.tolist() == [[0.0] * 4]


def test_ulysses_pays_four_all_to_alls_a_layer_and_hides_none():
    comm = CommModel(mode="ulysses", **HEADS)
    tokens = np.array([[3, 1]])
    seconds, exposed = microbatch_seconds(tokens, np.array([[8, 2]]), np.zeros((1, 2)), None, MODEL, comm)
    # Q/K/V: max(18, 6) bytes and O: max(4, 12), each one latency + bytes / 100; twice (backward)
    qkv, o = 1 + 18 / 100, 1 + 12 / 100
    assert exposed[0] == pytest.approx([2 * (qkv + o)] * 2)
    assert seconds[0] == pytest.approx(exposed[0] + 5.0)


def test_the_relayouts_read_and_write_every_row_before_and_after_each_all_to_all():
    comm = CommModel(mode="ulysses", **HEADS)
    # rank 0: its 3 rows packed and 4 / 2 gathered rows; Q + K/V + O = 8 + 4 + 8 bytes a row;
    # a read and a write, forward and backward
    assert relayout_bytes(np.array([[3, 1]]), comm, 2).tolist() == [[(3 + 2) * 20 * 4, (1 + 2) * 20 * 4]]
    # K/V sent twice over 4 ranks (2 K/V heads): 8 bytes of them a row
    assert relayout_bytes(np.array([[4, 0, 0, 0]]), comm, 4)[0, 1] == pytest.approx(1 * (8 + 8 + 8) * 4)
    slow = dataclasses.replace(comm, relayout_bandwidth=1.0, bandwidth=1e30, latency=0.0)
    _, exposed = microbatch_seconds(np.array([[3, 1]]), np.array([[8, 2]]), np.zeros((1, 2)), None, MODEL, slow)
    assert exposed[0] == pytest.approx([400.0, 240.0])
    with pytest.raises(ValueError, match="relayout_bandwidth"):
        CommModel(relayout_bandwidth=0.0)


def test_a_hybrid_attends_its_nodes_pairs_and_exchanges_between_nodes_only():
    comm = CommModel(mode="ulysses+ring", gpus_per_node=2, **dict(HEADS, bandwidth=1e30, latency=0.0))
    tokens, pairs = np.array([[1, 1, 1, 1]]), np.array([[30, 10, 4, 4]])
    # node 0 attends 40 pairs over 2 ranks, node 1 8; nothing crosses nodes
    seconds, _ = microbatch_seconds(tokens, pairs, np.zeros((1, 4)), np.zeros((1, 2)), MODEL, comm)
    assert seconds[0] == pytest.approx([20.0, 20.0, 4.0, 4.0])
    with pytest.raises(ValueError, match="kv_cross"):
        microbatch_seconds(tokens, pairs, np.zeros((1, 4)), None, MODEL, comm)


def test_head_parallel_modes_refuse_what_they_cannot_split():
    assert "not a multiple" in CommModel(mode="ulysses", heads=32).unfit_reason(64)
    assert CommModel(mode="ulysses", heads=32).unfit_reason(16) == ""
    node = CommModel(mode="ulysses+p2p", heads=32, gpus_per_node=8)
    assert "several nodes" in node.unfit_reason(8) and "whole nodes" in node.unfit_reason(12)
    assert node.unfit_reason(64) == "" and node.all_to_all_size(64) == 8
    assert CommModel(mode="ring").unfit_reason(7) == "" and CommModel(mode="ring").all_to_all_size(7) == 0
    with pytest.raises(ValueError, match="query heads over 64"):
        microbatch_seconds(np.ones((1, 64)), np.ones((1, 64)), np.ones((1, 64)), None, MODEL, CommModel(mode="ulysses"))


def test_the_hybrids_node_inputs_on_a_plan():
    lengths = [96, 40, 24]
    cfg = PlanConfig(dp=1, cp=4, tokens_per_rank=48, gpus_per_node=2)
    plan = ringpack.plan(lengths, **{k: getattr(cfg, k) for k in ("dp", "cp", "tokens_per_rank", "gpus_per_node")})
    shape = (plan.num_steps, 1, max(len(s.microbatches[0]) for s in plan.steps))
    ring = CommModel(mode="ulysses+ring", gpus_per_node=2, **HEADS)
    cross, volumes = node_exchange_inputs(plan.piece_arrays, 4, shape, ring)
    assert volumes is None and cross.shape == (*shape, 2)
    # the node-level cross tokens are the rank-level rule on pieces relabelled by node
    a = dict(plan.piece_arrays)
    a["cp"] = np.asarray(a["cp"]) // 2
    assert cross.sum() == kv_cross_tokens(a, shape=shape).sum()
    p2p = dataclasses.replace(ring, mode="ulysses+p2p")
    cross, volumes = node_exchange_inputs(plan.piece_arrays, 4, shape, p2p)
    assert cross is None and volumes.send_intra.shape == (*shape, 2)
    assert node_exchange_inputs(plan.piece_arrays, 4, shape, dataclasses.replace(ring, mode="p2p")) == (None, None)


def test_peers_are_the_union_of_each_ranks_compiled_exchanges_over_its_microbatches():
    """Per (DP rank, CP rank), the targeted exchange's NCCL peers over all the plan's micro-batches are
    the union of the peers of its compiled schedules; the other modes' are fixed by their shape."""
    from ringpack.attention import compile_schedule
    from ringpack.comm_model import rank_partners

    rng = np.random.default_rng(3)
    lengths = rng.integers(20, 400, 120).tolist()
    plan = ringpack.plan(lengths, dp=2, cp=8, tokens_per_rank=256, gpus_per_node=2, samples_per_step=60)
    shape = (plan.num_steps, 2, max(len(s.microbatches[0]) for s in plan.steps))
    p2p = CommModel(mode="p2p", gpus_per_node=2)
    got = rank_partners(plan.piece_arrays, 8, shape, p2p)
    want = np.zeros((2, 8), dtype=np.int64)
    for d in range(2):
        for c in range(8):
            peers = set()
            for step in plan.steps:
                for mb in step.microbatches[d]:
                    peers |= compile_schedule(mb, c, gpus_per_node=2).exchange.partner_ranks
            want[d, c] = len(peers)
    assert got.tolist() == want.tolist() and want.max() > 2
    for mode, expected in (("ring", 2), ("allgather", 2), ("ulysses", 7), ("ulysses+ring", 1 + 2)):
        comm = dataclasses.replace(p2p, mode=mode)
        assert (rank_partners(plan.piece_arrays, 8, shape, comm) == expected).all(), mode
    hybrid = rank_partners(plan.piece_arrays, 8, shape, dataclasses.replace(p2p, mode="ulysses+p2p"))
    assert (hybrid >= 1).all() and (hybrid <= 1 + 3).all()
    assert rank_partners(plan.piece_arrays, 1, shape, CommModel()).shape == (2, 1)
