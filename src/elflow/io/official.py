"""Import of the authors' released PyTorch checkpoints (ELF_SPEC §7, §9).

A reference checkpoint is a pickled dict (``params``, ``ema_params1``, ``opt_state``, ...) in an
extension-less file ``checkpoint_<step>``. It is read with ``torch.load(weights_only=True)`` only;
keys go through one declarative key map (:data:`KEY_MAP`) plus a transpose for the four bare
(in, out) decoder-head kernels, and the result is checked strictly against the network's own
keys and shapes.
The architecture is inferred from tensor shapes; the rest comes from the matching paper preset.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from torch import Tensor

from elflow.config import ModelConfig
from elflow.errors import ELFError, first_line, note_once

Transform = Callable[[Tensor], Tensor]


def _transpose(x: Tensor) -> Tensor:
    return x.t().contiguous()


# (official-name regex, elflow name template, tensor transform); unmatched keys map to themselves.
KEY_MAP: list[tuple[str, str, Transform | None]] = [
    (r"^(t_embedder|self_cond_cfg_embedder)\.mlp_(\d)\.(weight|bias)$", r"\1.mlp.\2.\3", None),
    (r"^proj_kernel$", "decoder.proj.weight", _transpose),
    (r"^proj_bias$", "decoder.proj.bias", None),
    (r"^unembed_kernel$", "decoder.unembed.weight", _transpose),
    (r"^unembed_bias$", "decoder.unembed.bias", None),
]
# The inverse, for exporting to the reference layout (tests, round trips).
REVERSE_KEY_MAP: list[tuple[str, str, Transform | None]] = [
    (r"^(t_embedder|self_cond_cfg_embedder)\.mlp\.(\d)\.(weight|bias)$", r"\1.mlp_\2.\3", None),
    (r"^decoder\.proj\.weight$", "proj_kernel", _transpose),
    (r"^decoder\.proj\.bias$", "proj_bias", None),
    (r"^decoder\.unembed\.weight$", "unembed_kernel", _transpose),
    (r"^decoder\.unembed\.bias$", "unembed_bias", None),
]
_PREFIXES = ("module.", "_orig_mod.")
_CHECKPOINT_RE = re.compile(r"^checkpoint_(\d+)$")


def _apply_map(state: Mapping[str, Tensor], rules: list) -> dict[str, Tensor]:
    out: dict[str, Tensor] = {}
    for key, value in state.items():
        new_key, new_value = key, value
        for pattern, template, transform in rules:
            if re.match(pattern, key):
                new_key = re.sub(pattern, template, key)
                new_value = transform(value) if transform is not None else value
                break
        out[new_key] = new_value
    return out


def strip_prefixes(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Remove DDP (``module.``) and torch.compile (``_orig_mod.``) prefixes, wherever they nest."""
    out = {}
    for key, value in state.items():
        changed = True
        while changed:
            changed = False
            for prefix in _PREFIXES:
                if key.startswith(prefix):
                    key, changed = key[len(prefix) :], True
            key = key.replace("._orig_mod.", ".")
        out[key] = value
    return out


def official_to_elflow(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Map an official state dict to elflow's parameter names and layouts."""
    return _apply_map(strip_prefixes(state), KEY_MAP)


def elflow_to_official(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Map an elflow state dict to the official names and layouts."""
    return _apply_map(state, REVERSE_KEY_MAP)


def infer_model_config(state: Mapping[str, Tensor], max_length: int, **overrides) -> ModelConfig:
    """Infer the network's dims from official-layout tensor shapes.

    E, V, D, bottleneck, depth, head count (D / head_dim of the QK-norm), SwiGLU width and token
    counts are read off the tensors; ``max_length`` is not stored (RoPE tables are buffers).
    """
    state = strip_prefixes(state)
    try:
        bottleneck, E = state["text_proj.proj1.weight"].shape
        D = state["text_proj.proj2.weight"].shape[0]
        V = state["unembed_kernel"].shape[1]
        head_dim = state["blocks.0.attn.q_norm.weight"].shape[0]
        mlp_hidden = state["blocks.0.mlp.w3.weight"].shape[1]
        n_time = state["t_emb_tokens"].shape[1]
        n_mode = state["mode_tokens"].shape[1]
    except KeyError as e:
        raise ELFError(
            f"not an ELF checkpoint: tensor {e.args[0]!r} is missing (is this a reference "
            "ELF PyTorch checkpoint?)"
        ) from None
    n_scale = state["self_cond_cfg_tokens"].shape[1] if "self_cond_cfg_tokens" in state else 0
    depth = 1 + max(int(k.split(".")[1]) for k in state if k.startswith("blocks."))
    # int(mlp_ratio * D) values whose 2/3 rounds down to the stored SwiGLU width; prefer a ratio
    # that is a multiple of 1/4 (4.0 for every released model).
    widths = [h for h in range(mlp_hidden, 2 * mlp_hidden + 2) if int(h * 2 / 3) == mlp_hidden]
    hidden4 = next((h for h in widths if (4 * h) % D == 0), widths[0])
    ratio = hidden4 / D
    while int(ratio * D) < hidden4:  # h / D * D can round to just below h (405 at D 304)
        ratio = math.nextafter(ratio, math.inf)
    kwargs = dict(
        encoder_dim=int(E),
        vocab_size=int(V),
        max_length=max_length,
        hidden_size=int(D),
        depth=depth,
        num_heads=int(D // head_dim),
        mlp_ratio=ratio,
        bottleneck_dim=int(bottleneck),
        num_time_tokens=int(n_time),
        num_scale_tokens=int(n_scale),
        num_mode_tokens=int(n_mode),
        self_condition="self_cond_proj.weight" in state,
    )
    kwargs.update(overrides)
    cfg = ModelConfig(**kwargs)
    if cfg.mlp_hidden != mlp_hidden:
        raise ELFError(f"cannot infer mlp_ratio for SwiGLU width {mlp_hidden} at D={D}")
    return cfg


def latest_official_checkpoint(folder: Path) -> Path | None:
    """The ``checkpoint_<step>`` file with the largest step (numeric order: 1000 after 900)."""
    found = [
        (int(m.group(1)), p)
        for p in folder.iterdir()
        if p.is_file() and (m := _CHECKPOINT_RE.match(p.name))
    ]
    return max(found)[1] if found else None


def read_official_checkpoint(path: str | Path, use_ema: bool = True) -> dict[str, Tensor]:
    """Read the weights of one reference checkpoint file (or the latest in a folder).

    Returns the EMA weights (``ema_params1``) by default, ``params`` when there is no EMA or
    ``use_ema`` is False, still in the official layout (see :func:`official_to_elflow`).
    """
    path = Path(path)
    if path.is_dir():
        latest = latest_official_checkpoint(path)
        if latest is None:
            raise ELFError(f"no checkpoint_<step> file in folder {path}")
        path = latest
    if not path.is_file():
        raise ELFError(f"checkpoint file {path} does not exist")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:
        # Old-style (non-zipfile) pickles cannot be memory-mapped; still weights-only.
        try:
            payload = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:
            raise _unreadable(path, e) from None
    except Exception as e:
        raise _unreadable(path, e) from None
    if not isinstance(payload, dict):
        raise ELFError(f"{path} is not a reference ELF checkpoint (expected a dict payload)")
    key = "ema_params1" if use_ema and payload.get("ema_params1") else "params"
    weights = payload.get(key)
    if not isinstance(weights, Mapping) or not weights:
        raise ELFError(f"{path} has no '{key}' weights (keys: {sorted(payload)[:8]})")
    bad = [k for k, v in weights.items() if not isinstance(v, Tensor)]
    if bad:
        raise ELFError(f"{path}: '{key}' holds non-tensor entries {bad[:5]}")
    bad = [k for k, v in weights.items() if not v.is_floating_point()]
    if bad:
        raise ELFError(f"{path}: '{key}' holds integer tensors {bad[:5]}; not model weights")
    if use_ema and key == "params":
        note_once(
            f"elflow: note: {path} holds no EMA weights (ema_params1); using its raw 'params'"
        )
    return dict(weights)


def _listed(keys: list[str], what: str) -> str:
    """'2 missing keys [a, b]', the first three named."""
    if not keys:
        return f"no {what}s"
    more = f", ... {len(keys) - 3} more" if len(keys) > 3 else ""
    return f"{len(keys)} {what}{'s' if len(keys) > 1 else ''} [{', '.join(keys[:3])}{more}]"


def _unreadable(path: Path, e: Exception) -> ELFError:
    """One line for a file ``torch.load(weights_only=True)`` refuses (its own text runs to many
    lines and suggests allowing what it refused, which elflow never does)."""
    reason = first_line(e)
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError:
        head = b"PK"  # unreadable: say what the loader said
    if head and not head.startswith((b"PK", b"\x80")):  # neither a zip archive nor a pickle
        reason = f"not a torch file (it starts with {head!r}, not a zip archive or a pickle)"
    elif "pickle holding" not in reason:
        detail = reason if str(e).strip() else "empty?"
        reason = f"not a torch file, or a truncated one ({type(e).__name__}: {detail})"
    return ELFError(f"cannot read {path} as a weights-only torch checkpoint: {reason}")


def load_state_dict_strict(model: torch.nn.Module, state: Mapping[str, Tensor]) -> None:
    """Load ``state`` into ``model``; one line naming the first few missing or unexpected keys
    and shape mismatches, with their counts."""
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    if missing or unexpected:
        raise ELFError(
            f"checkpoint does not match the network: {_listed(missing, 'missing key')}, "
            f"{_listed(unexpected, 'unexpected key')}; the weights are of another model, or "
            "its config.json was edited"
        )
    wrong = [
        f"{k}: checkpoint {tuple(state[k].shape)} vs network {tuple(own[k].shape)}"
        for k in own
        if state[k].shape != own[k].shape
    ]
    if wrong:
        shown = "; ".join(wrong[:3]) + (f"; and {len(wrong) - 3} more" if len(wrong) > 3 else "")
        raise ELFError(
            f"checkpoint tensor shapes do not match the network ({len(wrong)} tensors): {shown}; "
            "the weights are of another model, or its config.json was edited"
        )
    model.load_state_dict(state, strict=True)
