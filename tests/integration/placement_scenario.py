"""Run in its own process by tests/integration/test_placement.py (a process joins one Ray cluster only).

Starts a `ray.cluster_utils.Cluster`: a head and three nodes, each labelled with a custom
resource; starts the real roles with cluster.nodes.* naming those labels; runs a short warm-up
and one GRPO step across the nodes; then removes the generation node (its actors die with it)
after adding a replacement, and runs another step. Prints one JSON line: where each actor
landed before and after, the policy versions, the restarts, and what the resource check says
of a config that names a label no node has.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main(model_cache: str, out: str) -> None:
    import ray
    from ray.cluster_utils import Cluster
    from ray.util.state import list_actors

    from cluster.loop.batches import SyncBatches
    from cluster.loop.buffer import RolloutBuffer
    from cluster.cli.compose import load_config
    from cluster.layout import check
    from cluster.loop.phases import grpo_step, warm_up
    from cluster.loop.launch import ACTOR_ENV, check_resources
    from cluster.cli.checks import resolve_model
    from cluster.loop.roles import start_roles
    from common.ray_utils import free_port
    from data.datasets import PromptSampler, load_problems
    from tests.helpers import small_overrides

    store = 150 * 2**20
    # A dashboard port of its own (the state API below goes through it): another test worker's
    # Ray may hold the default 8265, and then this head starts without one.
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": store,
                                                            "dashboard_port": free_port()})
    labels = {"gen": 3, "train": 2, "score": 1}
    nodes = {label: cluster.add_node(num_cpus=cpus, resources={label: 1}, object_store_memory=store)
             for label, cpus in labels.items()}
    ray.init(address=cluster.address, runtime_env={"env_vars": ACTOR_ENV}, log_to_driver=False)
    cfg = load_config(small_overrides(model_cache, out) + [
        "cluster.nodes.rollout=gen", "cluster.nodes.learner=train", "cluster.nodes.reward=score",
        "warmup.steps=10", "warmup.target_accuracy=0", "rollout.num_workers=1"])
    cfg.model.path = resolve_model(cfg)
    check_resources(cfg)
    roles = start_roles(cfg)
    roles.verifiers.ready()

    def where() -> dict:
        node_label = {n["NodeID"]: next((k for k in labels if k in n["Resources"]), "head")
                      for n in ray.nodes() if n["Alive"]}
        node_label[replacement_id] = "gen-replacement" if replacement_id else None
        placed = {}
        # This cluster's address: with other Rays on the machine the default is the newest one.
        for actor in list_actors(address=cluster.address, filters=[("state", "=", "ALIVE")]):
            placed.setdefault(actor.class_name, []).append(node_label.get(actor.node_id, "?"))
        return placed

    replacement_id = None
    placed = where()
    heldout, train_set = load_problems(cfg.data, cfg.trainer.seed)
    version = warm_up(roles, cfg, train_set)
    batches, buffer = SyncBatches(roles, PromptSampler(train_set, 0), cfg), RolloutBuffer()
    first = grpo_step(1, version, roles, batches, buffer, cfg).metrics
    # Lose the generation node: a replacement with the same label joins, the old one goes.
    replacement = cluster.add_node(num_cpus=labels["gen"], resources={"gen": 1}, object_store_memory=store)
    replacement_id = replacement.node_id
    cluster.remove_node(nodes["gen"])
    second = grpo_step(2, first["policy_version"], roles, batches, buffer, cfg).metrics
    placed_after = where()
    nowhere = load_config(small_overrides(model_cache, out) + ["cluster.nodes.rollout=tpu_pod"])
    print("RESULT " + json.dumps({
        "placed": placed, "placed_after": placed_after, "warmup_version": version,
        "policy_versions": [first["policy_version"], second["policy_version"]], "versions": roles.rollout.versions(),
        "restarts": second["actor_restarts"], "missing": check(nowhere, ray.nodes()),
    }), flush=True)
    roles.shutdown()
    ray.shutdown()
    cluster.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
