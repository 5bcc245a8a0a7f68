"""`grpo`: the command line. Bad input exits with status 2 and one line, before any actor starts."""
from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

from cluster.cli import evaluate, jobs, train
from cluster.cli.exits import EXIT_BAD_INPUT, fail, guarded
from cluster.cli.verify import VerifyInputError, verify
from common.config import ConfigError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line and status 2, like every other bad input
        self.exit(EXIT_BAD_INPUT, f"grpo: error: {message} (see grpo --help)\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="grpo", description="Distributed GRPO training on Ray.")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="run a GRPO training job (Hydra-style overrides: a.b=1 group=option)")
    train.add_argument("--cfg", action="store_true", help="print the composed config and exit")
    train.add_argument("overrides", nargs="*", help="e.g. trainer.max_steps=10 logger=none +reward.weights.x=1")
    evaluate = sub.add_parser("eval", help="evaluate a saved model (greedy, pass@k, maj@k) without training")
    evaluate.add_argument("model_dir", help="a Hugging Face model folder, e.g. runs/<name>/final_model")
    evaluate.add_argument("overrides", nargs="*", help="e.g. eval.n=8 data=jsonl data.eval_path=test.jsonl")
    verify = sub.add_parser("verify", help="score a JSONL file of completions with the verifier pool")
    verify.add_argument("--verifiers", required=True, help="comma-separated, e.g. math,format or code")
    verify.add_argument("--input", required=True, help="JSONL rows {prompt, completion, answer[, tests]}")
    verify.add_argument("--output", required=True, help="JSONL: each input row plus scores, reward, timed_out")
    verify.add_argument("overrides", nargs="*", help="reward.* settings, e.g. reward.timeout_s=2")
    submit = sub.add_parser("submit", help="submit `grpo train` as a Ray job to a cluster and follow its logs")
    submit.add_argument("--address", default=None,
                        help="the cluster's dashboard, e.g. http://HEAD:8265 (default: RAY_API_SERVER_ADDRESS "
                             "or http://127.0.0.1:8265)")
    submit.add_argument("--no-follow", action="store_true", help="print the job id and return")
    submit.add_argument("--job-id", default=None, help="a submission id of your own (must be new)")
    submit.add_argument("overrides", nargs="*", help="the same overrides as grpo train")
    jobs = sub.add_parser("jobs", help="status, logs or stop of a submitted job")
    jobs.add_argument("action", choices=["status", "logs", "stop"])
    jobs.add_argument("job_id")
    jobs.add_argument("--address", default=None, help="the cluster's dashboard (as for submit)")
    jobs.add_argument("--follow", action="store_true", help="logs: stream until the job ends")
    export = sub.add_parser("export", help="write a checkpoint's policy as a Hugging Face folder")
    export.add_argument("checkpoint", help="a runs/<name>/checkpoints/step-N folder")
    export.add_argument("folder", help="where to write config.json, model.safetensors and the tokenizer")
    export.add_argument("--merged", action="store_true",
                        help="a LoRA checkpoint: the model with its adapters merged in (default: the adapter folder)")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    return guarded(lambda: _run(args))


def _run(args) -> int:
    """The chosen command (errors become statuses in cluster/cli/exits.py)."""
    if args.command == "train":
        return train.command(args.overrides, print_config=args.cfg)
    if args.command == "eval":
        return evaluate.command(args.model_dir, args.overrides)
    if args.command == "verify":
        try:
            verify(args.verifiers.split(","), args.input, args.output, args.overrides)
        except VerifyInputError as exc:
            return fail(str(exc))
        return 0
    if args.command == "export":
        return _export(args)
    return _jobs(args)


def _export(args) -> int:
    # The checkpoint's modules (torch's) only for this command.
    from cluster.loop.checkpoint import export_checkpoint

    if os.path.exists(args.folder) and os.listdir(args.folder):
        return fail(f"'{args.folder}' exists and is not empty; pick a new folder")
    try:
        print(export_checkpoint(args.checkpoint, args.folder, args.merged))
    except ValueError as exc:
        return fail(str(exc))
    return 0


def _jobs(args) -> int:
    """submit / jobs: bad config, an unreachable address, a refused token or an unknown job id
    are bad input (exit 2, one line)."""
    import ray  # for its error types: the other commands answer without Ray's import

    try:
        if args.command == "submit":
            return jobs.submit(args.address, args.overrides, follow=not args.no_follow, submission_id=args.job_id)
        return jobs.jobs_command(args.action, args.job_id, args.address, follow=args.follow)
    except ConfigError:
        raise  # already one line naming the key (cluster/cli/exits.py prints it)
    except (ConnectionError, RuntimeError, ValueError, ray.exceptions.RayError) as exc:
        # The SDK raises these for an unreachable dashboard, a refused token (AuthenticationError)
        # or an unknown job id; its messages run over several lines.
        first = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        return fail(f"{args.command}: {first}")


if __name__ == "__main__":
    sys.exit(main())
