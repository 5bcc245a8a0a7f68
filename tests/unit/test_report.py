"""report.png: one panel per question the run's metrics can answer, none left empty."""
from __future__ import annotations

import json
import struct

from cluster.loop.report import PANELS, panel_series, write_report

SINGLE_TURN = {"reward_mean": 0.5, "score/math": 0.4, "score/format": 0.1, "accuracy": 0.5, "kl": 0.01,
               "entropy": 1.2, "clip_fraction": 0.0, "ratio_mean": 1.0, "ratio_max": 1.1,
               "advantage_abs_mean": 0.7, "response_length_mean": 9.0, "truncated_fraction": 0.0,
               "lr": 1e-4, "grad_norm": 0.3, "time_step": 2.5, "time_generate": 1.1, "time_reward": 0.0,
               "time_train": 1.3, "time_weight_sync": 0.05, "tokens_per_s": 3000.0,
               "generate_tokens_per_s": 7000.0, "sync_gbps": 0.3, "buffer_groups": 0, "batches_ahead": 0,
               "staleness_max": 0, "dropped_stale": 0, "actor_restarts": 0, "reward_timeouts": 0,
               "reward_errors": 0, "sampler_logprob_gap": 0.01, "mismatch_k3": 1e-4, "mismatch_chi2": 2e-4,
               "masked_fraction_mis": 0.0, "masked_fraction_icepop": 0.0, "masked_fraction_seq_mask": 0.1,
               "is_capped_fraction": 0.0, "tokens_version_lag/0": 9000.0, "padded_fraction": 0.2}
TOOLS = {"turns_mean": 2.0, "tool_calls_mean": 1.0, "observation_token_fraction": 0.2, "tool_errors": 0.0,
         "tool_timeouts": 0.0, "time_tools": 0.1, "time_tools_blocking": 0.0}
TOOL_PANELS = {"tool use per episode", "tool failures and time (s)"}


def _rows(extra=None, steps=3):
    return [{"step": s, **SINGLE_TURN, **(extra or {})} for s in range(1, steps + 1)]


def _png_size(path):
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", header[16:24])


def test_a_run_without_tools_gets_no_tool_panels():
    titles = [title for title, _ in panel_series(_rows())]
    assert titles == [title for title, _ in PANELS if title not in TOOL_PANELS]
    with_tools = [title for title, _ in panel_series(_rows(TOOLS))]
    assert with_tools == [title for title, _ in PANELS]


def test_each_panel_holds_the_curves_its_metrics_logged():
    series = dict(panel_series(_rows(), heldout_before=0.6, heldout_after=0.9))
    assert set(series["reward per verifier"]) == {"reward_mean", "score/format", "score/math"}
    assert series["KL to reference"] == {"kl": [(1, 0.01), (2, 0.01), (3, 0.01)]}
    # held-out accuracy: before GRPO at step 0, the final evaluation at the last step
    assert series["accuracy"]["heldout_accuracy"] == [(0, 0.6), (3, 0.9)]
    rows = _rows()
    rows[1]["heldout_accuracy"] = 0.7
    assert dict(panel_series(rows, 0.6, 0.9))["accuracy"]["heldout_accuracy"] == [(0, 0.6), (2, 0.7), (3, 0.9)]


def test_the_figure_has_a_row_of_panels_per_four_that_have_data(tmp_path):
    sizes = {}
    few = [{"step": s, "reward_mean": 0.5, "kl": 0.01, "lr": 1e-4} for s in (1, 2)]  # 3 panels
    for name, rows in (("plain", _rows()), ("tools", _rows(TOOLS)), ("few", few), ("empty", [])):
        run_dir = tmp_path / name
        run_dir.mkdir()
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        sizes[name] = _png_size(write_report(run_dir, 0.6, 0.9))
    # 18 panels (5 rows) without tools, 20 (5 rows) with them, 3 in one row, at 300 px a row; a
    # log without steps still gets a figure (the held-out accuracy before and after) rather than an error
    assert sizes["plain"] == sizes["tools"] == (1800, 1500)
    assert sizes["few"] == sizes["empty"] == (1800, 300)
