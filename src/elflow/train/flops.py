"""Matrix FLOPs of an ELF training step, worked out from the shapes (for MFU and the scale model).

One convention (docs/training.md, "FLOPs and MFU"), two counts per training row:

- **model FLOPs** (:func:`model_row_flops`, MFU's numerator): the useful work of a step at the
  objective's branch probabilities, whatever runs it: the frozen encoder's forward when the step
  runs it, the trained pass forward and backward on every row, the decoder head on the decoder
  rows, one no-grad self-conditioning pass on the self-conditioned denoiser rows (ELF_SPEC §3, §9).
- **executed FLOPs** (:func:`executed_row_flops`): every product the step really runs: a second
  no-grad pass under dropout, the reference procedure's passes and heads on every row, block
  forwards recomputed under activation checkpointing, rows a compiled step pads its branches
  with, and the forward product that flash attention recomputes in its backward.
  :func:`reference_step_flops` counts the authors' PyTorch step by the same rule.

Products only (2 FLOPs per multiply-add; elementwise work is not counted): the backward of a
linear layer is twice its forward, except where its input needs no gradient (the first
projection, the timestep embedders' first layers); attention's backward is twice its forward in
model FLOPs, 2.5 times in executed FLOPs (``torch.utils.flop_counter``'s count of the fused
kernels). ``tests/train/test_step_counts.py`` checks these formulas against
:class:`elflow.runtime.profiling.OpCounter`'s count of a real step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from elflow.config import ModelConfig, ObjectiveConfig

FREQ_DIM = 256
"""The timestep embedders' sinusoidal feature width (ELF_SPEC §2)."""


@dataclass(frozen=True)
class PassFlops:
    """Forward FLOPs of one network pass over one row of L tokens, by part."""

    body: float
    """Input projections, prefix embedders, blocks (attention included) and the flow head."""
    attention: float
    """The part of ``body`` in attention's two products (QK^T and the weighted sum of V)."""
    blocks: float
    """The part of ``body`` in the transformer blocks (bf16 under autocast; the rest of the body
    and the head are what the spec keeps in fp32)."""
    first_layers: float
    """The part of ``body`` whose input needs no gradient (no input-gradient product)."""
    head: float
    """The decoder head on L tokens."""


def pass_flops(cfg: ModelConfig, length: int) -> PassFlops:
    """Forward FLOPs of one row of ``length`` sequence tokens through the network."""
    D, E, L, F = cfg.hidden_size, cfg.encoder_dim, length, cfg.mlp_hidden
    N = cfg.num_prefix_tokens + L
    first = 2 * (2 * E) * E * L if cfg.self_condition else 0.0
    embedders = 1 + (cfg.num_scale_tokens > 0)
    first += embedders * 2 * FREQ_DIM * D  # one row's embedding, first layer
    body = first + embedders * 2 * D * D
    body += 2 * (E * cfg.bottleneck_dim + cfg.bottleneck_dim * D) * L  # text_proj
    per_token = 2 * D * 3 * D + 2 * D * D + 2 * D * 2 * F + 2 * F * D  # qkv, proj, w12, w3
    attention = cfg.depth * 4 * N * N * D
    blocks = cfg.depth * per_token * N + attention
    body += blocks + 2 * D * E * L  # and the flow head
    head = 2 * (D * E + E * cfg.vocab_size) * L
    return PassFlops(body=body, attention=attention, blocks=blocks, first_layers=first, head=head)


def train_row_flops(
    cfg: ModelConfig,
    length: int,
    dec_share: float,
    sc_share: float,
    encoder_per_token: float = 0.0,
    procedure: str = "efficient",
    deterministic: bool = True,
    attention_backward: float = 2.0,
) -> float:
    """FLOPs per training row: expected when the shares are probabilities, exact when they are
    a batch's fractions of decoder rows and of self-conditioned denoiser rows.
    ``attention_backward``: 2 (model FLOPs) or 2.5 (flash attention's recomputation counted)."""
    p = pass_flops(cfg, length)
    heads = 1.0 if procedure == "reference" else dec_share  # the reference's head on every row
    trained = 3 * p.body + (attention_backward - 2) * p.attention - p.first_layers
    trained += 3 * heads * p.head
    if procedure == "reference":  # two no-grad passes with the head
        nograd = 2 * (p.body + p.head)
    else:
        nograd = sc_share * p.body * (1 if deterministic else 2)
    return trained + nograd + encoder_per_token * length


def branch_probabilities(objective: ObjectiveConfig) -> tuple[float, float]:
    """(decoder rows, self-conditioned denoiser rows): each row's probability of the branch."""
    return objective.decoder_prob, objective.self_cond_prob * (1 - objective.decoder_prob)


def model_row_flops(
    cfg: ModelConfig,
    objective: ObjectiveConfig,
    length: int,
    encoder_per_token: float = 0.0,
) -> float:
    """Model FLOPs per training row (MFU's numerator): the trained pass forward and backward,
    the decoder head on the decoder rows, one no-grad pass on the self-conditioned rows, at the
    branch probabilities, attention's backward 2x; ``encoder_per_token`` when the step encodes.
    The same for every procedure, dropout, compile mode and checkpointing setting."""
    dec, sc = branch_probabilities(objective)
    return train_row_flops(cfg, length, dec, sc, encoder_per_token, "efficient", True, 2.0)


def expected_padding(rows: int, p: float, minimum: int) -> float:
    """Expected rows a compiled step adds to a branch of ``rows`` rows each taken with
    probability ``p`` to reach ``minimum`` (:meth:`elflow.train.objective_draws.RowPlan.padded`)."""
    if rows <= 0 or minimum <= 0:
        return 0.0
    return sum(
        (minimum - n) * math.comb(rows, n) * p**n * (1 - p) ** (rows - n)
        for n in range(min(minimum, rows + 1))
    )


def executed_row_flops(
    cfg: ModelConfig,
    objective: ObjectiveConfig,
    length: int,
    encoder_per_token: float = 0.0,
    *,
    procedure: str = "efficient",
    checkpointing: bool = False,
    micro_batch: int = 0,
    min_branch_rows: int = 0,
    attention_backward: float = 2.5,
) -> float:
    """Executed FLOPs per training row, expected at the branch probabilities: what elflow's step
    runs for ``procedure`` (two no-grad passes on the self-conditioned rows when ``cfg.dropout``
    is not 0; the reference's passes and heads on every row), the blocks' forward once more
    (less each block's last product) with activation ``checkpointing``, the rows a compiled
    step pads each branch of a ``micro_batch`` with up to ``min_branch_rows``
    (``train.compile=step``: 2), flash attention's recomputation."""
    dec, sc = branch_probabilities(objective)
    deterministic = cfg.dropout == 0.0
    row = train_row_flops(
        cfg, length, dec, sc, encoder_per_token, procedure, deterministic, attention_backward
    )
    p = pass_flops(cfg, length)
    if checkpointing:
        # Every row's trained pass runs its blocks' forward again, but for each block's last
        # product (the MLP's down projection): torch's non-reentrant checkpoint stops
        # recomputing once the tensors the backward needs are back.
        N = cfg.num_prefix_tokens + length
        row += p.blocks - cfg.depth * 2 * cfg.mlp_hidden * cfg.hidden_size * N
    if procedure == "efficient" and micro_batch and min_branch_rows:
        extra_dec = expected_padding(micro_batch, dec, min_branch_rows)
        extra_sc = expected_padding(micro_batch, sc, min_branch_rows)
        row += (3 * extra_dec * p.head + extra_sc * p.body * (1 if deterministic else 2)) / (
            micro_batch
        )
    return row


def reference_step_flops(
    cfg: ModelConfig,
    length: int,
    encoder_per_token: float = 0.0,
    attention_backward: float = 2.5,
) -> float:
    """Executed FLOPs per row of the authors' PyTorch training step (``train_step.py`` of their
    port), by the same rule: on every row the encoder's forward, a no-grad unconditional pass
    and a no-grad self-conditioned pass (their model's decoder head runs only when
    ``decoder_step_active`` is given, so not in these), and the trained pass forward and backward
    with the decoder head on every row (the CE is masked to the decoder rows afterwards). Their
    model FLOPs are :func:`model_row_flops` (the same network and objective)."""
    p = pass_flops(cfg, length)
    trained = 3 * p.body + (attention_backward - 2) * p.attention - p.first_layers + 3 * p.head
    return trained + 2 * p.body + encoder_per_token * length


def encoder_flops_per_token(config, length: int) -> float:
    """Forward FLOPs per token of a Hugging Face encoder from its config: the products of its
    layers (2 per weight outside the embeddings) and its attention (4 L d per layer)."""
    d = getattr(config, "d_model", None) or config.hidden_size
    layers = getattr(config, "num_layers", None) or config.num_hidden_layers
    inner = getattr(config, "d_kv", 0) * getattr(config, "num_heads", 0) or d
    ff = getattr(config, "d_ff", None) or config.intermediate_size
    gated = "gated" in str(getattr(config, "feed_forward_proj", ""))
    per_layer = 2 * (4 * d * inner) + 2 * (3 if gated else 2) * d * ff + 4 * length * inner
    return float(layers * per_layer)
