"""Head files: safetensors weights with their config in the file's metadata.

One file is one unit (as Medusa ships its heads): the tensors, plus a JSON
document under the metadata key `adaptive_spec_head` that says what the head
is (kind, architecture, sizes), which draft model it was trained for (name and
a fingerprint of the draft's config and weights), the recommended threshold,
a summary of the training data and the project commit. Every way a file can
be wrong (missing, truncated, not safetensors, no or bad metadata, tensors of
the wrong name, dtype or shape, another draft) raises `ConfigError` naming the
config field, so a bad head fails engine start-up with one clear message.

Shared by every trained head (SpecDec++ acceptance head, Pacer pre-verifier).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vllm_adaptive_spec.errors import ConfigError

logger = logging.getLogger(__name__)

META_KEY = "adaptive_spec_head"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class HeadFile:
    tensors: dict[str, torch.Tensor]  # name -> tensor, as stored
    meta: dict[str, Any]  # the JSON document under META_KEY


def save_head_file(path: str | Path, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"format_version": FORMAT_VERSION, **meta}
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(path), {META_KEY: json.dumps(doc)})


def read_head_meta(path: str | Path, field: str) -> dict[str, Any]:
    """The metadata document alone (no tensors read)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as fh:
            raw = (fh.metadata() or {}).get(META_KEY)
    except FileNotFoundError:
        raise ConfigError(f"{field}: {str(path)!r} does not exist") from None
    except Exception as exc:  # safetensors raises its own error types for damaged files
        raise ConfigError(f"{field}: {str(path)!r} is not a readable safetensors file ({exc})") from None
    if raw is None:
        raise ConfigError(f"{field}: {str(path)!r} has no {META_KEY!r} metadata; not a vllm-adaptive-spec head file")
    try:
        meta = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{field}: {str(path)!r} has corrupt {META_KEY!r} metadata ({exc})") from None
    if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION:
        raise ConfigError(f"{field}: {str(path)!r} has head format {meta!r:.80}; expected format_version 1")
    return meta


def load_head_file(path: str | Path, field: str, expected: dict[str, tuple[int, ...]] | None = None) -> HeadFile:
    """Read and check a head file. `expected`: tensor name -> shape (all float32)."""
    from safetensors.torch import load_file

    meta = read_head_meta(path, field)
    try:
        tensors = load_file(str(path))
    except Exception as exc:
        raise ConfigError(f"{field}: {str(path)!r} has unreadable tensors ({exc})") from None
    if expected is not None:
        if set(tensors) != set(expected):
            raise ConfigError(f"{field}: {str(path)!r} holds tensors {sorted(tensors)}; expected {sorted(expected)}")
        for name, shape in expected.items():
            got = tensors[name]
            if got.dtype != torch.float32 or tuple(got.shape) != tuple(shape):
                raise ConfigError(
                    f"{field}: {str(path)!r} tensor {name!r} is {str(got.dtype)} {list(got.shape)}; "
                    f"expected torch.float32 {list(shape)}"
                )
            if not bool(torch.isfinite(got).all()):
                raise ConfigError(f"{field}: {str(path)!r} tensor {name!r} holds NaN or inf")
    return HeadFile(tensors, meta)


def load_head_module(
    path: str | Path, field: str, build: Callable[[dict[str, Any]], torch.nn.Module]
) -> tuple[torch.nn.Module, dict[str, Any]]:
    """The module a head file describes: `build(meta)` makes it (raising ConfigError on bad
    metadata), then its tensors load with names, shapes and dtype checked against it.
    Returns it float32, on CPU, in eval mode and frozen, with the file's metadata."""
    module = build(read_head_meta(path, field))
    loaded = load_head_file(path, field, {name: tuple(t.shape) for name, t in module.state_dict().items()})
    module.load_state_dict(loaded.tensors)
    return module.eval().requires_grad_(False), loaded.meta


def resolve_model_dir(model: str | Path) -> Path:
    """A local directory for a model name: the path itself, or its snapshot in the local HF cache."""
    path = Path(model)
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(str(model), local_files_only=True))
    except Exception:
        raise ConfigError(f"draft model {str(model)!r}: no local directory to fingerprint") from None


def model_fingerprint(model: str | Path) -> str:
    """sha256 over a model's config.json content and its weights (tensor names, dtypes, shapes, bytes).

    Computed from the model directory on disk (safetensors), without vLLM;
    re-serialising config.json or resharding the weights keeps the value.
    """
    root = resolve_model_dir(model)
    files = sorted(root.glob("*.safetensors"))
    stamp = tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in [root / "config.json", *files])
    return _fingerprint(str(root.resolve()), stamp)


@functools.lru_cache(maxsize=8)
def _fingerprint(root: str, stamp: tuple) -> str:  # stamp only keys the cache
    from safetensors import safe_open

    path = Path(root)
    digest = hashlib.sha256()
    with (path / "config.json").open() as fh:
        config = json.load(fh)
    digest.update(json.dumps(config, sort_keys=True, separators=(",", ":")).encode())
    names: dict[str, Path] = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            names.update({name: f for name in fh.keys()})  # noqa: SIM118 (safe_open is not a mapping)
    if not names:
        raise ConfigError(f"draft model {root!r}: no safetensors weights to fingerprint")
    for name in sorted(names):
        with safe_open(str(names[name]), framework="pt") as fh:
            tensor = fh.get_tensor(name).contiguous()
        digest.update(f"{name}|{tensor.dtype}|{list(tensor.shape)}|".encode())
        digest.update(tensor.view(-1).view(torch.uint8).numpy().tobytes())
    logger.debug("fingerprint of %s computed", root)
    return digest.hexdigest()


def draft_identity(model: str | Path) -> dict[str, str]:
    """What a head file records about its draft: a name and the fingerprint."""
    return {"name": Path(str(model)).name or str(model), "fingerprint": model_fingerprint(model)}


def check_draft(meta: dict[str, Any], path: str | Path, draft_model: str | Path, field: str) -> None:
    """Raise ConfigError when the head in `path` was trained for another draft than `draft_model`."""
    want = meta.get("draft") or {}
    if not isinstance(want, dict) or "fingerprint" not in want:
        raise ConfigError(f"{field}: {str(path)!r} does not record the draft model it was trained for")
    try:
        got = model_fingerprint(draft_model)
    except (ConfigError, OSError, ValueError) as exc:
        raise ConfigError(f"{field}: cannot check {str(path)!r} against the running draft: {exc}") from None
    if want["fingerprint"] != got:
        raise ConfigError(
            f"{field}: {str(path)!r} was trained for draft {want.get('name')!r} "
            f"(fingerprint {str(want['fingerprint'])[:12]}..), the running draft is {str(draft_model)!r} "
            f"(fingerprint {got[:12]}..)"
        )


def project_commit() -> str:
    """The project's git commit (with '+dirty' for uncommitted changes), or 'unknown'."""
    import subprocess

    root = Path(__file__).resolve().parents[2]
    try:
        run = functools.partial(subprocess.run, cwd=root, capture_output=True, text=True, timeout=10, check=True)
        commit = run(["git", "rev-parse", "HEAD"]).stdout.strip()
        dirty = run(["git", "status", "--porcelain", "--untracked-files=no"]).stdout.strip()
        return commit + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return os.environ.get("VLLM_ADAPTIVE_SPEC_COMMIT", "unknown")
