"""Muon's orthogonalised update, with the work shared by the processes (ELF_SPEC §3, §10).

Newton–Schulz turns the Nesterov momentum of a weight matrix into its nearest semi-orthogonal
matrix (5 quintic steps, Keller Jordan's coefficients). ``torch.optim.Muon`` runs it on whatever
tensor it is given, which is silently wrong on an FSDP2 shard, and every process of a data-
parallel run would repeat every matrix. :class:`ShardedMuon` gives each matrix to one process
(balanced by FLOPs, :func:`assign_owners`), which orthogonalises it whole (bf16 with torch's own
function, or fp32 as the reference does, on the Gram matrix for wide matrices):

- replicated parameters (DDP): the owners' updates are all-gathered in one collective;
- FSDP2 shards (row-sharded DTensors): each process sends its rows of every matrix to the
  matrix's owner and gets its rows of the updates back (two all-to-alls per step, no per-matrix
  gather).

Every process applies exactly the owner's update, so N processes match one process.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Shard

GRAM_RATIO = 4
"""Long side / short side from which fp32 Newton–Schulz iterates on the Gram matrix."""
GRAM_RESTART = 3
"""Gram-form Newton–Schulz steps between recomputations of X and its Gram matrix."""


def _newton_schulz(
    grad: Tensor,
    ns_coefficients: tuple[float, float, float],
    ns_steps: int,
    eps: float,
    dtype: torch.dtype,
    gram_ratio: float = GRAM_RATIO,
) -> Tensor:
    """torch.optim.Muon's quintic Newton–Schulz, run in ``dtype`` (torch hard-codes bf16).

    Each step is X <- P(A) X with P(A) = aI + bA + cA² and A = X Xᵀ (the short side's Gram
    matrix). For a wide matrix in fp32/fp64 (long side >= ``gram_ratio`` x the short one, e.g.
    the decoder head's E x V) the same steps run on the Gram matrix alone: X_k = M_k X_0 with
    M_{k+1} = P(A_k) M_k and A_{k+1} = P(A_k) A_k P(A_k), all short x short. X_k and its Gram
    matrix are recomputed every ``GRAM_RESTART`` steps, which keeps near-low-rank inputs about as
    close to the fp64 iteration as the direct one (tests/train/test_optim.py: within 1.5x;
    without the restart we measured up to 3.5x). With 5 steps, four products touch the long side
    instead of ten. This is the path of fp32 Newton–Schulz (``muon_ns_dtype=float32``) on any
    device, so updates differ from the direct iteration's by rounding.
    """
    a, b, c = ns_coefficients
    ortho = grad.to(dtype)
    if grad.size(0) > grad.size(1):
        ortho = ortho.T
    # Out of place: with dtype == grad.dtype, .to() aliases the input (the momentum buffer).
    ortho = ortho / ortho.norm().clamp(min=eps)
    if dtype in (torch.float32, torch.float64) and ortho.size(1) >= gram_ratio * ortho.size(0):
        mixer = None
        for k in range(ns_steps):
            if k % GRAM_RESTART == 0:  # X_k itself, and its Gram matrix afresh
                if mixer is not None:
                    ortho = mixer @ ortho
                gram, mixer = ortho @ ortho.T, None
            poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
            poly.diagonal().add_(a)
            mixer = poly if mixer is None else poly @ mixer
            if (k + 1) % GRAM_RESTART and k + 1 < ns_steps:  # else the next Gram is not this one
                gram = poly @ gram @ poly
        if mixer is not None:
            ortho = mixer @ ortho
    else:
        for _ in range(ns_steps):
            gram = ortho @ ortho.T
            gram_update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
            ortho = torch.addmm(ortho, gram_update, ortho, beta=a)
    if grad.size(0) > grad.size(1):
        ortho = ortho.T
    return ortho


try:  # NOTE: private torch API; the fallbacks are copies of the same algorithm.
    from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz
except ImportError:  # pragma: no cover - depends on the torch version

    def _zeropower_via_newtonschulz(
        grad: Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int, eps: float
    ) -> Tensor:
        return _newton_schulz(grad, ns_coefficients, ns_steps, eps, torch.bfloat16)

    def _adjust_lr(lr: float, adjust_lr_fn: str | None, param_shape: torch.Size) -> float:
        A, B = param_shape[:2]
        if adjust_lr_fn is None or adjust_lr_fn == "original":
            return lr * math.sqrt(max(1, A / B))
        if adjust_lr_fn == "match_rms_adamw":
            return lr * 0.2 * math.sqrt(max(A, B))
        return lr


# torch.optim.Muon's defaults (Keller Jordan's coefficients), repeated so ShardedMuon matches it.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7


def newton_schulz_flops(shape: tuple[int, ...], steps: int) -> float:
    """FLOPs of the direct Newton–Schulz iteration on a matrix of ``shape`` (the owners'
    balance; the fp32 Gram form of wide matrices does less)."""
    m, n = sorted(shape[:2])
    return float(steps * (4 * m * m * n + 2 * m**3))


@functools.cache
def assign_owners(
    shapes: tuple[tuple[int, ...], ...], world_size: int, steps: int = 5
) -> list[int]:
    """The process that orthogonalises each matrix: the largest first, each to the least loaded
    process so far (ties to the lowest rank), so each process does about 1 / world_size of the
    FLOPs (no less than the largest matrix's)."""
    load = [0.0] * world_size
    owners = [0] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda i: -newton_schulz_flops(shapes[i], steps)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owners[i] = rank
        load[rank] += newton_schulz_flops(shapes[i], steps)
    return owners


def shard_rows(rows: int, world_size: int, rank: int) -> tuple[int, int]:
    """[start, end) of the rows FSDP2 keeps on ``rank`` (torch.chunk's split, as fully_shard)."""
    chunk = -(-rows // world_size)
    return min(rank * chunk, rows), min((rank + 1) * chunk, rows)


def _orthogonalise(
    update: Tensor,
    ns_coefficients: tuple[float, float, float],
    ns_steps: int,
    eps: float,
    dtype: torch.dtype,
) -> Tensor:
    if dtype == torch.bfloat16:  # torch's own function: bitwise equal to torch.optim.Muon
        return _zeropower_via_newtonschulz(update, ns_coefficients, ns_steps, eps)
    return _newton_schulz(update, ns_coefficients, ns_steps, eps, dtype)


def _zeropower_stacked(
    stack: Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int, eps: float
) -> Tensor:
    """torch's bf16 Newton–Schulz on a (n, rows, cols) stack of same-shaped matrices at once:
    the same ops batched (bmm), so a model's dozens of equal blocks cost 3 kernels a step, not
    3 per matrix (on a CPU the results equal the one-matrix function's bitwise)."""
    a, b, c = ns_coefficients
    ortho = stack.bfloat16()
    tall = stack.size(1) > stack.size(2)
    if tall:
        ortho = ortho.transpose(1, 2)
    ortho = ortho / ortho.norm(dim=(1, 2), keepdim=True).clamp(min=eps)
    for _ in range(ns_steps):
        gram = ortho @ ortho.transpose(1, 2)
        gram_update = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        ortho = torch.baddbmm(ortho, gram_update, ortho, beta=a)
    return ortho.transpose(1, 2) if tall else ortho


def orthogonalise_all(
    updates: list[Tensor],
    ns_coefficients: tuple[float, float, float],
    ns_steps: int,
    eps: float,
    dtype: torch.dtype,
) -> list[Tensor]:
    """Each update's Newton–Schulz; in bf16, matrices of one shape go through
    :func:`_zeropower_stacked` together (fp32 keeps its one-matrix Gram form)."""
    out: list[Tensor | None] = [None] * len(updates)
    groups: dict[tuple, list[int]] = {}
    for i, u in enumerate(updates):
        groups.setdefault((tuple(u.shape), u.dtype, u.device), []).append(i)
    for members in groups.values():
        if dtype != torch.bfloat16 or len(members) == 1:
            for i in members:
                out[i] = _orthogonalise(updates[i], ns_coefficients, ns_steps, eps, dtype)
            continue
        stack = torch.stack([updates[i] for i in members])
        for i, o in zip(
            members,
            _zeropower_stacked(stack, ns_coefficients, ns_steps, eps).unbind(0),
            strict=True,
        ):
            out[i] = o
    return out  # type: ignore[return-value]


class ShardedMuon(torch.optim.Optimizer):
    """``torch.optim.Muon`` that is correct on FSDP2 (DTensor) parameters and shares the
    Newton–Schulz work among the processes (module docstring).

    The momentum buffer lives with the parameter (the local shard under FSDP2); each matrix's
    Nesterov update is orthogonalised by its owner only, scaled by the full shape, and every
    process applies its part. Same defaults and state layout as ``torch.optim.Muon``
    (weight_decay 0.1 by default: pass 0 for the paper's setting).

    Args:
        distributed: share the work among the processes of the default group, whose
            parameters must be replicated (DDP); False: this process orthogonalises every matrix
            (one process, or independent replicas). Row-sharded DTensors (FSDP2) always share
            it among their mesh's processes: a shard alone cannot be orthogonalised.
        ns_dtype: bf16 by default (torch's choice, bitwise equal to ``torch.optim.Muon``).

    NOTE: bf16 Newton–Schulz amplifies its own rounding noise in the near-null directions of
    low-rank updates, so a 1e-7 relative change of the gradient (e.g. another all-reduce order)
    moves the weights by ~10% of the step. ``torch.float32`` (the reference's choice) makes N
    processes match one process to ~1e-6.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        eps: float = NS_EPS,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
        ns_dtype: torch.dtype = torch.bfloat16,
        distributed: bool = False,
    ) -> None:
        if lr < 0 or momentum < 0 or weight_decay < 0:
            raise ValueError(
                f"lr, momentum, weight_decay must be >= 0: {lr}, {momentum}, {weight_decay}"
            )
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": ns_coefficients,
            "eps": eps,
            "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn,
            "ns_dtype": ns_dtype,
        }
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim != 2:
                    raise ValueError(
                        f"Muon only supports 2-D parameters, got shape {tuple(p.shape)}"
                    )
        self.replicated = distributed and dist.is_initialized()

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            updates = [self._nesterov(p, group) for p in params]
            sharded = [isinstance(p, DTensor) and p.device_mesh.size() > 1 for p in params]
            if any(sharded):
                if not all(_row_sharded(p) for p in params):
                    raise ValueError(
                        "ShardedMuon takes FSDP2's row-sharded DTensors (one 1-D mesh) or plain "
                        "tensors, not a mix or other placements"
                    )
                ortho = self._exchange_shards(params, updates, group)
            elif self.replicated:
                ortho = self._gather_replicated(params, updates, group)
            else:
                ortho = self._ortho(updates, group)
            for p, update in zip(params, ortho, strict=True):
                _apply(p, update, group)
        return loss

    def _nesterov(self, p: Tensor, group: dict[str, Any]) -> Tensor:
        """The momentum step (same ops as ``torch.optim.Muon``): the update to orthogonalise,
        a local tensor (this shard's rows under FSDP2)."""
        state = self.state[p]
        grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
        buf = state["momentum_buffer"]
        buf_local = buf.to_local() if isinstance(buf, DTensor) else buf
        m = group["momentum"]
        buf_local.lerp_(grad, 1 - m)
        return grad.lerp(buf_local, m) if group["nesterov"] else buf_local

    @staticmethod
    def _ortho(updates: list[Tensor], group: dict[str, Any]) -> list[Tensor]:
        return orthogonalise_all(
            updates, group["ns_coefficients"], group["ns_steps"], group["eps"], group["ns_dtype"]
        )

    def _send_dtype(self, group: dict[str, Any]) -> torch.dtype:
        # bf16 Newton–Schulz starts by rounding its input to bf16: sending bf16 changes nothing.
        return torch.bfloat16 if group["ns_dtype"] == torch.bfloat16 else torch.float32

    def _gather_replicated(
        self, params: list[Tensor], updates: list[Tensor], group: dict[str, Any]
    ) -> list[Tensor]:
        """Replicated parameters: each owner orthogonalises its matrices; one all-gather of the
        results (padded to the largest share) gives every process every update."""
        W, me, dtype = dist.get_world_size(), dist.get_rank(), self._send_dtype(group)
        if W == 1:  # one process under torchrun: nothing to share
            return self._ortho(updates, group)
        owners = assign_owners(tuple(tuple(p.shape) for p in params), W, group["ns_steps"])
        sizes = [0] * W
        for p, r in zip(params, owners, strict=True):
            sizes[r] += p.numel()
        device = updates[0].device
        owned = [u for u, r in zip(updates, owners, strict=True) if r == me]
        mine = [o.to(dtype).reshape(-1) for o in self._ortho(owned, group)]
        send = torch.zeros(max(sizes), dtype=dtype, device=device)
        if mine:
            torch.cat(mine, out=send[: sizes[me]])
        recv = torch.empty(W * max(sizes), dtype=dtype, device=device)
        _ALL_GATHER(recv, send)
        recv = recv.view(W, max(sizes))
        offsets, out = [0] * W, []
        for p, r in zip(params, owners, strict=True):
            out.append(recv[r, offsets[r] : offsets[r] + p.numel()].view(p.shape))
            offsets[r] += p.numel()
        return out

    def _exchange_shards(
        self, params: list[Tensor], updates: list[Tensor], group: dict[str, Any]
    ) -> list[Tensor]:
        """FSDP2 row shards: all-to-all this process's rows of each matrix to its owner, which
        orthogonalises the whole matrix; all-to-all each process's rows of the results back."""
        mesh = params[0].device_mesh
        pg, W, me = mesh.get_group(), mesh.size(), mesh.get_local_rank()
        dtype = self._send_dtype(group)
        shapes = tuple(tuple(p.shape) for p in params)
        owners = assign_owners(shapes, W, group["ns_steps"])
        rows = [[shard_rows(s[0], W, r) for r in range(W)] for s in shapes]
        for i, u in enumerate(updates):
            if u.shape[0] != rows[i][me][1] - rows[i][me][0]:
                raise ValueError(f"a shard of {shapes[i]} has {u.shape[0]} rows on rank {me}")

        def part(i: int, r: int) -> int:  # elements of matrix i on rank r
            start, end = rows[i][r]
            return (end - start) * shapes[i][1]

        mine = [i for i, r in enumerate(owners) if r == me]
        # 1. Rows to owners: to rank r, my rows of the matrices r owns, in order.
        send = [
            updates[i].to(dtype).reshape(-1)
            for r in range(W)
            for i in range(len(params))
            if owners[i] == r
        ]
        in_split = [
            sum(part(i, me) for i in range(len(params)) if owners[i] == r) for r in range(W)
        ]
        out_split = [sum(part(i, r) for i in mine) for r in range(W)]
        device = updates[0].device
        received = _all_to_all(send, in_split, out_split, dtype, device, pg)
        # From each source rank, its rows of my matrices in order: assemble whole matrices.
        pieces = {i: [] for i in mine}
        offset = 0
        for r in range(W):
            for i in mine:
                n = part(i, r)
                pieces[i].append(received[offset : offset + n])
                offset += n
        full = {i: torch.cat(pieces[i]).view(shapes[i]) for i in mine}
        ortho = dict(zip(mine, self._ortho([full[i] for i in mine], group), strict=True))
        ortho = {i: o.to(dtype) for i, o in ortho.items()}
        # 2. Results back: to rank r, its rows of each matrix I own.
        back = [ortho[i][rows[i][r][0] : rows[i][r][1]].reshape(-1) for r in range(W) for i in mine]
        received = _all_to_all(back, out_split, in_split, dtype, device, pg)
        out: list[Tensor | None] = [None] * len(params)
        offset = 0
        for r in range(W):
            for i in range(len(params)):
                if owners[i] == r:
                    n = part(i, me)
                    start, end = rows[i][me]
                    out[i] = received[offset : offset + n].view(end - start, shapes[i][1])
                    offset += n
        return out  # type: ignore[return-value]


# torch >= 2.13 names it all_gather_single (and deprecates the older name).
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _all_to_all(
    chunks: list[Tensor], in_split: list[int], out_split: list[int], dtype, device, pg
) -> Tensor:
    """One ``all_to_all_single`` of the concatenated ``chunks`` (``in_split`` elements to each
    rank), returning the ``out_split`` elements received from each rank, concatenated."""
    send = torch.cat(chunks) if chunks else torch.empty(0, dtype=dtype, device=device)
    recv = torch.empty(sum(out_split), dtype=dtype, device=device)
    dist.all_to_all_single(recv, send, out_split, in_split, group=pg)
    return recv


def _row_sharded(p: Tensor) -> bool:
    """A DTensor sharded by rows over a 1-D mesh (what fully_shard makes of a matrix)."""
    return (
        isinstance(p, DTensor)
        and p.device_mesh.ndim == 1
        and len(p.placements) == 1
        and isinstance(p.placements[0], Shard)
        and p.placements[0].dim == 0
    )


def _apply(param: Tensor, update: Tensor, group: dict[str, Any]) -> None:
    """param <- param (1 - lr wd) - lr' update, lr' scaled by the full matrix's shape (a
    DTensor's shape is the global one); ``update`` is this process's part of the parameter."""
    lr = float(group["lr"])
    adjusted_lr = _adjust_lr(lr, group["adjust_lr_fn"], param.shape)
    local = param.to_local() if isinstance(param, DTensor) else param
    if group["weight_decay"]:  # a product with 1.0 would change nothing (the paper's 0)
        local.mul_(1 - lr * group["weight_decay"])
    local.add_(update, alpha=-adjusted_lr)
