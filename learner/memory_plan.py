"""What one learner rank holds, on paper: bytes of parameters, gradients, optimizer state and the
frozen reference for a model's shape (its config.json) and a layout (ZeRO stage, ranks, dtype,
LoRA, optimizer offload), and what a micro-batch's activations add.

The formula follows what DeepSpeed allocates, not only the ZeRO paper's table:
- parameters: the model in its dtype, whole on every rank below stage 3, 1/R of it at stage 3;
  LoRA adds its adapters (peft keeps them in float32 whatever the base's dtype);
- gradients: of the trained parameters only, in the accumulation dtype (float32 whenever the
  model is 16-bit at stage >= 1, as learner/engines.with_fp32_accumulation sets), 1/R at stage
  >= 2;
- optimizer: AdamW's two float32 moments, and a float32 master copy of the trained parameters
  wherever DeepSpeed keeps one apart from the model's: for a 16-bit model at every stage, at
  stages 1 and 2 for a float32 model as well (they clone the rank's partition whatever its
  dtype; stage 3 steps a float32 model's own partition), and under optimizer offload (the copy
  lives on the host); 1/R at stage >= 1;
  `offload_optimizer` moves it, and the gradient partitions it steps on, to host memory;
- reference: pi_ref, a second copy of the model (sharded like the parameters), none with LoRA
  (the base with its adapters off) or with beta = 0.
A micro-batch adds its activations (`activation_bytes_per_token`) and the log-prob stage's
(learner/logprobs.py): one copy of its logits in the model's dtype, which the backward overwrites
with their gradient, a few float32 chunks of `LOGPROB_CHUNK_ELEMENTS`, and the output head's
weight gradient before ZeRO takes it into its buckets (`logprob_bytes`).
Not counted: DeepSpeed's communication buckets, ZeRO-3's gathered working set (a couple of
transformer blocks), the allocator's slack and the process itself (the report of
bench/memory_scale.py measures them).

    python -m learner.memory_plan --model qwen2.5-7b --gpus 8 --gpu-gb 80
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Dict, Optional, Sequence, Tuple

GB = 1e9
MB = 2**20

LOGPROB_CHUNK_ELEMENTS = 1 << 24
"""Rows of the logits that learner/logprobs.py turns into float32 at once: about this many values
(64 MB), whatever the vocabulary."""
LOGPROB_CHUNK_COPIES = 3
"""Float32 chunks alive at once in learner/logprobs.py: the chunk, its exponent and the
product the entropy sums (or, in the backward, the chunk and its gradient)."""

# Shapes of well-known models (their config.json), for the plan without the weights at hand.
KNOWN_SHAPES = {
    "qwen2.5-0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2.5-7b": dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False),
    "qwen2.5-32b": dict(vocab_size=152064, hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
                        num_attention_heads=40, num_key_value_heads=8, tie_word_embeddings=False),
}


@dataclass(frozen=True)
class ModelShape:
    """A Qwen2/Llama-shaped decoder: biased q, k, v; o, gate, up, down without bias; RMS norms."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    tie_word_embeddings: bool = True

    @classmethod
    def from_config(cls, config: dict) -> "ModelShape":
        heads = config["num_attention_heads"]
        return cls(config["vocab_size"], config["hidden_size"], config["intermediate_size"],
                   config["num_hidden_layers"], heads, config.get("num_key_value_heads") or heads,
                   bool(config.get("tie_word_embeddings", True)))

    @classmethod
    def from_folder(cls, path: str) -> "ModelShape":
        return cls.from_config(json.loads((Path(path) / "config.json").read_text()))

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * (self.hidden_size // self.num_heads)

    def projections(self) -> Dict[str, Tuple[int, int]]:
        """(d_in, d_out) of each linear projection of one block, by its module name."""
        h, kv, i = self.hidden_size, self.kv_size, self.intermediate_size
        return {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    def block_parameters(self) -> int:
        biases = self.hidden_size + 2 * self.kv_size  # q, k and v have biases in Qwen2
        norms = 2 * self.hidden_size
        return sum(a * b for a, b in self.projections().values()) + biases + norms

    def parameters(self) -> int:
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return embeddings + self.num_layers * self.block_parameters() + self.hidden_size  # final norm

    def adapter_parameters(self, rank: int, targets: Optional[Sequence[str]] = None) -> int:
        """LoRA's A (r x d_in) and B (d_out x r) on each targeted projection of every block; None:
        every linear projection of the blocks (peft's `all-linear`, the output head excluded)."""
        chosen = [dims for name, dims in self.projections().items()
                  if targets is None or any(name == t or name.endswith(t) for t in targets)]
        return self.num_layers * sum(rank * (d_in + d_out) for d_in, d_out in chosen)

    def activation_bytes_per_token(self, dtype_bytes: int, checkpointed: bool) -> int:
        """Bytes kept for the backward per token of a micro-batch. Per block: the attention's
        inputs and outputs (residual, its norm, q, k, v, the attention's output: 4h + 2kv, with
        a fused attention that keeps no seq x seq scores) and the SwiGLU MLP's (residual, its
        norm, gate, up, their activation and product: 2h + 4i). Checkpointed, a block keeps
        only its input (h) and one block at a time is recomputed in full."""
        h, kv, i = self.hidden_size, self.kv_size, self.intermediate_size
        block = 6 * h + 2 * kv + 4 * i
        kept = self.num_layers * h + block if checkpointed else self.num_layers * block
        return kept * dtype_bytes

    def logits_bytes(self, tokens: int, dtype_bytes: int) -> int:
        """One copy of a micro-batch's logits in the model's dtype: all that learner/logprobs.py
        keeps of size tokens x vocabulary (its backward writes the gradient over them)."""
        return tokens * self.vocab_size * dtype_bytes

    def logprob_working_bytes(self, tokens: int, dtype_bytes: int) -> int:
        """The log-prob stage's memory besides the logits: float32 chunks of at most
        LOGPROB_CHUNK_ELEMENTS values (fewer when the whole micro-batch is smaller), and the
        output head's weight gradient (vocabulary x hidden in the model's dtype) that autograd
        makes before ZeRO's hook takes it."""
        chunk = min(LOGPROB_CHUNK_ELEMENTS, max(tokens, 1) * self.vocab_size)
        return LOGPROB_CHUNK_COPIES * chunk * 4 + self.vocab_size * self.hidden_size * dtype_bytes

    def micro_batch_bytes(self, tokens: int, dtype_bytes: int, checkpointed: bool) -> int:
        """What a micro-batch of `tokens` adds to a rank at its peak (the backward's start): its
        activations, its logits and the log-prob stage's working memory."""
        return (tokens * self.activation_bytes_per_token(dtype_bytes, checkpointed)
                + self.logits_bytes(tokens, dtype_bytes) + self.logprob_working_bytes(tokens, dtype_bytes))

    def largest_micro_batch(self, room: float, dtype_bytes: int, checkpointed: bool) -> int:
        """The most tokens a micro-batch may hold in `room` bytes (0 when none fits)."""
        per_token = self.activation_bytes_per_token(dtype_bytes, checkpointed) + self.vocab_size * dtype_bytes
        fixed = LOGPROB_CHUNK_COPIES * LOGPROB_CHUNK_ELEMENTS * 4 + self.vocab_size * self.hidden_size * dtype_bytes
        return max(0, int((room - fixed) // per_token))


@dataclass(frozen=True)
class Layout:
    """How the learner trains: what learner.* and algo.beta choose."""
    zero_stage: int = 2
    ranks: int = 2
    dtype_bytes: int = 4
    """2: bf16 (the learner on GPUs); 4: float32 (on CPUs)."""
    lora_rank: int = 0
    lora_targets: Optional[Tuple[str, ...]] = None
    optimizer: str = "adamw"
    offload_optimizer: bool = False
    reference: bool = True
    """A frozen reference is kept (algo.beta > 0)."""
    checkpointed: bool = False


@dataclass(frozen=True)
class RankBytes:
    parameters: float
    gradients: float
    optimizer: float
    reference: float
    offloaded: float
    """Of the gradients and optimizer: the part in host memory instead (optimizer offload)."""

    @property
    def total(self) -> float:
        """On the device (the rank's memory on CPUs, where offloading moves nothing)."""
        return self.parameters + self.gradients + self.optimizer + self.reference - self.offloaded


def per_rank(shape: ModelShape, layout: Layout) -> RankBytes:
    """Bytes one rank holds between steps (gradients at their step-time size)."""
    n, r, stage = shape.parameters(), layout.ranks, layout.zero_stage
    adapters = shape.adapter_parameters(layout.lora_rank, layout.lora_targets) if layout.lora_rank else 0
    trained, trained_bytes = (adapters, 4) if adapters else (n, layout.dtype_bytes)
    sixteen_bit = layout.dtype_bytes == 2
    grad_bytes = 4 if sixteen_bit and stage >= 1 else trained_bytes
    master = 4 if sixteen_bit or stage in (1, 2) or layout.offload_optimizer else 0
    moments = 8 if layout.optimizer == "adamw" else 0
    params_shard, grads_shard, opt_shard = (r if stage >= 3 else 1), (r if stage >= 2 else 1), (r if stage >= 1 else 1)
    gradients = trained * grad_bytes / grads_shard
    optimizer = trained * (master + moments) / opt_shard
    reference = n * layout.dtype_bytes / params_shard if layout.reference and not adapters else 0.0
    return RankBytes(parameters=(n * layout.dtype_bytes + adapters * 4) / params_shard, gradients=gradients,
                     optimizer=optimizer, reference=reference,
                     offloaded=gradients + optimizer if layout.offload_optimizer else 0.0)


def layout_of(learner_cfg, beta: float, on_gpu: bool) -> Layout:
    """The Layout of a run's learner config (learner/engines.py's choices: bf16 on GPUs,
    checkpointing by default on GPUs, `learner.deepspeed` merged over the ZeRO stage)."""
    zero = dict(dict(learner_cfg.deepspeed or {}).get("zero_optimization") or {})
    offload = dict(zero.get("offload_optimizer") or {}).get("device", "none") not in ("none", None)
    lora = learner_cfg.lora
    checkpointed = on_gpu if learner_cfg.gradient_checkpointing is None else bool(learner_cfg.gradient_checkpointing)
    return Layout(zero_stage=int(zero.get("stage", learner_cfg.zero_stage)), ranks=learner_cfg.num_ranks,
                  dtype_bytes=2 if on_gpu else 4, lora_rank=lora.rank,
                  lora_targets=tuple(lora.target_modules) if lora.target_modules else None,
                  optimizer=learner_cfg.optimizer, offload_optimizer=offload, reference=beta > 0,
                  checkpointed=checkpointed)


def describe(shape: ModelShape, layout: Layout, tokens: int = 0) -> str:
    """One line for the run's start: the estimate per rank, and the activations of a micro-batch
    of `tokens` (learner.max_tokens_per_microbatch) when given."""
    b = per_rank(shape, layout)
    parts = [f"parameters {b.parameters / MB:,.0f}", f"gradients {b.gradients / MB:,.0f}",
             f"optimizer {b.optimizer / MB:,.0f}", f"reference {b.reference / MB:,.0f}"]
    line = (f"learner memory per rank (estimate, {shape.parameters() / 1e6:,.1f} M parameters, ZeRO-{layout.zero_stage}"
            f" over {layout.ranks} ranks{f', LoRA r{layout.lora_rank}' if layout.lora_rank else ''}): "
            f"{', '.join(parts)} MB; {b.total / MB:,.0f} MB in all")
    if b.offloaded:
        line += f" on the device, {b.offloaded / MB:,.0f} MB offloaded to host memory"
    if tokens:
        act = tokens * shape.activation_bytes_per_token(layout.dtype_bytes, layout.checkpointed)
        logits = shape.logits_bytes(tokens, layout.dtype_bytes) + shape.logprob_working_bytes(tokens, layout.dtype_bytes)
        line += (f", plus about {act / MB:,.0f} MB of activations and {logits / MB:,.0f} MB of logits and log-prob"
                 f" working memory per {tokens:,}-token micro-batch")
    return line


def logits_past_memory(vocab_size: int, tokens: int, dtype_bytes: int, device_bytes: int) -> Optional[str]:
    """The one-line error for a micro-batch budget whose logits alone (one copy, all that
    learner/logprobs.py keeps) exceed the rank's device memory; None when they fit. On GPUs the
    device is known only once the rank has started."""
    need = tokens * vocab_size * dtype_bytes
    if not tokens or need <= device_bytes:
        return None
    return (f"learner.max_tokens_per_microbatch={tokens:,}: that micro-batch's logits alone ({tokens:,} tokens x "
            f"{vocab_size:,} vocabulary x {dtype_bytes} bytes = {need / GB:.1f} GB) exceed the learner GPU's "
            f"{device_bytes / GB:.1f} GB; at most {device_bytes // (vocab_size * dtype_bytes):,} tokens could fit "
            "(python -m learner.memory_plan sizes it with the model's state)")


def start_line(model_path: str, learner_cfg, beta: float, on_gpu: bool) -> Optional[str]:
    """The run's start-of-run line for its model folder; None when its config.json is not a
    decoder this formula knows (the run goes on without the estimate)."""
    try:
        shape = ModelShape.from_folder(model_path)
    except (OSError, KeyError, ValueError):
        return None
    return describe(shape, layout_of(learner_cfg, beta, on_gpu), learner_cfg.max_tokens_per_microbatch)


LAYOUTS = {
    "ZeRO-2": Layout(zero_stage=2),
    "ZeRO-3": Layout(zero_stage=3),
    "ZeRO-3 + GC": Layout(zero_stage=3, checkpointed=True),
    "ZeRO-3 + LoRA r16": Layout(zero_stage=3, lora_rank=16, checkpointed=True),
    "ZeRO-3 + offload": Layout(zero_stage=3, offload_optimizer=True, checkpointed=True),
}
"""The layouts of the plan's table (checkpointing on with LoRA and offload, as on GPUs by default)."""


def plan_rows(shape: ModelShape, gpus: int, gpu_gb: float, tokens: int, dtype_bytes: int = 2):
    """For each layout: (name, RankBytes, activation bytes of a `tokens` micro-batch, its logits
    and log-prob working bytes, GB left on each GPU after all of them, the largest micro-batch in
    tokens that fits)."""
    rows = []
    for name, layout in LAYOUTS.items():
        layout = replace(layout, ranks=gpus, dtype_bytes=dtype_bytes)
        b = per_rank(shape, layout)
        act = tokens * shape.activation_bytes_per_token(dtype_bytes, layout.checkpointed)
        logits = shape.logits_bytes(tokens, dtype_bytes) + shape.logprob_working_bytes(tokens, dtype_bytes)
        room = gpu_gb * GB - b.total
        rows.append((name, b, act, logits, (room - act - logits) / GB,
                     shape.largest_micro_batch(room, dtype_bytes, layout.checkpointed)))
    return rows


def plan_table(model: str, gpus: int, gpu_gb: float, tokens: int) -> str:
    shape = ModelShape.from_config(KNOWN_SHAPES[model]) if model in KNOWN_SHAPES else ModelShape.from_folder(model)
    head = (f"{model}: {shape.parameters() / 1e9:.2f} B parameters, bf16, AdamW, {gpus} x {gpu_gb:g} GB, "
            f"micro-batch {tokens:,} tokens (GB per GPU)\n\n"
            "| layout | parameters | gradients | optimizer | reference | model state | activations | logits "
            "| left | fits | largest micro-batch (tokens) |\n"
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    lines = [head]
    for name, b, act, logits, left, largest in plan_rows(shape, gpus, gpu_gb, tokens):
        off = f" (+{b.offloaded / GB:.1f} on host)" if b.offloaded else ""
        lines.append(f"| {name} | {b.parameters / GB:.1f} | {b.gradients / GB:.1f} | {b.optimizer / GB:.1f}{off} "
                     f"| {b.reference / GB:.1f} | {b.total / GB:.1f} | {act / GB:.1f} | {logits / GB:.1f} | {left:.1f} "
                     f"| {'yes' if left >= 0 else 'no'} | {largest:,} |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description="Per-GPU memory of each learner layout, on paper.")
    parser.add_argument("--model", default="qwen2.5-7b", help=f"{', '.join(KNOWN_SHAPES)} or a model folder")
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--gpu-gb", type=float, default=80.0)
    parser.add_argument("--tokens", type=int, default=16384, help="tokens per micro-batch")
    args = parser.parse_args(argv)
    print(plan_table(args.model, args.gpus, args.gpu_gb, args.tokens))


if __name__ == "__main__":
    main()
