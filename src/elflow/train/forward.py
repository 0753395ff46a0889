"""The training objectives' forward function (ELF_SPEC §3, §9): the network adapted to what
:func:`elflow.objective.elf_loss` and the distillation objectives take, a forward function
``(x_in, t, w, gate, head_rows) -> (x_pred, logits)``; they never see :class:`ELF`."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from elflow.model import ELF
from elflow.runtime import bf16_fast_path as fastpath


class TrainForward(nn.Module):
    """One network call of an objective: x-prediction, plus decoder logits for ``head_rows``.

    NOTE: the decoder head runs inside this forward so that DDP and FSDP2, which wrap this module,
    see every parameter use inside ``forward`` (a separate ``decode_logits`` call would bypass
    FSDP2's unsharding and DDP's unused-parameter bookkeeping). With zero decoder rows the head
    still runs on an empty slice, so its parameters get (zero) gradients on every rank.
    """

    def __init__(self, model: ELF) -> None:
        super().__init__()
        self.model = model

    @property
    def deterministic(self) -> bool:
        """The output is a function of the input (no dropout is active), so the objective may
        reuse the trained pass's output instead of a second no-grad pass."""
        return self.model.cfg.dropout == 0.0 or not self.model.training

    @property
    def sees_w(self) -> bool:
        """Whether the network has SC-CFG scale tokens (else its consistent target is w = 1)."""
        return self.model.cfg.num_scale_tokens > 0

    def forward(
        self,
        x_in: Tensor,
        t: Tensor | float,
        w: Tensor | float | None,
        gate: Tensor | float,
        head_rows: Tensor | None = None,
        targets: Tensor | None = None,
        weights: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """(x_pred, decoder logits of ``head_rows``: row indices or a mask; None: no logits).

        With ``targets`` (R, L), the token ids of the R ``head_rows``, and ``weights`` (R, L),
        the second output is instead the head's cross-entropy sum, sum(weights x CE), computed in
        chunks of tokens without ever holding the (R, L, V) logits (:meth:`ELF.decode_loss`).
        """
        # In eval mode without gradients under autocast (held-out losses, a distillation
        # teacher) the blocks take the bf16 fast path; training always runs self.model(...).
        x_pred, hidden = fastpath.forward(self.model, x_in, t, w, gate)
        if head_rows is None:
            return x_pred, None
        if head_rows.dtype == torch.bool:  # a mask (a device read); indices do not wait
            rows = hidden[head_rows]
        else:
            rows = hidden.index_select(0, head_rows)
        if targets is None:
            return x_pred, self.model.decode_logits(rows)
        return x_pred, self.model.decode_loss(rows, targets, weights)[0]
