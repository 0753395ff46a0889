"""EMA of the training weights (ELF_SPEC §3 step 11 and §10 "EMA on short runs").

The EMA starts as an fp32 copy of the initial weights (no bias correction) and is updated after
every optimizer step: shadow ← d·shadow + (1 − d)·param. The paper's d = 0.9999 suits 95k-step runs;
short (CPU) runs use a smaller decay or the warm-up d_k = min(decay, (1 + k)/(10 + k)). Under FSDP2
the shadows are DTensors sharded like the parameters; :meth:`EMA.state_dict_for_save` gathers
full tensors (a collective: every rank must call it).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from elflow.config import ModelConfig
from elflow.errors import ELFError
from elflow.model import ELF, check_fits


def decay_at(decay: float, warmup: bool, k: int) -> float:
    """The decay of the k-th update (k from 0): ``decay``, or with warm-up
    min(decay, (1 + k)/(10 + k)), so the EMA follows the weights closely early on instead of
    staying near the initialisation (after 5k steps a plain 0.9999 EMA still holds
    0.9999^5000 ≈ 61% of it, ELF_SPEC §10).
    """
    return min(decay, (1 + k) / (10 + k)) if warmup else decay


def initial_share(decay: float, warmup: bool, steps: int) -> float:
    """Weight the EMA still gives its starting weights after ``steps`` updates: the product of d_k.

    E.g. 0.9999 keeps 0.9999^5000 ≈ 61% after 5k steps; with the warm-up it is ≈ 9 / (9 + steps)
    until d_k reaches ``decay``.
    """
    share, k = 1.0, 0
    while k < steps and decay_at(decay, warmup, k) < decay:
        share *= decay_at(decay, warmup, k)
        k += 1
    return share * decay ** (steps - k)


class EMA:
    """fp32 shadow copies of a model's named parameters.

    Pass the bare model (not a DDP wrapper, whose names carry a ``module.`` prefix); an FSDP2
    model keeps its parameter names, so it can be passed directly.
    """

    def __init__(self, model: nn.Module, decay: float, warmup: bool = False) -> None:
        if not 0.0 <= decay <= 1.0:
            raise ELFError(f"EMA decay must be in [0, 1], got {decay}")
        self.decay = decay
        self.warmup = warmup
        self.num_updates = 0
        with torch.no_grad():
            self.shadow: dict[str, Tensor] = {
                name: p.detach().to(torch.float32, copy=True)
                for name, p in model.named_parameters()
            }

    def current_decay(self) -> float:
        """The decay the next :meth:`update` uses (:func:`decay_at`)."""
        return decay_at(self.decay, self.warmup, self.num_updates)

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """Fold the current weights in; call once after each optimizer step."""
        d = self.current_decay()
        shadows, params = [], []
        for name, p in model.named_parameters():
            shadow = self.shadow.get(name)
            if shadow is None:
                raise ELFError(f"EMA has no parameter {name!r}; was it built from another model?")
            shadows.append(shadow)
            params.append(p.detach().to(torch.float32))
        # One batched lerp for every tensor; it works shard-locally on DTensors (same
        # placements), with no communication.
        torch._foreach_lerp_(shadows, params, 1.0 - d)
        self.num_updates += 1

    @torch.no_grad()
    def copy_to(self, model: nn.Module) -> None:
        """Overwrite the model's parameters with the EMA weights (e.g. to sample with them)."""
        for name, p in model.named_parameters():
            p.copy_(self.shadow[name])

    @torch.no_grad()
    def state_dict_for_save(self) -> dict[str, Tensor]:
        """Full fp32 EMA weights by the model's state_dict key names (for ``ema.safetensors``).

        NOTE: a collective under FSDP2 (each sharded shadow is all-gathered): every rank must call
        it, even if only rank 0 writes. Plain shadows are returned without a copy: do not modify.
        """
        return {
            name: s.full_tensor() if isinstance(s, DTensor) else s
            for name, s in self.shadow.items()
        }

    def state_dict(self) -> dict[str, Any]:
        """This rank's EMA state; DTensor shadows are stored as their local shards."""
        return {
            "decay": self.decay,
            "warmup": self.warmup,
            "num_updates": self.num_updates,
            "shadow": {
                name: s.to_local() if isinstance(s, DTensor) else s
                for name, s in self.shadow.items()
            },
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (shadows and the update count) into shadows of the
        same shapes (and sharding); ``decay`` and ``warmup`` stay this EMA's own."""
        saved = state["shadow"]
        if set(saved) != set(self.shadow):
            missing = sorted(set(self.shadow) - set(saved))
            extra = sorted(set(saved) - set(self.shadow))
            raise ELFError(f"EMA state does not match the model: missing {missing}, extra {extra}")
        for name, s in self.shadow.items():
            target = s.to_local() if isinstance(s, DTensor) else s
            if target.shape != saved[name].shape:
                raise ELFError(
                    f"EMA state for {name!r} has shape {tuple(saved[name].shape)}, "
                    f"expected {tuple(target.shape)}; saved from another model or world size?"
                )
            target.copy_(saved[name])
        # decay and warmup stay the constructor's: a resumed run follows its config (which its
        # checkpoints record), as the optimizer does; the saved values are informational.
        self.num_updates = int(state["num_updates"])


def ema_network(model_cfg: ModelConfig, ema_state: dict, device: torch.device) -> ELF:
    """A network in eval mode holding ``ema_state``, built on the meta device: no initialisation,
    so no time, no host copy and no draws from the global RNG (dropout's, so resume is exact)."""
    check_fits(model_cfg, device, 4, "for its weights")
    with torch.device("meta"):
        net = ELF(model_cfg)
    net = net.to_empty(device=device)
    net.load_state_dict(ema_state)
    return net.eval()
