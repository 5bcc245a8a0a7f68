"""The run: the training loop and what it drives (the roles started together, batches, the
weight-sync channel, placement, checkpoints, recovery, metrics), imported by the command line
(cluster/cli/) only once a command's input is known good."""
