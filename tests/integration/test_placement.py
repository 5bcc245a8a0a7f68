"""Placement across nodes on a real multi-node Ray (`ray.cluster_utils.Cluster`, several Ray
nodes on this machine, each with its own resources), and the resource check as pure logic."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from cluster.cli.compose import load_config
from cluster.layout import bundles, check

SCENARIO = str(Path(__file__).with_name("placement_scenario.py"))


def _nodes(*specs):
    return [{"Alive": True, "Resources": spec} for spec in specs]


def test_check_names_the_missing_node_resource_and_the_short_role():
    cfg = load_config(["cluster.nodes.rollout=gen", "rollout.num_workers=4", "rollout.num_cpus_per_worker=1"])
    assert check(cfg, _nodes({"CPU": 8})) == [
        "a node with resource 'gen' (cluster.nodes.rollout); start one with ray start --resources='{\"gen\": 1}'"]
    short = check(cfg, _nodes({"CPU": 8}, {"CPU": 2, "gen": 1}))
    assert short == ["4 CPU for rollout on the nodes with 'gen' (they have 2)"]
    assert check(cfg, _nodes({"CPU": 8}, {"CPU": 4, "gen": 1})) == []
    gpus = load_config(["learner.num_gpus_per_rank=1"])
    assert check(gpus, _nodes({"CPU": 8})) == ["2 GPU in all (the cluster has 0)"]


def test_check_names_an_actor_that_no_single_node_can_hold():
    # 4 GPUs in all, but each engine needs 4 on one node: the placement group would wait forever.
    cfg = load_config(["rollout.num_workers=1", "rollout.num_gpus_per_worker=4", "rollout.tensor_parallel_size=4",
                       "learner.num_gpus_per_rank=0"])
    two_by_two = _nodes({"CPU": 8, "GPU": 2}, {"CPU": 8, "GPU": 2})
    assert check(cfg, two_by_two) == ["4 GPU on one node for each rollout actor (the largest node has 2)"]
    assert check(cfg, _nodes({"CPU": 8, "GPU": 4})) == []
    labelled = load_config(["cluster.nodes.rollout=gen", "rollout.num_workers=1", "rollout.num_cpus_per_worker=6"])
    assert check(labelled, _nodes({"CPU": 16}, {"CPU": 4, "gen": 1}, {"CPU": 4, "gen": 1})) == [
        "6 CPU on one node for each rollout actor (the largest node with 'gen' has 4)"]


def test_bundles_pin_each_actor_to_its_label_and_resources():
    cfg = load_config(["cluster.nodes.learner=train", "learner.num_gpus_per_rank=1"])
    assert bundles(cfg, "learner") == [{"CPU": 0.25, "GPU": 1, "train": 0.001}] * 2
    assert bundles(cfg, "rollout") == [{"CPU": 0.5}] * 2


def test_roles_land_on_the_nodes_the_config_names_and_survive_losing_one(model_cache, tmp_path):
    result = subprocess.run([sys.executable, SCENARIO, model_cache, str(tmp_path)], capture_output=True, text=True,
                            timeout=1200)
    lines = [ln for ln in result.stdout.splitlines() if ln.startswith("RESULT ")]
    assert result.returncode == 0 and lines, result.stdout[-3000:] + result.stderr[-3000:]
    out = json.loads(lines[-1][7:])
    assert out["placed"]["GenerationWorker"] == ["gen"]
    assert out["placed"]["LearnerRank"] == ["train", "train"]
    assert out["placed"]["VerifierWorker"] == ["score", "score"]
    # The run works across the nodes, and goes on when the generation node is lost: its actors
    # come back on the replacement node, re-join the sync group, and the step completes.
    assert out["policy_versions"] == [out["warmup_version"] + 1, out["warmup_version"] + 2]
    assert out["placed_after"]["GenerationWorker"] == ["gen-replacement"]
    assert out["placed_after"]["LearnerRank"] == ["train", "train"]
    assert out["restarts"] >= 1
    assert out["versions"] == [out["policy_versions"][1]]
    assert len(out["missing"]) == 1 and "tpu_pod" in out["missing"][0]
