"""Data preparation, which only the driver runs: prompt sources (the built-in tasks, JSONL and
Parquet files, `datasets` sets) and the sampler that walks them (`datasets.py`), what the
model sees (`prompts.py`: templates, chat templates, stops), tool-using warm-up targets
(`traces.py`) and the built-in model's builder (`tiny_model.py`).

Beside the roles: it imports only common/, and only cluster/ imports it. What a role needs of a
prompt row (`Problem`) lives in common/problem.py.
"""
