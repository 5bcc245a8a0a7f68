"""learner/memory_plan.py's per-GPU table for the docs' models, written as a result file that
docs/performance.md's tables are rendered from (the plan is computed, not measured: the host and
load fields only say where it was computed).

    .venv/bin/python bench/plan_tables.py --models qwen2.5-7b qwen2.5-32b --gpus 8 --gpu-gb 80 --tokens 16384
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def rows(model: str, gpus: int, gpu_gb: float, tokens: int) -> dict:
    from learner.memory_plan import GB, KNOWN_SHAPES, ModelShape, plan_rows

    shape = ModelShape.from_config(KNOWN_SHAPES[model]) if model in KNOWN_SHAPES else ModelShape.from_folder(model)
    return {"model": model, "parameters": shape.parameters(), "gpus": gpus, "gpu_gb": gpu_gb, "tokens": tokens,
            "dtype": "bf16", "optimizer": "adamw",
            "rows": [{"layout": name, "parameters_gb": b.parameters / GB, "gradients_gb": b.gradients / GB,
                      "optimizer_gb": b.optimizer / GB, "offloaded_gb": b.offloaded / GB,
                      "reference_gb": b.reference / GB, "model_state_gb": b.total / GB, "activations_gb": act / GB,
                      "logits_gb": logits / GB, "left_gb": left, "fits": left >= 0,
                      "largest_micro_batch_tokens": largest}
                     for name, b, act, logits, left, largest in plan_rows(shape, gpus, gpu_gb, tokens)]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["qwen2.5-7b", "qwen2.5-32b"])
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--gpu-gb", type=float, default=80.0)
    parser.add_argument("--tokens", type=int, default=16384, help="tokens per micro-batch")
    parser.add_argument("--output", default=None, help="the result file (default bench/results/memory_plan.json)")
    args = parser.parse_args()
    from bench.results_io import Result
    from learner.memory_plan import plan_table

    result = Result("memory_plan")
    for model in args.models:
        print(plan_table(model, args.gpus, args.gpu_gb, args.tokens) + "\n")
        result.add_run(rows(model, args.gpus, args.gpu_gb, args.tokens))
    summary = {run["model"]: {r["layout"]: {"fits": r["fits"], "largest_micro_batch_tokens": r["largest_micro_batch_tokens"]}
                              for r in run["rows"]} for run in result.record["runs"]}
    result.write(summary, path=Path(args.output) if args.output else None)


if __name__ == "__main__":
    main()
