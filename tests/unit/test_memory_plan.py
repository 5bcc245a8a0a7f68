"""learner/memory_plan.py against numbers worked by hand."""
import json

import pytest

from common.config import LearnerConfig, LoraConfig
from learner.memory_plan import KNOWN_SHAPES, Layout, ModelShape, describe, layout_of, per_rank, start_line

# h = 8, 2 heads of 4, 1 KV head (kv = 4), MLP 16, 2 layers, vocabulary 10, tied.
TINY = ModelShape(vocab_size=10, hidden_size=8, intermediate_size=16, num_layers=2, num_heads=2, num_kv_heads=1)
# Per block: q 64 + k 32 + v 32 + o 64 + gate 128 + up 128 + down 128 = 576 weights, biases 8 + 4 + 4,
# norms 16: 608. Model: embedding 80 + 2 x 608 + final norm 8 = 1304.
N = 1304


def test_parameters_by_hand():
    assert TINY.block_parameters() == 608
    assert TINY.parameters() == N
    untied = ModelShape(10, 8, 16, 2, 2, 1, tie_word_embeddings=False)
    assert untied.parameters() == N + 80


def test_parameters_of_a_real_model():
    # Qwen2.5-0.5B's safetensors hold 494,032,768 parameters (tied head).
    assert ModelShape.from_config(KNOWN_SHAPES["qwen2.5-0.5b"]).parameters() == 494_032_768


def test_adapters_by_hand():
    # r = 2: q 2(8+8) + k 2(8+4) + v 24 + o 32 + gate 2(8+16) + up 48 + down 48 = 256 per block.
    assert TINY.adapter_parameters(2) == 2 * 256
    assert TINY.adapter_parameters(2, ["q_proj", "v_proj"]) == 2 * (32 + 24)


def test_zero2_fp32_adamw_two_ranks():
    # Parameters 4 N whole; gradients 4 N / 2; float32 master + two moments 12 N / 2; reference 4 N.
    b = per_rank(TINY, Layout(zero_stage=2, ranks=2, dtype_bytes=4))
    assert (b.parameters, b.gradients, b.optimizer, b.reference) == (4 * N, 2 * N, 6 * N, 4 * N)
    assert b.total == 16 * N


def test_zero3_fp32_adamw_two_ranks():
    # Stage 3 steps a float32 model's own partition (no master copy): (4 + 4 + 8 + 4) N / 2 = 10 N,
    # 62.5% of ZeRO-2's 16 N.
    b = per_rank(TINY, Layout(zero_stage=3, ranks=2, dtype_bytes=4))
    assert (b.parameters, b.gradients, b.optimizer, b.reference) == (2 * N, 2 * N, 4 * N, 2 * N)
    assert b.total == 10 * N


def test_stage0_fp32_has_no_master_copy_and_bf16_accumulates_in_fp32():
    b = per_rank(TINY, Layout(zero_stage=0, ranks=2, dtype_bytes=4))
    assert (b.parameters, b.gradients, b.optimizer, b.reference) == (4 * N, 4 * N, 8 * N, 4 * N)
    # bf16 ZeRO-3 on 4 GPUs: parameters 2 N / 4, float32 gradients 4 N / 4, 12 N / 4, reference 2 N / 4.
    b = per_rank(TINY, Layout(zero_stage=3, ranks=4, dtype_bytes=2))
    assert (b.parameters, b.gradients, b.optimizer, b.reference) == (N / 2, N, 3 * N, N / 2)


def test_lora_trains_only_adapters_and_keeps_no_reference():
    a = 2 * 256
    b = per_rank(TINY, Layout(zero_stage=3, ranks=2, dtype_bytes=2, lora_rank=2))
    assert b.parameters == (2 * N + 4 * a) / 2  # the base in bf16, the adapters in float32
    assert (b.gradients, b.optimizer, b.reference) == (4 * a / 2, 12 * a / 2, 0)


def test_offload_moves_gradients_and_optimizer_to_host():
    # The master copy comes back with offload: it is what the host-side optimizer steps.
    b = per_rank(TINY, Layout(zero_stage=3, ranks=2, dtype_bytes=4, offload_optimizer=True))
    assert b.offloaded == 2 * N + 6 * N
    assert b.total == 2 * N + 2 * N  # parameters and reference stay


def test_activations_by_hand():
    # Per block 6 h + 2 kv + 4 i = 48 + 8 + 64 = 120 values; checkpointed: 2 inputs + one block.
    assert TINY.activation_bytes_per_token(4, checkpointed=False) == 4 * 240
    assert TINY.activation_bytes_per_token(4, checkpointed=True) == 4 * (16 + 120)


def test_logits_by_hand():
    # One copy of 100 tokens' logits over 10 entries in bf16: 2,000 bytes. Working memory: three
    # float32 chunks, here the whole 1,000 values (under LOGPROB_CHUNK_ELEMENTS), and the head's
    # weight gradient, 10 x 8 in bf16.
    assert TINY.logits_bytes(100, 2) == 2000
    assert TINY.logprob_working_bytes(100, 2) == 3 * 1000 * 4 + 160
    assert TINY.micro_batch_bytes(100, 2, False) == 100 * 2 * 240 + 2000 + 12000 + 160


def test_logits_bound_a_real_vocabulary_micro_batch():
    # Qwen2.5-7B, bf16, 16,384 tokens: 16,384 x 152,064 x 2 = 4.98 GB of logits, chunks capped at
    # 3 x 64 MiB of float32, the head's gradient 152,064 x 3,584 x 2.
    from learner.memory_plan import LOGPROB_CHUNK_ELEMENTS

    shape = ModelShape.from_config(KNOWN_SHAPES["qwen2.5-7b"])
    assert shape.logits_bytes(16384, 2) == 16384 * 152064 * 2
    assert shape.logprob_working_bytes(16384, 2) == 3 * LOGPROB_CHUNK_ELEMENTS * 4 + 152064 * 3584 * 2
    room = 50e9
    largest = shape.largest_micro_batch(room, 2, checkpointed=True)
    assert shape.micro_batch_bytes(largest, 2, True) <= room < shape.micro_batch_bytes(largest + 1, 2, True)


def test_a_micro_batch_whose_logits_alone_pass_the_gpu_is_named_in_one_line():
    from learner.memory_plan import logits_past_memory

    # 131,072 tokens x 152,064 x 2 bytes = 39.9 GB against a 24 GB GPU: at most 78,914 tokens.
    error = logits_past_memory(152064, 131072, 2, 24 * 10**9)
    assert "\n" not in error and "39.9 GB" in error and "at most 78,914 tokens" in error
    assert logits_past_memory(152064, 16384, 2, 80 * 10**9) is None
    assert logits_past_memory(152064, 0, 2, 1) is None  # 0: the whole minibatch, sized elsewhere


def test_logprobs_chunks_are_the_plans():
    import learner.logprobs as lp
    from learner.memory_plan import LOGPROB_CHUNK_ELEMENTS

    assert lp.CHUNK_ELEMENTS == LOGPROB_CHUNK_ELEMENTS


def test_layout_of_a_config():
    cfg = LearnerConfig(num_ranks=4, zero_stage=2, lora=LoraConfig(rank=8, target_modules=["q_proj"]),
                        deepspeed={"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}})
    layout = layout_of(cfg, beta=0.04, on_gpu=True)
    assert layout == Layout(zero_stage=3, ranks=4, dtype_bytes=2, lora_rank=8, lora_targets=("q_proj",),
                            offload_optimizer=True, reference=True, checkpointed=True)
    assert layout_of(LearnerConfig(), beta=0.0, on_gpu=False) == Layout(reference=False)


def test_start_line_reads_the_model_folder(tmp_path):
    config = {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 2,
              "num_attention_heads": 2, "num_key_value_heads": 1, "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(config))
    line = start_line(str(tmp_path), LearnerConfig(zero_stage=3), beta=0.04, on_gpu=False)
    assert line == describe(TINY, Layout(zero_stage=3), tokens=4096)
    assert "ZeRO-3 over 2 ranks" in line and "log-prob working memory per 4,096-token micro-batch" in line
    assert start_line(str(tmp_path / "missing"), LearnerConfig(), 0.04, False) is None


@pytest.mark.parametrize("model", ["qwen2.5-7b", "qwen2.5-32b"])
def test_plan_table_lists_every_layout(model, capsys):
    from learner.memory_plan import LAYOUTS, main

    main(["--model", model, "--gpus", "8", "--gpu-gb", "80"])
    out = capsys.readouterr().out
    assert all(f"| {name} |" in out for name in LAYOUTS)


def test_freed_memory_is_returned_by_default_only_for_zero3_ranks_on_cpus(monkeypatch):
    from learner.peak_memory import RETURN_FREED_MEMORY, allocator_env

    for name in RETURN_FREED_MEMORY:
        monkeypatch.delenv(name, raising=False)
    assert allocator_env(LearnerConfig(zero_stage=3)) == RETURN_FREED_MEMORY
    assert allocator_env(LearnerConfig(zero_stage=2)) == {}
    assert allocator_env(LearnerConfig(zero_stage=3, num_gpus_per_rank=1)) == {}
    assert allocator_env(LearnerConfig(zero_stage=2, return_freed_memory=True)) == RETURN_FREED_MEMORY
    assert allocator_env(LearnerConfig(zero_stage=3, return_freed_memory=False)) == {}
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")  # the user's own choice wins
    assert "MALLOC_MMAP_THRESHOLD_" not in allocator_env(LearnerConfig(zero_stage=3))


def test_the_users_glibc_tunables_are_kept_and_get_huge_pages(monkeypatch):
    from learner.peak_memory import allocator_env

    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")
    assert allocator_env(LearnerConfig(zero_stage=3))["GLIBC_TUNABLES"] == (
        "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.hugetlb=0")
    assert "GLIBC_TUNABLES" not in allocator_env(LearnerConfig(zero_stage=3))


def test_a_ranks_environment_is_merged_into_its_actor_options():
    from learner.group import _with_env

    placed = {"scheduling_strategy": "bundle 0", "runtime_env": {"env_vars": {"A": "1"}, "pip": ["x"]}}
    assert _with_env(placed, {"B": "2"}) == {"scheduling_strategy": "bundle 0",
                                              "runtime_env": {"env_vars": {"A": "1", "B": "2"}, "pip": ["x"]}}
    assert _with_env(placed, {}) is placed and "B" not in placed["runtime_env"]["env_vars"]
