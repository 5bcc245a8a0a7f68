"""The ground floor: what every role shares, importing no role.

The prompt-group record that travels through the object store, the config schema, the
weight-sync wire protocol, chunked dispatch over a pool of actors, Ray helpers and the
reading of an answer out of text. `rollout/`, `learner/` and `reward/` import only this;
`cluster/` (the driver and CLI) imports the roles. The import contract in setup.cfg
enforces it (tests/unit/test_layers.py runs it).
"""
