"""The frozen text encoder whose contextual embeddings are ELF's latent space.

`FrozenEncoder` wraps a Hugging Face encoder (T5 encoder stack or a BERT-like `AutoModel`), never
trains, and returns normalised latents x = (h - latent_mean) / latent_std in fp32 (spec §3 step
1, §10 latent_std). For conditional tasks the encoder runs with the (B, 1, L, L) mask of spec §4:
source latents never see the target, target latents see everything valid, and label-dropped rows
compute their target latents without the source (spec §3 step 10a).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

import torch
from torch import Tensor, nn

from elflow.config.encoder_config import EncoderConfig
from elflow.errors import ELFError, first_line
from elflow.runtime.hardware import full_precision
from elflow.text.encoder_protocol import Encoder
from elflow.text.encoder_sources import (
    PACKAGED_MODELS,
    check_hub_download,
    how_to_get,
    is_offline,
    looks_like_path,
    resolve_pretrained,
)
from elflow.text.hf_load_report import quiet_load_report, refuse_bad_weights

__all__ = [
    "PACKAGED_MODELS",
    "FrozenEncoder",
    "check_hub_download",
    "encoder_attention_mask",
    "how_to_get",
    "load_encoder",
    "measure_latent_std",
    "resolve_pretrained",
]

_T5_TYPES = {"t5", "mt5", "umt5"}
# Implementations that honour an arbitrary 4-D additive mask; flash-attention kernels only take
# padding masks and would silently drop the source/target structure.
_MASKABLE_ATTN = ("eager", "sdpa")


def encoder_attention_mask(
    attention_mask: Tensor,
    cond_mask: Tensor | None = None,
    label_drop: Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """The encoder's 4-D additive mask: 0 where query i may attend to key j, dtype min elsewhere.

    i may attend to j iff j is valid and (i is not source or j is source); in label-dropped rows a
    target query may not attend to source keys either. A query row left with no key (a fully padded
    row) attends to itself so softmax stays finite.

    NOTE: transformers 5.x rejects (B, L, L) masks and adds a 4-D *boolean* mask as 0/1 under eager
    attention (silently ignoring it), so this must be a float additive mask in the encoder's dtype.

    Args:
        attention_mask: (B, L), 1 at valid tokens.
        cond_mask: (B, L), 1 at source positions; None for unconditional rows.
        label_drop: (B,), True for rows whose target must not see the source.
        dtype: dtype of the returned mask (the encoder's compute dtype).

    Returns:
        (B, 1, L, L) float mask.
    """
    valid = attention_mask.bool()
    B, L = valid.shape
    key_valid = valid[:, None, :]  # (B, 1, L)
    if cond_mask is None:
        allowed = key_valid.expand(B, L, L)
    else:
        src = cond_mask.bool()
        src_q, src_k = src[:, :, None], src[:, None, :]  # (B, L, 1), (B, 1, L)
        target_sees = torch.ones_like(src_k)
        if label_drop is not None:
            target_sees = ~(label_drop.bool().to(src.device)[:, None, None] & src_k)
        allowed = key_valid & torch.where(src_q, src_k, target_sees)  # (B, L, L)
    eye = torch.eye(L, dtype=torch.bool, device=valid.device)
    allowed = allowed | (eye & ~allowed.any(dim=-1, keepdim=True))
    mask = torch.zeros(B, 1, L, L, dtype=dtype, device=valid.device)
    return mask.masked_fill(~allowed[:, None], torch.finfo(dtype).min)


def _num_layers(config) -> int:
    """Blocks in an encoder stack (BERT-like ``num_hidden_layers``, T5 ``num_layers``)."""
    for key in ("num_hidden_layers", "num_layers", "n_layers"):
        n = getattr(config, key, None)
        if isinstance(n, int):
            return n
    return 0


class FrozenEncoder(nn.Module):
    """A pretrained Hugging Face encoder held fixed: no gradients, always in eval mode (an
    :class:`~elflow.text.encoder_protocol.Encoder`)."""

    def __init__(
        self,
        model: nn.Module,
        latent_mean: float = 0.0,
        latent_std: float = 0.2,
        layer: int = 0,
    ):
        super().__init__()
        if latent_std <= 0:
            raise ELFError(f"latent_std must be positive, got {latent_std}; measure it or use 0.2")
        num_layers = _num_layers(model.config)
        if not 0 <= layer <= num_layers:
            raise ELFError(
                f"encoder layer {layer} is out of range for a {num_layers}-layer encoder; "
                f"use 0 (its output) or 1..{num_layers}"
            )
        attn = getattr(model.config, "_attn_implementation", None)
        if attn not in _MASKABLE_ATTN:
            raise ELFError(
                f"encoder attention implementation {attn!r} cannot take the 4-D encoder mask; "
                f"use one of {_MASKABLE_ATTN}"
            )
        self.model = model
        self.name: str | None = None
        self.latent_mean = float(latent_mean)
        self.latent_std = float(latent_std)
        self.layer = int(layer)
        """0: the encoder's output (last_hidden_state); k > 0: the output of its block k."""
        self.model.requires_grad_(False)
        self.model.eval()

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str,
        *,
        latent_mean: float = 0.0,
        latent_std: float = 0.2,
        attn_implementation: str | None = None,
        dtype: torch.dtype | None = None,
        layer: int = 0,
    ) -> FrozenEncoder:
        """Load a local folder or a Hub id; T5-family configs load only the encoder stack."""
        from transformers import (
            AutoConfig,
            AutoModel,
            MT5EncoderModel,
            T5EncoderModel,
            UMT5EncoderModel,
        )

        if attn_implementation not in (None, *_MASKABLE_ATTN):
            raise ELFError(
                f"attn_implementation {attn_implementation!r} cannot take the 4-D encoder mask; "
                f"use one of {_MASKABLE_ATTN}"
            )
        original_name = name_or_path
        name_or_path = resolve_pretrained(name_or_path)
        expanded = os.path.expanduser(name_or_path)
        if not os.path.isdir(expanded) and looks_like_path(name_or_path):
            raise ELFError(
                f"encoder folder '{name_or_path}' does not exist; pass an existing folder"
            )
        source = expanded if os.path.isdir(expanded) else name_or_path
        if not os.path.isdir(expanded):  # a Hub id (a relative folder here is not one)
            check_hub_download(name_or_path, "encoder")
        try:
            config = AutoConfig.from_pretrained(source, trust_remote_code=False)
        except (OSError, ValueError) as e:
            if is_offline() and not os.path.isdir(expanded):
                raise ELFError(
                    f"encoder '{name_or_path}' not found locally and HF_HUB_OFFLINE is set; "
                    "download it or pass a local folder"
                ) from e
            raise ELFError(
                f"cannot load encoder '{name_or_path}' ({first_line(e)}); pass a local model "
                "folder or a Hub model id"
            ) from e
        is_t5 = config.model_type in _T5_TYPES
        if not is_t5 and getattr(config, "is_encoder_decoder", False):
            raise ELFError(
                f"encoder '{name_or_path}' is a {config.model_type} encoder-decoder, not T5; "
                "use a T5-family or an encoder-only model"
            )
        kwargs = {}
        if attn_implementation is not None:
            kwargs["attn_implementation"] = attn_implementation
        if dtype is not None:
            kwargs["dtype"] = dtype
        model_cls = {"t5": T5EncoderModel, "mt5": MT5EncoderModel, "umt5": UMT5EncoderModel}.get(
            config.model_type, AutoModel
        )
        try:
            with quiet_load_report():
                model, info = model_cls.from_pretrained(
                    source,
                    config=config,
                    trust_remote_code=False,
                    output_loading_info=True,
                    ignore_mismatched_sizes=True,  # refused below, in one line
                    **kwargs,
                )
        except Exception as e:  # OSError, a refused pickle, a damaged safetensors file, ...
            reason = first_line(e)
            hint = "" if "pickle holding" in reason else "; check the folder has the model weights"
            raise ELFError(
                f"cannot load encoder weights from '{name_or_path}' ({reason}){hint}"
            ) from e
        refuse_bad_weights(info, name_or_path, is_t5)
        encoder = cls(model, latent_mean=latent_mean, latent_std=latent_std, layer=layer)
        encoder.name = original_name  # recorded next to measured statistics (e.g. latent_std)
        return encoder

    def train(self, mode: bool = True) -> FrozenEncoder:
        # A parent's .train() must not switch on the encoder's dropout.
        return super().train(False)

    @property
    def hidden_size(self) -> int:
        """E, the width of the latents."""
        return int(self.model.config.hidden_size)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def max_positions(self) -> int | None:
        """The longest sequence an encoder with learned absolute positions embeds (BERT: 512;
        RoBERTa: 512 of its 514 rows, whose positions start after the padding index; XLM), read
        from its position table; None without one (T5, DeBERTa-v3), which take any length."""
        config = self.model.config
        if getattr(config, "position_embedding_type", "absolute") != "absolute":
            return None
        owners = (getattr(self.model, "embeddings", None), self.model)  # BERT-like; XLM
        tables = [getattr(o, "position_embeddings", None) for o in owners]
        table = next((t for t in tables if isinstance(t, nn.Embedding)), None)
        if table is None:
            return None
        if table.padding_idx is None:  # positions count from 0
            return table.num_embeddings
        return table.num_embeddings - table.padding_idx - 1

    def check_length(self, length: int) -> None:
        """Refuse rows longer than :attr:`max_positions` with a one-line error."""
        limit = self.max_positions
        if limit is not None and length > limit:
            raise ELFError(
                f"rows of {length} tokens are longer than encoder "
                f"'{self.name or self.model.config.model_type}' can embed ({limit} positions); "
                f"set model.max_length (and max_input_length) to at most {limit}"
            )

    @torch.no_grad()
    def encode_raw(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        cond_mask: Tensor | None = None,
        label_drop: Tensor | None = None,
    ) -> Tensor:
        """Unnormalised hidden states (of ``layer``) in fp32: (B, L) ids -> (B, L, E).

        Always in the encoder's own dtype, also inside a caller's bf16 autocast (sampling with
        ``--bf16``): the latents must be those the model was trained on.
        """
        assert input_ids.shape == attention_mask.shape, (input_ids.shape, attention_mask.shape)
        self.check_length(input_ids.shape[1])
        mask = encoder_attention_mask(attention_mask, cond_mask, label_drop, dtype=self.dtype)
        with full_precision(input_ids.device):
            if self.layer == 0:
                out = self.model(input_ids=input_ids, attention_mask=mask)
                return out.last_hidden_state.float()  # (B, L, E)
            out = self.model(input_ids=input_ids, attention_mask=mask, output_hidden_states=True)
            return out.hidden_states[self.layer].float()  # (B, L, E); [0] is the embeddings

    @torch.no_grad()
    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        cond_mask: Tensor | None = None,
        label_drop: Tensor | None = None,
    ) -> Tensor:
        """Normalised latents x = (h - latent_mean) / latent_std in fp32: (B, L) -> (B, L, E)."""
        h = self.encode_raw(input_ids, attention_mask, cond_mask, label_drop)
        return (h - self.latent_mean) / self.latent_std


@torch.no_grad()
def measure_latent_std(encoder: Encoder, batches: Iterable[Mapping[str, Tensor]]) -> float:
    """RMS of the encoder's raw outputs over valid tokens (spec §10 latent_std).

    Each batch holds `input_ids` and `attention_mask`, and optionally `cond_mask`, all (B, L).
    """
    device = encoder.device
    sum_sq = torch.zeros((), dtype=torch.float64)
    count = 0
    for batch in batches:
        attention_mask = batch["attention_mask"].to(device)
        cond_mask = batch.get("cond_mask")
        h = encoder.encode_raw(
            batch["input_ids"].to(device),
            attention_mask,
            None if cond_mask is None else cond_mask.to(device),
        )  # (B, L, E)
        valid = attention_mask.bool()
        sum_sq += h[valid].double().pow(2).sum().cpu()
        count += int(valid.sum()) * h.shape[-1]
    if count == 0:
        raise ELFError("no valid tokens to measure latent_std on; pass non-empty batches")
    return float((sum_sq / count).sqrt())


def load_encoder(
    config: EncoderConfig,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    attn_implementation: str | None = None,
) -> FrozenEncoder:
    """The frozen encoder ``config`` describes (the one place one is built from a config): its
    weights (:meth:`FrozenEncoder.from_pretrained`), layer and latent normalisation, on
    ``device`` in ``dtype`` (None: as loaded). ``latent_std`` 0 (to be measured) loads with 1,
    the raw hidden states, until it is measured and set."""
    encoder = FrozenEncoder.from_pretrained(
        config.name,
        latent_mean=config.latent_mean,
        latent_std=config.latent_std or 1.0,
        attn_implementation=attn_implementation,
        dtype=dtype,
        layer=config.layer,
    )
    return encoder if device is None else encoder.to(device)
