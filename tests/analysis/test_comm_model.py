"""The communication model's link classes and exchanges on hand-computed cases (ringpack/analysis/comm_model.py)."""

from __future__ import annotations

import numpy as np
import pytest

from ringpack.analysis.comm_model import CommModel, ExchangeVolumes, exchange_volumes, microbatch_seconds
from ringpack.cost import CostModel
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
    across, rank 2 receives 20 across; 0%, 40%, 80% and 0% of their pairs are remote."""
    z = np.zeros((1, 4), dtype=np.int64)
    volumes = ExchangeVolumes(
        send_intra=np.array([[10, 0, 0, 0]]),
        send_inter=np.array([[10, 10, 0, 0]]),
        recv_intra=np.array([[0, 10, 0, 0]]),
        recv_inter=np.array([[0, 0, 20, 0]]),
        remote_pairs=np.array([[0, 14, 28, 0]]) + z,
    )
    # exchange: max(1 + 10/100, 5 + 10/10) = 6 s for ranks 0 and 1, 5 + 20/10 = 7 s for rank 2
    # forward max(local, exchange) + remote; backward max(local, exchange) + remote + exchange
    expected = [
        max(10, 6) + max(25, 6) + 6,
        (max(6, 6) + 4) + (max(15, 6) + 10 + 6),
        (max(2, 7) + 8) + (max(5, 7) + 20 + 7),
        10 + 25,
    ]
    assert seconds("p2p", 2, volumes) == pytest.approx(expected)
    with pytest.raises(ValueError, match="p2p communication model needs the exchange volumes"):
        seconds("p2p", 2)


def test_exchange_volumes_of_a_plan_by_hand():
    """Sample 0 over CP ranks 0, 1, 2: rank 1's 10 queries see 10 keys of rank 0 (100 remote
    pairs), rank 2's see 20 (200); its piece of [20, 30) came from both nodes' ranks."""
    shards = [[Piece(0, 0, 10)], [Piece(0, 10, 20)], [Piece(0, 20, 30)], [Piece(1, 0, 5)]]
    mb = microbatch_from_shards([0, 1], shards, [30, 5])
    plan = Plan(config=PlanConfig(dp=1, cp=4, tokens_per_rank=64), lengths=(30, 5), steps=(Step(((mb,),)),))
    v = exchange_volumes(plan.piece_arrays, 4, (1, 1, 1), gpus_per_node=2)
    assert v.remote_pairs.reshape(-1).tolist() == [0, 100, 200, 0]
    assert v.recv_intra.reshape(-1).tolist() == [0, 10, 0, 0] and v.recv_inter.reshape(-1).tolist() == [0, 0, 20, 0]


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
