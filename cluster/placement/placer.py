"""Map pool sizes onto concrete node and GPU indices.

Tensor-parallel groups never span nodes (all-reduce wants NVLink); pipeline stages may. High
node-affinity pools are packed best-fit, larger groups first, to leave whole nodes free. Low
node-affinity units take ``pp`` whole nodes and put stage ``s`` of every prefill and decode
segment of the unit on the unit's node ``s``, so KV moves between segments over NVLink.
"""

from __future__ import annotations

from duet.cluster.placement.cluster_spec import ClusterSpec
from duet.cluster.placement.plan import ReplicaPlacement, StagePlacement


class PlacementError(ValueError):
    """The pools do not fit the nodes (too few GPUs, or too fragmented)."""


class Inventory:
    """Free GPUs per node; ``take`` hands out the lowest free indices."""

    def __init__(self, cluster: ClusterSpec) -> None:
        self.nodes = cluster.node_list()
        self.free = {n.index: list(range(n.gpus)) for n in self.nodes}

    def take(self, node: int, k: int) -> list[int]:
        got, self.free[node] = self.free[node][:k], self.free[node][k:]
        return got

    def place_pool(self, gpu_type: str, tp: int, pp: int, replicas: int) -> list[ReplicaPlacement]:
        out = []
        for r in range(replicas):
            stages = []
            for _ in range(pp):
                fits = [
                    n.index
                    for n in self.nodes
                    if n.gpu_type == gpu_type and len(self.free[n.index]) >= tp
                ]
                if not fits:
                    raise PlacementError(
                        f"no {gpu_type} node has {tp} free GPUs for replica {r + 1} of {replicas} "
                        f"(tp={tp}, pp={pp})"
                    )
                node = min(fits, key=lambda i: (len(self.free[i]), i))  # best fit
                stages.append(StagePlacement(node=node, gpus=self.take(node, tp)))
            out.append(ReplicaPlacement(stages=stages))
        return out

    def place_units(
        self,
        gpu_type: str,
        pp: int,
        prefill: tuple[int, int],
        decode: tuple[int, int],
        units: int,
    ) -> tuple[list[ReplicaPlacement], list[ReplicaPlacement]]:
        """``prefill``/``decode`` are (tp, segments per unit); returns both pools' placements."""
        (ptp, kp), (dtp, kd) = prefill, decode
        whole = [
            n.index
            for n in self.nodes
            if n.gpu_type == gpu_type and len(self.free[n.index]) == n.gpus >= kp * ptp + kd * dtp
        ]
        if len(whole) < units * pp:
            raise PlacementError(
                f"{units} units x {pp} nodes need {units * pp} free {gpu_type} nodes, "
                f"{len(whole)} are free"
            )
        p_out, d_out = [], []
        for u in range(units):
            unit_nodes = whole[u * pp : (u + 1) * pp]
            p_stages = [[StagePlacement(node=n, gpus=self.take(n, ptp)) for n in unit_nodes] for _ in range(kp)]
            d_stages = [[StagePlacement(node=n, gpus=self.take(n, dtp)) for n in unit_nodes] for _ in range(kd)]
            p_out += [ReplicaPlacement(stages=s) for s in p_stages]
            d_out += [ReplicaPlacement(stages=s) for s in d_stages]
        return p_out, d_out
