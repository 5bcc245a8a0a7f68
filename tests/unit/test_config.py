"""Config composition (cluster/cli/compose.py): schema <- conf/ groups <- Hydra-style overrides.

Fast: composes YAML only; no Ray, torch or vLLM.
"""
from __future__ import annotations

import pytest

from cluster.cli.compose import ConfigError, load_config, schema_keys, validate
from common.config import Config


def config_error(*overrides: str) -> str:
    """The ConfigError message for these overrides; it must be one line."""
    with pytest.raises(ConfigError) as info:
        load_config(list(overrides))
    message = str(info.value)
    assert message and "\n" not in message, f"not one line: {message!r}"
    return message


def test_defaults_compose_and_validate():
    cfg = load_config([])
    assert isinstance(cfg, Config)
    assert cfg.model.name == "tiny"
    assert cfg.data.source == "arithmetic"
    assert cfg.logger.backends == ["wandb"]
    assert cfg.trainer.max_steps == Config().trainer.max_steps
    assert cfg.reward.weights == {"math": 1.0, "format": 0.1}
    validate(cfg)
    validate(Config())  # the bare schema defaults are a valid run too


def test_schema_keys_are_dotted():
    keys = schema_keys()
    assert "trainer.max_steps" in keys and "reward.weights" in keys and "data" in keys


def test_dotted_override():
    cfg = load_config(["trainer.max_steps=3", "algo.beta=0.0", "trainer.run_name=demo"])
    assert cfg.trainer.max_steps == 3
    assert cfg.algo.beta == 0.0
    assert cfg.trainer.run_name == "demo"
    assert load_config(["trainer.max_steps=3", "trainer.max_steps=4"]).trainer.max_steps == 4


def test_group_override_logger():
    cfg = load_config(["logger=none"])
    assert cfg.logger.backends == []
    assert load_config(["logger=tensorboard"]).logger.backends == ["tensorboard"]
    assert load_config(["logger=mlflow"]).logger.backends == ["mlflow"]


def test_several_loggers_compose():
    """`logger=[a,b]` joins the groups' backends (Hydra alone would keep the last list)."""
    cfg = load_config(["logger=[wandb,tensorboard,mlflow]", "logger.mode=online"])
    assert cfg.logger.backends == ["wandb", "tensorboard", "mlflow"] and cfg.logger.mode == "online"
    assert load_config(["logger=[none,tensorboard]"]).logger.backends == ["tensorboard"]
    assert load_config(["logger=[wandb,mlflow]", "logger.backends=[mlflow]"]).logger.backends == ["mlflow"]
    assert load_config(["logger.backends=[tensorboard,wandb]"]).logger.backends == ["tensorboard", "wandb"]


@pytest.mark.parametrize("overrides,needle", [
    (["logger=comet"], "logger/comet"),
    (["logger=[wandb,comet]"], "logger/comet"),
    (["logger.backends=[wandb,comet]"], "logger.backends: unknown logger 'comet'"),
    (["logger=mlflow", "logger.mlflow_tracking_uri=ftp://host/x"], "logger.mlflow_tracking_uri='ftp://host/x'"),
    (["logger=mlflow", "logger.mlflow_tracking_uri=http://host:port"], "not a URI"),
    (["logger=mlflow", "logger.mlflow_tracking_uri=mlruns"], "no scheme"),
    (["logger=mlflow", "logger.mlflow_tracking_uri=http:///x"], "no host"),
    (["logger.timeout_s=0"], "logger.timeout_s must be positive"),
])
def test_bad_logger_settings_are_one_line(overrides, needle):
    with pytest.raises(ConfigError) as err:
        load_config(overrides)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_group_override_data_jsonl(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    cfg = load_config(["data=jsonl", f"data.path={rows}"])
    assert cfg.data.source == "jsonl"
    assert cfg.data.path == str(rows)


def test_group_data_jsonl_needs_path(tmp_path):
    assert "data.path" in config_error("data=jsonl")
    message = config_error("data=jsonl", f"data.path={tmp_path / 'missing.jsonl'}")
    assert "data.path" in message and "missing.jsonl" in message


def test_group_model_hf_needs_path():
    assert "model.path" in config_error("model=hf")
    assert load_config(["model=hf", "model.path=some/model"]).model.path == "some/model"


def test_add_mapping_key():
    cfg = load_config(["+reward.weights.length=0.5"])
    assert cfg.reward.weights == {"math": 1.0, "format": 0.1, "length": 0.5}


def test_delete_mapping_key_then_validation_complains():
    message = config_error("~reward.weights.format")
    assert "reward.weights" in message and "'format'" in message
    # deleting both the weight and the verifier is a valid run
    cfg = load_config(["~reward.weights.format", "reward.verifiers=[math]"])
    assert cfg.reward.weights == {"math": 1.0} and cfg.reward.verifiers == ["math"]


def test_verifier_without_weight():
    message = config_error("reward.verifiers=[math,format,length]")
    assert "'length'" in message and "+reward.weights.length" in message


def test_unknown_key_suggests_nearest():
    message = config_error("trainer.max_step=3")
    assert "trainer.max_step" in message
    assert "did you mean 'trainer.max_steps'" in message


def test_unknown_top_level_key():
    assert "foo" in config_error("foo=1")


def test_wrong_type_names_key():
    assert "trainer.max_steps" in config_error("trainer.max_steps=abc")
    assert "algo.beta" in config_error("algo.beta=abc")
    assert "trainer.max_steps" in config_error("trainer.max_steps=null")


def test_group_size_too_small():
    assert "algo.group_size" in config_error("algo.group_size=1")


def test_prompts_per_step_must_split_over_learner_ranks():
    assert load_config([]).learner.num_ranks == 2
    message = config_error("trainer.prompts_per_step=63")
    assert "trainer.prompts_per_step" in message and "learner.num_ranks" in message
    # fine with one rank
    assert load_config(["trainer.prompts_per_step=63", "learner.num_ranks=1",
                        "warmup.batch_size=63"]).trainer.prompts_per_step == 63


def test_unknown_group_option():
    message = config_error("model=nope")
    assert "nope" in message and "tiny" in message  # names the missing option and the choices


def test_max_new_tokens_must_leave_room_for_prompt():
    message = config_error("rollout.max_new_tokens=500")
    assert "rollout.max_new_tokens" in message and "rollout.max_model_len" in message


@pytest.mark.parametrize("override,key", [
    ("algo.adv_scale=std", "algo.adv_scale"),
    ("algo.kl_estimator=k4", "algo.kl_estimator"),
    ("learner.zero_stage=4", "learner.zero_stage"),
    ("learner.num_ranks=0", "learner.num_ranks"),
    ("data.source=csv", "data.source"),
    ("data.min_digits=1", "data.min_digits"),
    ("trainer.progress=maybe", "trainer.progress"),
    ("rollout.kv_cache_gib=0", "rollout.kv_cache_gib"),
    ("rollout.min_new_tokens=33", "rollout.min_new_tokens"),
    ("learner.num_threads=-1", "learner.num_threads"),
    ("rollout.num_threads=-1", "rollout.num_threads"),
    ("algo.correction=ppo", "algo.correction"),
    ("data.digit_distribution=poisson", "data.digit_distribution"),
])
def test_other_invalid_values_name_the_key(override, key):
    assert key in config_error(override)


@pytest.mark.parametrize("overrides,words", [
    (["algo.correction=mis", "algo.mis_low=0.5", "algo.mis_high=0.4"], "inverted"),
    (["algo.correction=icepop", "algo.icepop_low=6"], "inverted"),
    (["algo.correction=icepop", "algo.icepop_low=1.1", "algo.icepop_high=3"], "exclude 1"),
    (["algo.correction=seq_mask", "algo.seq_mask_high=0.999"], "exclude 1"),
    (["algo.seq_mask_low=0.9", "algo.seq_mask_high=0.95"], "exclude 1"),
    (["data=long_tail", "data.digit_decay=1.5"], "data.digit_decay"),
])
def test_correction_bounds_and_digit_decay_are_refused_in_one_line(overrides, words):
    message = config_error(*overrides)
    assert words in message and "\n" not in message


def test_unparsable_override_is_one_line():
    assert config_error("trainer.max_steps==")


def test_adding_unknown_schema_key_is_an_error():
    message = config_error("+trainer.max_step=3")
    assert "trainer.max_step" in message
    assert "trainer.max_steps" in message  # the nearest valid key


def test_custom_verifier_from_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "team_rewards.py").write_text("def short(prompts, completions, **kw):\n"
                                              "    return [float(len(c) < 50) for c in completions]\n")
    monkeypatch.chdir(tmp_path)
    cfg = load_config(["+reward.custom.short=team_rewards:short", "reward.verifiers=[math,short]",
                       "+reward.weights.short=0.5"])
    assert cfg.reward.custom == {"short": "team_rewards:short"}
    message = config_error("+reward.custom.short=team_rewards:long", "reward.verifiers=[math,short]",
                           "+reward.weights.short=0.5")
    assert "reward.custom.short" in message and "no function 'long'" in message


def test_reward_settings_are_checked_before_anything_starts():
    assert "reward.timeout_s must be positive" in config_error("reward.timeout_s=0")
    assert "reward.language" in config_error("reward.language=klingon")
    assert "format_pattern" in config_error("reward.format_pattern=(")
    assert "unknown verifier 'nope'" in config_error("reward.verifiers=[math,nope]", "+reward.weights.nope=1")


def test_resume_settings_are_checked_before_anything_starts(tmp_path):
    assert "trainer.run_name" in config_error("trainer.resume=auto")
    message = config_error(f"trainer.resume={tmp_path}")
    assert "not a complete checkpoint" in message and "trainer_state.json" in message
    assert "trainer.save_every" in config_error("trainer.save_every=-1")
    assert "trainer.max_restarts" in config_error("trainer.max_restarts=-1")
    cfg = load_config(["trainer.resume=auto", "trainer.run_name=mine", "trainer.save_every=10"])
    assert cfg.trainer.resume == "auto" and cfg.trainer.save_every == 10


def test_half_written_and_incomplete_checkpoints_are_never_picked(tmp_path):
    from cluster.loop.checkpoint import MANIFEST, STATE_FILE, latest_checkpoint

    folder = tmp_path / "checkpoints"
    assert latest_checkpoint(tmp_path) is None
    for name, complete in [("step-000002", True), ("step-000010", True), (".tmp-step-000020", True),
                           ("step-000030", False), ("step-10", True), ("notes", True)]:
        (folder / name).mkdir(parents=True)
        (folder / name / STATE_FILE).write_text("{}")
        if complete:
            (folder / name / MANIFEST).write_text('{"files": {"%s": 2}}' % STATE_FILE)
    assert latest_checkpoint(tmp_path) == folder / "step-000010"


def test_any_deepspeed_setting_passes_through_merged_over_the_generated_one():
    from learner.engines import deep_merge

    cfg = load_config(["+learner.deepspeed.zero_optimization.offload_optimizer.device=cpu",
                       "+learner.deepspeed.gradient_clipping=0.5"])
    generated = {"gradient_clipping": 1.0, "zero_optimization": {"stage": 2}, "bf16": {"enabled": False}}
    assert deep_merge(generated, cfg.learner.deepspeed) == {
        "gradient_clipping": 0.5, "bf16": {"enabled": False},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    assert generated["zero_optimization"] == {"stage": 2}  # the generated config is not mutated


@pytest.mark.parametrize("overrides, expected", [
    (["+learner.deepspeed.zero_optimization.offload_optimizer.device=gpu"], "must be cpu or nvme"),
    (["+learner.deepspeed.zero_optimization.offload_optimizer.device=cpu", "learner.optimizer=sgd"], "CPU Adam"),
    (["+learner.deepspeed.zero_optimization.offload_optimizer.device=cpu", "learner.zero_stage=0"], "stage 1, 2 or 3"),
    (["+learner.deepspeed.zero_optimization.offload_optimizer.device=nvme"], "nvme_path"),
])
def test_an_offload_deepspeed_cannot_run_is_refused_in_one_line(overrides, expected):
    assert expected in config_error(*overrides)


def test_device_dependent_defaults_resolve_for_cpu_and_gpu():
    cpu = load_config([])
    assert (cpu.rollout.dtype, cpu.rollout.enforce_eager) == ("float32", True)
    gpu = load_config(["rollout.num_gpus_per_worker=2", "rollout.tensor_parallel_size=2"])
    assert (gpu.rollout.dtype, gpu.rollout.enforce_eager) == ("bfloat16", False)
    forced = load_config(["rollout.num_gpus_per_worker=1", "rollout.dtype=float16", "rollout.enforce_eager=true"])
    assert (forced.rollout.dtype, forced.rollout.enforce_eager) == ("float16", True)


@pytest.mark.parametrize("overrides, words", [
    (["rollout.num_gpus_per_worker=1", "rollout.tensor_parallel_size=2"], ["rollout.num_gpus_per_worker=1",
                                                                        "tensor_parallel_size=2"]),
    (["rollout.num_gpus_per_worker=0.5"], ["rollout.num_gpus_per_worker=0.5"]),
    (["learner.num_gpus_per_rank=0.5"], ["learner.num_gpus_per_rank=0.5", "one whole GPU"]),
    (["learner.num_gpus_per_rank=2"], ["learner.num_gpus_per_rank=2"]),
])
def test_gpu_layouts_that_share_a_gpu_are_refused(overrides, words):
    message = config_error(*overrides)
    assert all(w in message for w in words), message



def test_allowed_values_are_declared_once_and_every_default_is_allowed():
    """Each `one_of` field's default is among its choices, the learner's maths checks against
    the same tuples, and every section of the schema checks itself."""
    from dataclasses import fields, is_dataclass

    from common import config as schema
    from learner import grpo

    def sections(node, prefix):
        for f in fields(node):
            value = getattr(node, f.name)
            if is_dataclass(value):
                yield f"{prefix}{f.name}", value
                yield from sections(value, f"{prefix}{f.name}.")

    found = 0
    for name, section in sections(schema.Config(), ""):
        assert isinstance(section, schema.Section), name
        for f in fields(section):
            choices = f.metadata.get("choices")
            if choices is not None:
                found += 1
                assert getattr(section, f.name) in choices, f"{name}.{f.name}"
    assert found >= 15
    assert grpo.LOSS_AGGS is schema.LOSS_AGGS and grpo.KL_ESTIMATORS is schema.KL_ESTIMATORS
    assert set(grpo.GROUP_BASELINES) == set(schema.ADV_ESTIMATORS) - {"gae"}


def test_actors_receive_the_typed_sections():
    """What the driver hands each role is the schema's own dataclass (no dict in between): a key
    added to a section reaches the actor with its type."""
    import inspect

    from common.config import AlgoConfig, LearnerConfig, RewardConfig, RolloutConfig
    from learner.actor import LearnerRank
    from learner.group import LearnerGroup
    from reward.pool import VerifierPool
    from rollout.pool import RolloutPool
    from rollout.worker import GenerationWorker

    def annotation(fn, name):
        return inspect.signature(fn).parameters[name].annotation

    assert {annotation(LearnerGroup.__init__, "cfg"), annotation(LearnerRank.__init__, "cfg")} == {"LearnerConfig"}
    assert {annotation(LearnerGroup.__init__, "algo"), annotation(LearnerRank.__init__, "algo")} == {"AlgoConfig"}
    assert {annotation(RolloutPool.__init__, "rollout_cfg"),
            annotation(GenerationWorker.__init__, "rollout_cfg")} == {"RolloutConfig"}
    assert annotation(VerifierPool.__init__, "settings") == "RewardConfig"
    assert all(isinstance(c, type) for c in (AlgoConfig, LearnerConfig, RewardConfig, RolloutConfig))


def test_min_new_tokens_reaches_training_samples_only():
    from types import SimpleNamespace

    from common.config import RolloutConfig
    from rollout.worker import GenerationWorker

    worker = SimpleNamespace(cfg=RolloutConfig(min_new_tokens=5), format=None)
    assert GenerationWorker.sampling_params(worker, 8, False, 1).min_tokens == 5
    assert GenerationWorker.sampling_params(worker, 1, True, 1).min_tokens == 0  # greedy evaluation
    assert GenerationWorker.sampling_params(worker, 1, False, 1, max_tokens=9).min_tokens == 0  # an episode's turn


def test_a_local_rays_resources_are_checked_before_it_starts(monkeypatch):
    """What a local Ray will have is known before it starts: a shortfall exits at once. With
    GPUs left to Ray's detection only the CPUs are checked early; joining a cluster, nothing."""
    from cluster.cli.checks import check_local_resources

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(ConfigError, match=r"5.5 CPU in all \(the cluster has 2\)"):
        check_local_resources(load_config(["rollout.num_workers=9", "ray.num_cpus=2"]))
    check_local_resources(load_config(["ray.num_cpus=4"]))
    with pytest.raises(ConfigError, match="rollout.num_gpus_per_worker=0"):
        check_local_resources(load_config(["ray.num_gpus=2", "ray.num_cpus=8"]))
    with pytest.raises(ConfigError, match="2 GPU in all"):
        check_local_resources(load_config(["learner.num_gpus_per_rank=1", "ray.num_gpus=0", "ray.num_cpus=8"]))
    check_local_resources(load_config(["learner.num_gpus_per_rank=1", "ray.num_cpus=8"]))  # Ray will count them
    check_local_resources(load_config(["rollout.num_workers=9", "ray.num_cpus=2", "ray.address=10.0.0.1:6379"]))
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    check_local_resources(load_config(["rollout.num_workers=9", "ray.num_cpus=2"]))


def test_a_gpu_cluster_refuses_a_learner_left_on_cpus(monkeypatch):
    """GPUs in the cluster and learner.num_gpus_per_rank=0 would train in fp32 over gloo
    without a word: refused, naming the key. A learner put on CPU-only nodes on purpose (its
    cluster.nodes label on no GPU node) and `grpo eval` (no learner) are let be."""
    from cluster.layout import check_nodes
    from cluster.cli.checks import check_local_resources

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    on_gpus = ["rollout.num_gpus_per_worker=1", "ray.num_cpus=8"]
    with pytest.raises(ConfigError, match=r"have 2 GPUs but learner.num_gpus_per_rank=0") as refused:
        check_local_resources(load_config(on_gpus + ["ray.num_gpus=2"]))
    assert "\n" not in str(refused.value)
    check_local_resources(load_config(on_gpus + ["ray.num_gpus=4", "learner.num_gpus_per_rank=1"]))
    check_local_resources(load_config(on_gpus + ["ray.num_gpus=2"]), ("rollout", "reward"))
    labelled = load_config(["rollout.num_gpus_per_worker=1", "cluster.nodes.learner=train"])
    gpu_node, cpu_node = {"CPU": 8, "GPU": 2}, {"CPU": 8, "train": 1}
    check_nodes(labelled, [{"Alive": True, "Resources": r} for r in (gpu_node, cpu_node)], 2.0, ("rollout", "learner"))
    with pytest.raises(ConfigError, match="learner.num_gpus_per_rank=0"):
        check_nodes(labelled, [{"Alive": True, "Resources": {**gpu_node, "train": 1}}], 2.0, ("rollout", "learner"))


@pytest.mark.parametrize("overrides, seeded", [
    ([], True),  # CPU engines: seeds cost nothing and make a run repeatable
    (["rollout.num_gpus_per_worker=1"], True),  # GPU engines: Model Runner V2 hashes a seed per request
    (["rollout.num_gpus_per_worker=1", "rollout.seeded_sampling=true"], True),
    (["rollout.seeded_sampling=false"], False),
])
def test_seeded_sampling_resolves_by_the_engines_device(overrides, seeded):
    assert load_config(overrides).rollout.seeded_sampling is seeded


def test_seeded_sampling_takes_auto_true_or_false_only():
    with pytest.raises(ConfigError, match="rollout.seeded_sampling must be one of auto, True, False"):
        load_config(["rollout.seeded_sampling=yes"])
    with pytest.raises(ConfigError, match="rollout.seeded_sampling"):
        load_config(["rollout.seeded_sampling=1"])


def test_unseeded_requests_seed_the_engine_once_per_call(monkeypatch):
    """seeded_sampling=false: no request carries a seed; the engine's sampler is seeded once per
    call, from the call's prompt seeds (the same call, the same engine seed). Greedy calls and
    seeded engines leave the seeds alone."""
    from types import SimpleNamespace

    from common.config import RolloutConfig
    from rollout.worker import GenerationWorker, sampling_is_seeded

    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    assert sampling_is_seeded("auto", on_gpu=False) and sampling_is_seeded("auto", on_gpu=True)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")  # V1 on GPUs draws seeded requests one by one
    assert sampling_is_seeded("auto", on_gpu=False) and not sampling_is_seeded("auto", on_gpu=True)
    assert sampling_is_seeded(True, on_gpu=True) and not sampling_is_seeded(False, on_gpu=False)
    calls = []
    llm = SimpleNamespace(collective_rpc=lambda method, args: calls.append((method, args)))
    unseeded, seeded = SimpleNamespace(seeded=False, llm=llm), SimpleNamespace(seeded=True, llm=llm)
    assert GenerationWorker._request_seeds(seeded, [3, 4], False) == [3, 4] and not calls
    assert GenerationWorker._request_seeds(unseeded, [3, 4], True) == [3, 4] and not calls
    assert GenerationWorker._request_seeds(unseeded, [3, 4], False) == [None, None]
    assert GenerationWorker._request_seeds(unseeded, [3, 4], False) == [None, None]
    GenerationWorker._request_seeds(unseeded, [3, 5], False)
    assert [c[0] for c in calls] == ["reseed"] * 3
    assert calls[0] == calls[1] != calls[2]
    assert GenerationWorker.sampling_params(SimpleNamespace(cfg=RolloutConfig(), format=None), 2, False, None).seed is None


def test_an_agent_that_cannot_run_is_refused_before_any_actor(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_agent.py").write_text("def run(client, row, index):\n    return None\nvalue = 3\n")
    cfg = load_config(["rollout.agent=my_agent:run"])
    validate(cfg)
    assert "rollout.agent: cannot import 'no_such_agent'" in config_error("rollout.agent=no_such_agent:run")
    assert "rollout.agent: 'my_agent' has no function 'value'" in config_error("rollout.agent=my_agent:value")
    assert "rollout.agent: 'my_agent' is not of the form module:function" in config_error("rollout.agent=my_agent")
    assert "rollout.agent_concurrency must be at least 1" in config_error("rollout.agent=my_agent:run",
                                                                        "rollout.agent_concurrency=0")
    assert "set one or the other" in config_error("rollout.agent=my_agent:run", "rollout.tools=[calculator]")


def test_lora_settings_resolve_and_refuse_what_cannot_run():
    cfg = load_config(["learner.lora.rank=12"])
    assert cfg.rollout.max_lora_rank == 16  # rounded up to a size vLLM serves
    assert load_config(["learner.lora.rank=12", "learner.lora.push=merged"]).rollout.max_lora_rank == 0
    assert load_config([]).rollout.max_lora_rank == 0
    for overrides, message in [
        (["learner.lora.rank=8", "algo.adv_estimator=gae"], "the critic has no LoRA"),
        (["learner.lora.rank=600"], r"learner.lora.rank=600 exceeds what the engines serve"),
        (["learner.lora.rank=16", "rollout.max_lora_rank=8"], "use learner.lora.push=merged"),
        (["rollout.max_lora_rank=12"], "rollout.max_lora_rank=12"),
        (["learner.lora.rank=8", "rollout.tools=[calculator]"], "single-turn generation only"),
        (["learner.lora.rank=8", "learner.lora.target_modules=[]"], "target_modules is empty"),
        (["learner.lora.rank=8", "learner.lora.dropout=1.0"], r"dropout must be in \[0, 1\)"),
        (["learner.lora.push=full"], "learner.lora.push must be one of adapter, merged"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config(overrides)


def test_lora_targets_must_name_a_layer_no_narrower_than_the_rank(tmp_path):
    from cluster.cli.checks import check_lora_targets, lora_targets
    from data.tiny_model import build_tiny_model

    cfg = load_config([f"model.cache_dir={tmp_path}"])
    folder = str(build_tiny_model(cfg.model, cfg.trainer.seed, False))
    cfg.learner.lora.rank = 8
    every = lora_targets(cfg, folder)
    assert len(every) == 7 * cfg.model.num_layers and not any("lm_head" in n for n in every)
    check_lora_targets(cfg, folder)
    cfg.learner.lora.target_modules = ["q_proj", "v_proj"]
    assert len(lora_targets(cfg, folder)) == 2 * cfg.model.num_layers
    cfg.learner.lora.target_modules = ["nope"]
    with pytest.raises(ConfigError, match=r"names no linear layer"):
        check_lora_targets(cfg, folder)
    cfg.learner.lora.target_modules, cfg.learner.lora.rank = None, cfg.model.hidden_size + 1
    with pytest.raises(ConfigError, match=rf"rank={cfg.model.hidden_size + 1} exceeds the layer"):
        check_lora_targets(cfg, folder)
