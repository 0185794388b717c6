"""Training checkpoints that survive SIGKILL and never unpickle.

A checkpoint at step ``s`` is two files in one folder:

- ``step-0000000s.safetensors``: every tensor: the model's parameters (``model.*``) and the optimizer's
  per-parameter state (``optimizer.<param index>.<name>``);
- ``step-0000000s.json``: everything else: the model config, training options, optimizer
  hyperparameters, RNG states (base64), the data position, the loss history, and the size and SHA-256
  of the tensor file.

Both are written atomically (temporary file, fsync, rename), the tensors first: the JSON is the commit
record, so a checkpoint either exists completely or not at all, whenever the process dies. Loading
checks the JSON, the size and hash of the tensor file, then reads tensors with ``safetensors``
(no pickle anywhere). A damaged checkpoint raises :class:`CheckpointError` naming the file.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from .._io import atomic_path, atomic_write_text

FORMAT = "relattn-checkpoint"
VERSION = 1
_NAME = re.compile(r"^step-(\d{8,})\.json$")


class CheckpointError(ValueError):
    """A checkpoint is missing, truncated, corrupt or does not fit the model."""


@dataclass
class Checkpoint:
    """A loaded, verified checkpoint: ``meta`` from the JSON file, ``tensors`` from the safetensors file."""

    path: Path  # the JSON file
    meta: dict
    tensors: dict[str, torch.Tensor]

    @property
    def step(self) -> int:
        return int(self.meta["step"])


def encode_bytes(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode("ascii")


def decode_bytes(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def rng_state() -> dict:
    """The torch CPU (and CUDA) RNG states, JSON-ready."""
    state = {"torch": encode_bytes(torch.get_rng_state())}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [encode_bytes(s) for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(decode_bytes(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        cuda = [decode_bytes(s) for s in state["cuda"]]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)


def _optimizer_split(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    sd = optimizer.state_dict()
    tensors, scalars = {}, {}
    for pid, state in sd["state"].items():
        for name, value in state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optimizer.{pid}.{name}"] = value.detach().cpu().contiguous()
            else:
                scalars[f"{pid}.{name}"] = value
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in sd["param_groups"]]
    return tensors, {"param_groups": groups, "scalars": scalars}


def _optimizer_join(tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    state: dict[int, dict] = {}
    for key, value in tensors.items():
        if key.startswith("optimizer."):
            pid, name = key[len("optimizer."):].split(".", 1)
            state.setdefault(int(pid), {})[name] = value
    for key, value in meta["scalars"].items():
        pid, name = key.split(".", 1)
        state.setdefault(int(pid), {})[name] = value
    groups = [{k: (tuple(v) if k == "betas" else v) for k, v in g.items()} for g in meta["param_groups"]]
    return {"state": state, "param_groups": groups}


def checkpoint_path(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"step-{step:08d}.json"


def save_checkpoint(directory: str | Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    meta: dict) -> Path:
    """Write the checkpoint of ``step``; ``meta`` (JSON-ready) is stored beside the tensors. Returns the JSON path."""
    json_path = checkpoint_path(directory, step)
    tensor_path = json_path.with_suffix(".safetensors")
    from safetensors.torch import save_file

    # clone: tied weights share storage, which safetensors refuses; loading restores the tie.
    tensors = {f"model.{k}": v.detach().cpu().clone().contiguous() for k, v in model.state_dict().items()}
    opt_tensors, opt_meta = _optimizer_split(optimizer)
    tensors.update(opt_tensors)
    with atomic_path(tensor_path) as tmp:
        save_file(tensors, str(tmp), metadata={"format": FORMAT, "step": str(step)})
        raw = tmp.read_bytes()
    record = {"format": FORMAT, "version": VERSION, "step": step, **meta, "optimizer": opt_meta, "rng": rng_state(),
              "tensors": {"file": tensor_path.name, "bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}}
    atomic_write_text(json_path, json.dumps(record, indent=1) + "\n")
    return json_path


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Read and verify the checkpoint whose JSON file is ``path`` (the ``.safetensors`` path works too)."""
    path = Path(path)
    if path.suffix == ".safetensors":
        path = path.with_suffix(".json")
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"checkpoint {path}: unreadable ({e})") from None
    try:
        meta = json.loads(text)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"checkpoint {path}: corrupt or truncated JSON ({e.msg} at char {e.pos})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or not isinstance(meta.get("tensors"), dict):
        raise CheckpointError(f"checkpoint {path}: not a {FORMAT} file")
    if meta.get("version") != VERSION:
        raise CheckpointError(f"checkpoint {path}: format version {meta.get('version')}, this relattn reads {VERSION}")
    tensor_path = path.parent / meta["tensors"]["file"]
    try:
        raw = tensor_path.read_bytes()
    except OSError:
        raise CheckpointError(f"checkpoint {tensor_path}: missing (named by {path})") from None
    if len(raw) != meta["tensors"]["bytes"]:
        raise CheckpointError(f"checkpoint {tensor_path}: truncated or altered ({len(raw)} bytes, "
                              f"expected {meta['tensors']['bytes']})")
    if hashlib.sha256(raw).hexdigest() != meta["tensors"]["sha256"]:
        raise CheckpointError(f"checkpoint {tensor_path}: corrupt (SHA-256 differs from {path.name})")
    from safetensors.torch import load

    try:
        tensors = load(raw)
    except Exception as e:  # safetensors raises its own error types for malformed headers
        raise CheckpointError(f"checkpoint {tensor_path}: unreadable safetensors ({e})") from None
    return Checkpoint(path, meta, tensors)


def restore(checkpoint: Checkpoint, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Load the model (and optimizer) state of ``checkpoint``; a mismatch raises :class:`CheckpointError`."""
    model_sd = {k[len("model."):]: v for k, v in checkpoint.tensors.items() if k.startswith("model.")}
    try:
        model.load_state_dict(model_sd, strict=True)
        if optimizer is not None:
            optimizer.load_state_dict(_optimizer_join(checkpoint.tensors, checkpoint.meta["optimizer"]))
    except (RuntimeError, ValueError, KeyError) as e:
        first = str(e).strip().splitlines()[0]
        raise CheckpointError(f"checkpoint {checkpoint.path}: does not fit this model ({first})") from None


def list_checkpoints(directory: str | Path) -> list[Path]:
    """JSON files of the checkpoints in ``directory``, newest step first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def latest_checkpoint(directory: str | Path) -> tuple[Checkpoint | None, list[str]]:
    """The newest checkpoint in ``directory`` that verifies, and an error line for each newer one that did not."""
    refused = []
    for path in list_checkpoints(directory):
        try:
            return load_checkpoint(path), refused
        except CheckpointError as e:
            refused.append(str(e))
    return None, refused


def prune(directory: str | Path, keep: int) -> None:
    """Delete all but the ``keep`` newest checkpoints, and temporary files left by a killed writer."""
    directory = Path(directory)
    for path in list_checkpoints(directory)[keep:]:
        path.unlink(missing_ok=True)  # the commit record first, so a half-deleted checkpoint is never "latest"
        path.with_suffix(".safetensors").unlink(missing_ok=True)
    for tmp in directory.glob(".step-*"):
        tmp.unlink(missing_ok=True)
    for orphan in directory.glob("step-*.safetensors"):  # killed between writing the tensors and the record
        if not orphan.with_suffix(".json").exists():
            orphan.unlink(missing_ok=True)


__all__ = ["Checkpoint", "CheckpointError", "latest_checkpoint", "list_checkpoints", "load_checkpoint", "prune",
           "restore", "save_checkpoint"]
