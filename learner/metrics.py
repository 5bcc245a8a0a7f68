"""How the metrics of the parts of a step (micro-batches, minibatches, ranks) add up to the step's.

No torch at import: the driver combines the ranks' metrics (learner/group.py).
"""
from __future__ import annotations

import functools
from typing import Dict, Sequence

# Metrics that are means over the completion tokens in the loss. Parts of a step (micro-batches,
# minibatches, ranks) are combined weighted by their tokens, so these do not depend on how the
# batch is cut: a plain mean over micro-batches cut by length gave the few longest completions,
# alone in the last micro-batch, as much weight as all the others (the default job's entropy
# read well above its token mean: bench/token_means.py).
TOKEN_MEANS = ("kl", "clip_fraction", "ratio_mean", "entropy", "is_weight_mean", "is_capped_fraction",
               "sampler_logprob_gap", "value_loss", "value_clip_fraction", "value_mean",
               "mismatch_k3", "mismatch_chi2", "masked_fraction_mis", "masked_fraction_icepop",
               "masked_fraction_seq_mask")
# The step's largest: the largest ratio, and the slowest and most memory-hungry rank (the one a
# user sizes for).
LARGEST = ("ratio_max", "learner_seconds", "learner_peak_memory_mb")


def _largest(values: Sequence):
    if all(isinstance(v, (int, float)) for v in values):
        return max(values)
    import torch  # 0-dim tensors, kept on the device: no read back here

    return functools.reduce(torch.maximum, values)


def combine_metrics(parts: Sequence[Dict[str, object]]) -> Dict[str, object]:
    """The metrics of several parts of a step (its minibatches; the ranks' shares) as one: the
    TOKEN_MEANS weighted by each part's `loss_tokens`, the LARGEST the largest, `loss_tokens`
    summed, anything else a plain mean (the loss, the grad norm and lr, which every rank shares,
    and the means over completions, of which every part holds as many). Values may be floats or
    0-dim tensors (kept on the device)."""
    tokens = [p.get("loss_tokens", 0.0) for p in parts]
    total = sum(tokens)
    # A part without tokens counts as nothing; when no part has any, every part counts alike.
    shares = [t / total for t in tokens] if float(total) > 0 else [1.0 / len(parts)] * len(parts)
    out: Dict[str, object] = {}
    for key in parts[0]:
        values = [p[key] for p in parts]
        if key in LARGEST:
            out[key] = _largest(values)
        elif key == "loss_tokens":
            out[key] = total
        elif key in TOKEN_MEANS:
            out[key] = sum(s * v for s, v in zip(shares, values))
        else:
            out[key] = sum(values) / len(values)
    return out


VERSION_TOKENS = "version_tokens/"


def version_token_metrics(parts: Sequence[Dict[str, object]]):
    """The ranks' `version_tokens/<v>` counts (tokens sampled by policy version v; each rank
    has its own versions) taken out of their metrics and summed; returns (the parts without
    them, the step's `tokens_version_lag/<k>`: the tokens sampled k versions before the newest
    of the step, and `version_spread`: newest minus oldest)."""
    totals: Dict[int, float] = {}
    rest = []
    for part in parts:
        rest.append({k: v for k, v in part.items() if not k.startswith(VERSION_TOKENS)})
        for key, value in part.items():
            if key.startswith(VERSION_TOKENS):
                version = int(key[len(VERSION_TOKENS):])
                totals[version] = totals.get(version, 0.0) + float(value)
    if not totals:
        return rest, {}
    newest = max(totals)
    out = {f"tokens_version_lag/{newest - v}": n for v, n in sorted(totals.items(), reverse=True)}
    out["version_spread"] = float(newest - min(totals))
    return rest, out
