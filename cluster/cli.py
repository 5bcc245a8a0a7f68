"""`grpo`: the command line. Bad input exits with status 2 and one line, before any actor starts."""
from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

EXIT_BAD_INPUT = 2


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
    return parser


def _fail(message: str) -> int:
    print(f"grpo: error: {message}", file=sys.stderr)
    return EXIT_BAD_INPUT


EXIT_INTERRUPTED = 130  # what a shell reports for a command stopped by Ctrl-C


def main(argv: Optional[List[str]] = None) -> int:
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 PID` prints where every thread is
    signal.signal(signal.SIGINT, _interrupt)
    try:
        return _main(argv)
    except KeyboardInterrupt:  # the run has already let its actors and Ray go (cluster/train.py)
        print("grpo: interrupted; everything the run started has been stopped", file=sys.stderr)
        return EXIT_INTERRUPTED


def _interrupt(signum, frame) -> None:
    """The first Ctrl-C stops the run cleanly (KeyboardInterrupt, then its clean-up); a second
    one while that clean-up runs exits at once."""
    import signal

    signal.signal(signal.SIGINT, lambda *_: os._exit(EXIT_INTERRUPTED))
    raise KeyboardInterrupt


def _main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    from cluster.compose import ConfigError, compose_config, load_config

    if args.command == "export":
        from cluster.checkpoint import export_checkpoint

        if os.path.exists(args.folder) and os.listdir(args.folder):
            return _fail(f"'{args.folder}' exists and is not empty; pick a new folder")
        try:
            print(export_checkpoint(args.checkpoint, args.folder))
        except ValueError as exc:
            return _fail(str(exc))
        return 0
    if args.command in ("submit", "jobs"):
        return _jobs(args)
    try:
        if args.command == "verify":
            from cluster.verify import VerifyInputError, verify

            try:
                verify(args.verifiers.split(","), args.input, args.output, args.overrides)
            except VerifyInputError as exc:
                return _fail(str(exc))
            return 0
        if getattr(args, "cfg", False):
            from omegaconf import OmegaConf

            load_config(args.overrides)  # an impossible setting fails here, before printing
            print(OmegaConf.to_yaml(compose_config(args.overrides)), end="")
            return 0
        if args.command == "eval":
            if not os.path.isdir(args.model_dir):
                return _fail(f"eval: no such model folder '{args.model_dir}'")
            cfg = load_config(["model=hf", f"model.path={os.path.abspath(args.model_dir)}", *args.overrides])
        else:
            cfg = load_config(args.overrides)
        from cluster.train import train
        from rollout.datasets import DataError

        from learner.group import LearnerError
        from cluster.sync_channel import WeightSyncError
        from rollout.worker import EngineStartError

        try:
            if args.command == "eval":
                from cluster.eval_job import evaluate_model

                evaluate_model(cfg)
                return 0
            train(cfg)
        except DataError as exc:
            return _fail(str(exc))
        except (LearnerError, EngineStartError, WeightSyncError) as exc:  # not bad input: the run failed, and says why
            print(f"grpo: error: {exc}", file=sys.stderr)
            return 1
    except ConfigError as exc:
        return _fail(str(exc))
    return 0


def _jobs(args) -> int:
    """submit / jobs: bad config, an unreachable address, a refused token or an unknown job id
    are bad input (exit 2, one line)."""
    import ray

    from cluster import jobs
    from cluster.compose import ConfigError

    try:
        if args.command == "submit":
            return jobs.submit(args.address, args.overrides, follow=not args.no_follow, submission_id=args.job_id)
        return jobs.jobs_command(args.action, args.job_id, args.address, follow=args.follow)
    except ConfigError as exc:
        return _fail(str(exc))
    except (ConnectionError, RuntimeError, ValueError, ray.exceptions.RayError) as exc:
        # The SDK raises these for an unreachable dashboard, a refused token (AuthenticationError)
        # or an unknown job id; its messages run over several lines.
        first = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        return _fail(f"{args.command}: {first}")


if __name__ == "__main__":
    sys.exit(main())
