"""`python -m cluster.train [--cfg] [overrides...]`: the same as `grpo train`
(cluster/cli/train.py), under the name Ray job entrypoints and scripts use."""
import sys

from cluster.cli.train import main

if __name__ == "__main__":
    sys.exit(main())
