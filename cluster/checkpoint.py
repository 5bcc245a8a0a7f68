"""A run's checkpoints: written atomically, found again by `trainer.resume`, exported for HF.

Layout of one checkpoint, `<run>/checkpoints/step-000040/`:

| path | written by | what |
| --- | --- | --- |
| `learner/` | every learner rank | DeepSpeed `save_checkpoint` (model, optimizer shards, RNG per rank) |
| `reference.pt` | learner rank 0 | the frozen reference policy (when beta > 0) |
| `model/` | learner rank 0 | the model's config and tokenizer (what `grpo export` needs besides weights) |
| `trainer_state.json` | the driver, last | step, policy version, prompt sampler position, driver RNGs |

Everything is written under `checkpoints/.tmp-step-000040/` and renamed when complete, so a
process killed mid-write leaves a `.tmp-` folder that is never picked (and is removed by the
next save). The rollout needs no state: its sampling seeds are a function of (seed, step).
"""
from __future__ import annotations

import base64
import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any, Dict, List, Optional

FOLDER = "checkpoints"
STATE_FILE = "trainer_state.json"
_NAME = re.compile(r"^step-(\d{6,})$")


def checkpoint_path(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / FOLDER / f"step-{step:06d}"


def complete_checkpoints(run_dir: Path) -> List[Path]:
    """Complete checkpoints of a run, oldest first (a `.tmp-` folder or one without its
    trainer state is not complete)."""
    folder = Path(run_dir) / FOLDER
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir()
             if (m := _NAME.match(p.name)) and (p / STATE_FILE).is_file()]
    return [p for _, p in sorted(found)]


def latest_checkpoint(run_dir: Path) -> Optional[Path]:
    done = complete_checkpoints(run_dir)
    return done[-1] if done else None


def driver_rng_state() -> Dict[str, Any]:
    """Python, NumPy and torch RNG states of this process, as JSON."""
    import numpy as np
    import torch

    version, internal, gauss = random.getstate()
    np_state = np.random.get_state()
    return {
        "python": [version, list(internal), gauss],
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
    }


def restore_driver_rng(state: Dict[str, Any]) -> None:
    import numpy as np
    import torch

    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), *rest))
    raw = base64.b64decode(state["torch"])
    torch.set_rng_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8))


def save_checkpoint(run_dir: Path, step: int, learner, trainer_state: Dict[str, Any], keep: int) -> Path:
    """Write checkpoint `step` atomically; keep only the newest `keep` (0: all)."""
    final = checkpoint_path(run_dir, step)
    tmp = final.parent / f".tmp-{final.name}"
    for stale in final.parent.glob(".tmp-*") if final.parent.is_dir() else []:
        shutil.rmtree(stale, ignore_errors=True)  # left by a process killed mid-write
    tmp.mkdir(parents=True)
    learner.save_checkpoint(str(tmp))
    state_file = tmp / STATE_FILE
    with state_file.open("w") as handle:
        json.dump({**trainer_state, "rng": driver_rng_state()}, handle)
        handle.flush()
        os.fsync(handle.fileno())
    if final.exists():  # the same step saved again (a resumed run that re-reached it)
        shutil.rmtree(final)
    os.rename(tmp, final)
    if keep > 0:
        for old in complete_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def load_trainer_state(checkpoint: Path) -> Dict[str, Any]:
    return json.loads((Path(checkpoint) / STATE_FILE).read_text())


def export_checkpoint(checkpoint: str, folder: str) -> str:
    """Write checkpoint's policy as a Hugging Face folder (fp32 master weights, config, tokenizer)."""
    ckpt = Path(checkpoint)
    # Checked before torch and transformers are imported: a wrong path answers in well under a
    # second, not after five seconds of imports.
    if not (ckpt / STATE_FILE).is_file() or not (ckpt / "learner").is_dir():
        raise ValueError(f"'{checkpoint}' is not a complete checkpoint (no {STATE_FILE} or learner/)")
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    state = _fp32_state_dict(ckpt / "learner")
    config = AutoConfig.from_pretrained(ckpt / "model")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise ValueError(f"checkpoint does not fit its model config: missing {sorted(set(missing) - tied)}, "
                         f"unexpected {sorted(unexpected)}")
    model.tie_weights()
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(ckpt / "model").save_pretrained(folder)
    return folder


def _fp32_state_dict(learner_dir: Path) -> Dict[str, Any]:
    """Full fp32 weights from a DeepSpeed checkpoint: ZeRO 1-3 shards are merged by DeepSpeed's
    own zero_to_fp32; without ZeRO (stage 0) the model file already holds them."""
    import torch

    tag_dir = learner_dir / "ds"
    if list(tag_dir.glob("*optim_states.pt")) and list(tag_dir.glob("zero_pp_rank_*")):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        return get_fp32_state_dict_from_zero_checkpoint(str(learner_dir), tag="ds")
    states = torch.load(tag_dir / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
    return {k: v.float() for k, v in states["module"].items()}
