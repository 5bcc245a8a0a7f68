"""A run's checkpoints: written atomically, found again by `trainer.resume`, exported for HF.

Layout of one checkpoint, `<run>/checkpoints/step-000040/`:

| path | written by | what |
| --- | --- | --- |
| `learner/` | every learner rank | DeepSpeed `save_checkpoint` (model, optimizer shards, RNG per rank) |
| `reference/` | learner rank 0 | the frozen reference policy (when beta > 0; not with LoRA), sharded safetensors written a block at a time (common/state_files.py) |
| `base/`, `adapter/` | learner rank 0 | with LoRA: the frozen base (also the reference), as `reference/`, and the adapter folder; `learner/` then holds only the adapters and their optimizer |
| `model/` | learner rank 0 | the model's config and tokenizer (what `grpo export` needs besides weights) |
| `trainer_state.json` | the driver | step, policy version, prompt sampler position, driver RNGs |
| `ahead_batches.pkl` | the driver, async mode | the scored batches made ahead of the learner (cluster/loop/batches.py) |
| `manifest.json` | the driver, last | every other file's path and size |

Everything is written under `checkpoints/.tmp-step-000040/`, synced, given its manifest and
renamed when complete. A checkpoint is complete only when its manifest is there and every file
it lists has its size, so a process killed mid-write (or a disk that filled) leaves a folder
that is never picked, and `trainer.resume=auto` says in one line which one it skipped and why.
Saving a step that already has a checkpoint (a resumed run that re-reached it) moves the old
folder aside to `.old-step-000040` before the new one is renamed in, and deletes it only then:
a kill in between leaves the old one, which is still picked. Leftovers are cleared by the next
save. The rollout needs no other state: its sampling seeds are a function of (seed, step).
"""
from __future__ import annotations

import base64
import json
import os
import random
import re
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

from common import state_files
from common.errors import RunFailed
from common.messages import STATE_FILE, TrainerState

FOLDER = "checkpoints"
MANIFEST = "manifest.json"
_NAME = re.compile(r"^(\.old-|\.tmp-)?step-(\d{6,})$")


class CheckpointError(RunFailed):
    """A checkpoint that could not be written; the message says which one is the last complete."""


def checkpoint_path(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / FOLDER / f"step-{step:06d}"


def checkpoint_problem(folder: Path) -> Optional[str]:
    """None if `folder` is a complete checkpoint, else why not (one phrase)."""
    folder = Path(folder)
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except FileNotFoundError:
        return f"no {MANIFEST}: its write did not finish"
    except (OSError, ValueError) as exc:
        return f"unreadable {MANIFEST} ({type(exc).__name__})"
    for name, size in manifest.get("files", {}).items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes, the manifest says {size}"
    if STATE_FILE not in manifest.get("files", {}):
        return f"no {STATE_FILE}"
    return None


def scan_checkpoints(run_dir: Path) -> Tuple[List[Path], List[Tuple[Path, str]]]:
    """(complete checkpoints oldest first, [(incomplete folder, why)]). Per step, `step-N` is
    taken when complete, else the `.old-step-N` a re-save moved aside when that one is; a
    `.tmp-step-N` is a write that never finished."""
    folder = Path(run_dir) / FOLDER
    if not folder.is_dir():
        return [], []
    steps: Dict[int, Dict[str, Path]] = {}
    for path in folder.iterdir():
        if (m := _NAME.match(path.name)) and path.is_dir():
            steps.setdefault(int(m.group(2)), {})[m.group(1) or ""] = path
    complete, skipped = [], []
    for step in sorted(steps):
        if ".tmp-" in steps[step]:
            skipped.append((steps[step][".tmp-"], "its write did not finish"))
        for kind in ("", ".old-"):
            path = steps[step].get(kind)
            problem = checkpoint_problem(path) if path is not None else "absent"
            if problem is None:
                complete.append(path)
                break
            if path is not None:
                skipped.append((path, problem))
    return complete, skipped


def complete_checkpoints(run_dir: Path) -> List[Path]:
    """Complete checkpoints of a run, oldest first (a `.tmp-` folder, or one whose manifest is
    missing or does not match its files, is not complete)."""
    return scan_checkpoints(run_dir)[0]


def latest_checkpoint(run_dir: Path) -> Optional[Path]:
    done = complete_checkpoints(run_dir)
    return done[-1] if done else None


def skipped_line(run_dir: Path) -> Optional[str]:
    """One line about the checkpoints newer than the latest complete one that are not complete
    (None when there are none)."""
    complete, skipped = scan_checkpoints(run_dir)
    newest = _step(complete[-1]) if complete else -1
    newer = [(p, why) for p, why in skipped if _step(p) > newest]
    if not newer:
        return None
    path, why = newer[-1]
    taken = f"the last complete one is {complete[-1]}" if complete else "no earlier checkpoint is complete"
    return f"checkpoint {path.name} is incomplete ({why}); {taken}"


def _step(path: Path) -> int:
    return int(_NAME.match(path.name).group(2))


def driver_rng_state() -> Dict[str, Any]:
    """Python, NumPy and torch RNG states of this process, as JSON."""
    version, internal, gauss = random.getstate()
    np_state = np.random.get_state()
    return {
        "python": [version, list(internal), gauss],
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
    }


def restore_driver_rng(state: Dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), *rest))
    raw = base64.b64decode(state["torch"])
    torch.set_rng_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8))


def save_checkpoint(run_dir: Path, step: int, learner, trainer_state: TrainerState, keep: int,
                    extra: Optional[Dict[str, bytes]] = None) -> Path:
    """Write checkpoint `step` atomically; keep only the newest `keep` (0: all). `extra`: more
    files of the driver's (name: bytes), part of the manifest. An OSError of the write (a full
    disk) removes the partial folder and raises CheckpointError."""
    final = checkpoint_path(run_dir, step)
    tmp, aside = final.parent / f".tmp-{final.name}", final.parent / f".old-{final.name}"
    _clear_leftovers(final.parent)
    try:
        tmp.mkdir(parents=True)
        learner.save_checkpoint(str(tmp))
        for name, data in (extra or {}).items():
            with (tmp / name).open("wb") as handle:
                handle.write(data)
        _write_synced(tmp / STATE_FILE, replace(trainer_state, rng=driver_rng_state()).to_json())
        _write_synced(tmp / MANIFEST, json.dumps({"step": step, "files": _sizes(tmp)}))
        _sync_folder(tmp)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        last = latest_checkpoint(run_dir)
        raise CheckpointError(f"the checkpoint of step {step} could not be written ({exc}); "
                              + (f"the last complete one is {last}" if last else "no checkpoint is complete")) from exc
    if final.exists():  # the same step saved again (a resumed run that re-reached it)
        os.rename(final, aside)
    os.rename(tmp, final)
    _sync_folder(final.parent)
    shutil.rmtree(aside, ignore_errors=True)
    if keep > 0:
        for old in complete_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def _clear_leftovers(folder: Path) -> None:
    """Remove what killed saves left: `.tmp-` folders, and `.old-` ones whose step has a
    complete checkpoint again (an `.old-` that is the only complete copy is renamed back)."""
    if not folder.is_dir():
        return
    for stale in folder.glob(".tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    for aside in folder.glob(".old-step-*"):
        final = folder / aside.name[len(".old-"):]
        if checkpoint_problem(final) is None:
            shutil.rmtree(aside, ignore_errors=True)
        elif checkpoint_problem(aside) is None:
            shutil.rmtree(final, ignore_errors=True)
            os.rename(aside, final)


def _sizes(folder: Path) -> Dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()}


def _write_synced(path: Path, text: str) -> None:
    with path.open("w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())


def _sync_folder(folder: Path) -> None:
    """fsync every file under `folder` and the folder entries, so the rename that follows
    never publishes a checkpoint whose data is still only in the page cache."""
    for path in [*sorted(Path(folder).rglob("*")), Path(folder)]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def load_trainer_state(checkpoint: Path) -> TrainerState:
    return TrainerState.from_json((Path(checkpoint) / STATE_FILE).read_text())


def export_checkpoint(checkpoint: str, folder: str, merged: bool = False) -> str:
    """Write checkpoint's policy as a Hugging Face folder (fp32 master weights, config, tokenizer).
    A LoRA checkpoint gives its adapter folder, or with `merged` the model with the adapters
    merged into its base."""
    ckpt = Path(checkpoint)
    # Checked before torch and transformers are imported: a wrong path answers in well under a
    # second, not after five seconds of imports.
    if not (ckpt / STATE_FILE).is_file() or not (ckpt / "learner").is_dir():
        raise ValueError(f"'{checkpoint}' is not a complete checkpoint (no {STATE_FILE} or learner/)")
    if (ckpt / "adapter").is_dir():
        return _export_lora(ckpt, folder, merged)

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # Export alone needs transformers (and peft, DeepSpeed's converter): not the training driver.
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


def _export_lora(ckpt: Path, folder: str, merged: bool) -> str:
    """A LoRA checkpoint's adapter folder as it is, or the merged model (peft's merge_and_unload
    on the saved base)."""
    if not merged:
        shutil.copytree(ckpt / "adapter", folder, dirs_exist_ok=True)
        return folder
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(ckpt / "model"), dtype=torch.float32)
    model.load_state_dict(state_files.saved(str(ckpt), "base"), strict=False)
    model.tie_weights()
    PeftModel.from_pretrained(model, str(ckpt / "adapter")).merge_and_unload().save_pretrained(folder)
    AutoTokenizer.from_pretrained(ckpt / "model").save_pretrained(folder)
    return folder


def _fp32_state_dict(learner_dir: Path) -> Dict[str, Any]:
    """Full fp32 weights from a DeepSpeed checkpoint: ZeRO 1-3 shards are merged by DeepSpeed's
    own zero_to_fp32; without ZeRO (stage 0) the model file already holds them."""
    tag_dir = learner_dir / "ds"
    if list(tag_dir.glob("*optim_states.pt")) and list(tag_dir.glob("zero_pp_rank_*")):
        from learner.engines import import_deepspeed

        import_deepspeed()
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        return get_fp32_state_dict_from_zero_checkpoint(str(learner_dir), tag="ds")
    states = torch.load(tag_dir / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
    return {k: v.float() for k, v in states["module"].items()}
