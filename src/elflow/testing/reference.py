"""Parity checker against the authors' reference tensors.

The tiny fixture (:data:`BUNDLED_FIXTURE`, with its ``.json`` of configs and cases) ships with
elflow: tensors produced by the authors' PyTorch code on a tiny model in fp32 on a CPU, its
weights as ``param/<official key>``.

:func:`check_fixture` rebuilds the network from the fixture's ``param/*`` tensors through the
official-checkpoint import, runs every case with elflow's own network, objective and sampler steps,
and reports one normalised error per compared quantity (every entry must be <= 1e-4; token entries
count mismatches and must be 0). All sizes and case lists come from the sibling ``.json``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import Tensor

from elflow.config import ObjectiveConfig
from elflow.errors import ELFError
from elflow.io.official import (
    elflow_to_official,
    infer_model_config,
    load_state_dict_strict,
    official_to_elflow,
)
from elflow.model import ELF
from elflow.objective import Batch, elf_loss
from elflow.sampling import Condition, ode_step, sde_step
from elflow.sampling.denoiser import decode_tokens, make_denoiser
from elflow.train.forward import TrainForward
from elflow.train.objective_draws import Draws

BUNDLED_FIXTURE = Path(__file__).resolve().parent / "fixtures" / "elf_reference_tiny.safetensors"
"""The reference fixture shipped with elflow (``elflow check-fixture`` with no argument)."""


def _max_abs(a: Tensor, b: Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def objective_config_from_reference(c: dict) -> ObjectiveConfig:
    """Map a reference training config (the fixture's ``train_*_config``) to ours."""
    return ObjectiveConfig(
        t_eps=c["t_eps"],
        noise_scale=c["denoiser_noise_scale"],
        time_mean=c["denoiser_p_mean"],
        time_std=c["denoiser_p_std"],
        decoder_prob=c["decoder_prob"],
        decoder_noise_scale=c["decoder_noise_scale"],
        decoder_mean=c["decoder_p_mean"],
        decoder_std=c["decoder_p_std"],
        self_cond_prob=c["self_cond_prob"],
        w_min=c["self_cond_cfg_min"],
        w_max=c["self_cond_cfg_max"],
        label_drop_prob=c["label_drop_prob"],
        pad_with_eos=c["pad_token"] == "eos",
    )


def _build_model(tensors: dict[str, Tensor], meta: dict) -> ELF:
    official = {k[len("param/") :]: v for k, v in tensors.items() if k.startswith("param/")}
    m = meta["model"]
    cfg = infer_model_config(official, max_length=m["max_length"])
    expected = {
        "encoder_dim": m["text_encoder_dim"],
        "hidden_size": m["hidden_size"],
        "depth": m["depth"],
        "num_heads": m["num_heads"],
        "bottleneck_dim": m["bottleneck_dim"],
        "num_time_tokens": m["num_time_tokens"],
        "num_scale_tokens": m["num_self_cond_cfg_tokens"],
        "num_mode_tokens": m["num_model_mode_tokens"],
        "vocab_size": m["vocab_size"],
    }
    wrong = {k: (getattr(cfg, k), v) for k, v in expected.items() if getattr(cfg, k) != v}
    if wrong:
        raise ELFError(
            f"architecture inferred from the fixture's tensors disagrees with json: {wrong}"
        )
    model = ELF(cfg)
    load_state_dict_strict(model, official_to_elflow(official))
    return model


def _check_forward(model: ELF, f: dict[str, Tensor], report: dict[str, float]) -> None:
    x, t, w = f["fwd/x_selfcond"], f["fwd/t"], f["fwd/sc_scale"]
    cases = {
        "case1": (x, 0.0, None),
        "case2": (x, f["fwd/decoder_active"], None),
        "case3": (x, 1.0, f["fwd/attention_mask"]),
        "case4": (f["fwd/x_plain"], 0.0, None),
    }
    with torch.no_grad():
        for name, (x_in, gate, key_mask) in cases.items():
            if f"fwd/{name}_out" not in f:
                continue
            out, hidden = model(x_in, t, w, gate, key_mask)
            report[f"fwd/{name}_out"] = _max_abs(out, f[f"fwd/{name}_out"])
            if f"fwd/{name}_logits" in f:
                logits = model.decode_logits(hidden)
                report[f"fwd/{name}_logits"] = _max_abs(logits, f[f"fwd/{name}_logits"])


def _check_training(
    model: ELF, f: dict[str, Tensor], case: str, cfg: ObjectiveConfig, report: dict[str, float]
) -> None:
    def g(key: str) -> Tensor:
        return f[f"{case}/{key}"]

    batch = Batch(
        x=g("x0"),
        input_ids=g("input_ids").round().long(),
        attention_mask=g("attention_mask"),
        cond_mask=g("cond_seq_mask"),
        label_drop=g("label_drop_mask"),
    )
    draws = Draws(
        t=g("draw/t"),
        noise=g("draw/noise"),
        decoder_active=g("draw/decoder_active"),
        decoder_lambda=g("draw/decoder_lambda"),
        decoder_noise=g("draw/decoder_noise"),
        use_self_cond=g("draw/use_self_cond"),
        w=g("draw/sc_cfg_scale"),
    )
    model.train()
    model.zero_grad(set_to_none=True)
    out = elf_loss(TrainForward(model), batch, draws, cfg, procedure="efficient")
    out.loss.backward()
    for name in ("loss", "l2_loss", "ce_loss"):
        ref = g(name).reshape(()).double()
        ours = getattr(out, name).detach().double()
        report[f"{case}/{name}"] = (ours - ref).abs().item() / max(1.0, ref.abs().item())
    grads = {
        k: (p.grad if p.grad is not None else torch.zeros_like(p))
        for k, p in model.named_parameters()
    }
    for key, grad in elflow_to_official(grads).items():
        ref = f.get(f"{case}/grad/{key}")
        if ref is None:
            raise ELFError(f"fixture has no {case}/grad/{key}")
        scale = ref.abs().max().item()
        report[f"{case}/grad/{key}"] = _max_abs(grad, ref) / (scale if scale > 0 else 1.0)
    model.zero_grad(set_to_none=True)
    model.eval()


def _check_steps(model: ELF, f: dict[str, Tensor], meta: dict, report: dict[str, float]) -> None:
    sc = meta["sampling_config"]
    s, t_eps = sc["denoiser_noise_scale"], sc["t_eps"]
    for name, case in meta.get("steps", {}).items():
        p = f"step/{name}"
        z, x_prev = f[f"{p}/z"], f[f"{p}/x_pred_prev"]
        B = z.shape[0]
        t = torch.full((B,), float(case["t"]))
        t_next = torch.full((B,), float(case["t_next"]))
        cond = None
        if case["conditional"]:
            cond = Condition(f[f"{p}/cond_seq"], f[f"{p}/cond_seq_mask"])
        denoise = make_denoiser(
            model, case["self_cond_cfg_scale"], t_eps, cond, float(case["cfg_scale"])
        )
        if case["sampler"] == "sde" and float(case["t_next"]) < 1.0:
            z_next, x_hat = sde_step(
                denoise, z, x_prev, t, t_next, float(case["gamma"]), f[f"{p}/noise_raw"], s, cond
            )
        else:
            z_next, x_hat = ode_step(denoise, z, x_prev, t, t_next)
        report[f"{p}/z_next"] = _max_abs(z_next, f[f"{p}/z_next"])
        report[f"{p}/x_pred"] = _max_abs(x_hat, f[f"{p}/x_pred"])


def check_fixture(safetensors_path: str | Path = BUNDLED_FIXTURE) -> dict[str, float]:
    """Compare elflow against one reference fixture; every returned value must be <= 1e-4.

    Args:
        safetensors_path: the fixture's ``.safetensors`` file (default: the bundled one); its
            ``.json`` sibling holds the configs and case list.
    """
    path = Path(safetensors_path)
    meta_path = path.with_suffix(".json")
    if not path.is_file() or not meta_path.is_file():
        raise ELFError(f"fixture {path} or its sibling {meta_path.name} does not exist")
    try:
        tensors = load_file(str(path))
    except Exception as e:  # safetensors raises its own error types
        raise ELFError(f"cannot read fixture {path}: {e}; it is truncated or corrupt") from None
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ELFError(f"cannot read fixture metadata {meta_path}: {e}") from None
    if not isinstance(meta, dict) or "model" not in meta:
        raise ELFError(f"{meta_path} has no 'model' section; it is not a reference fixture's")
    try:
        return _check_all(tensors, meta)
    except KeyError as e:
        raise ELFError(f"fixture {path} lacks the entry {e}; it is incomplete") from None


def _check_all(tensors: dict[str, Tensor], meta: dict) -> dict[str, float]:
    report: dict[str, float] = {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = _build_model(tensors, meta).eval()
        _check_forward(model, tensors, report)
        for case in ("train_uncond", "train_cond"):
            if f"{case}_config" in meta and f"{case}/x0" in tensors:
                cfg = objective_config_from_reference(meta[f"{case}_config"])
                _check_training(model, tensors, case, cfg, report)
        with torch.no_grad():
            _check_steps(model, tensors, meta, report)
            if "decode/z" in tensors:
                dec = meta.get("decode", {})
                w, t = dec.get("self_cond_cfg_scale", 3.0), dec.get("t", 1.0)
                tokens = decode_tokens(model, tensors["decode/z"], w, t)
                ref = tensors["decode/tokens"].round().long()
                report["decode/tokens"] = float((tokens != ref).sum().item())
    return report
