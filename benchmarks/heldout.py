"""Over-fitting check for a trained model: its loss on validation rows against training rows.

Usage:
    python benchmarks/heldout.py --model src/elflow/demo_model --preset bible-tiny --rows 729

The computation of ``train.eval_every`` (``elflow/heldout.py``) for an ELF model trained on the
preset's data (its task, data and objective, with the model's padding, noise scale and t_eps;
the ELF objective, also for a distilled student): ``--rows`` evenly spaced rows of each split,
the j-th with the draws of stream position j, so both splits see the same draws. Also prints the
denoiser's L2 per band of t (the same draws).
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from itertools import pairwise

import torch

from elflow.config.run_presets import preset
from elflow.data.rows import build_dataset
from elflow.distill.curriculum import teacher_objective
from elflow.generation.pipeline import ELFPipeline, model_encoder
from elflow.objective import elf_loss
from elflow.train.batches import make_batch
from elflow.train.forward import TrainForward
from elflow.train.heldout import HeldOutSplit, RowSubset, heldout_loss, spread_rows
from elflow.train.objective_draws import sample_draws_keyed
from elflow.train.resume import model_encoder_config
from elflow.train.step import ELFObjective

BANDS = (0.0, 0.1, 0.2, 0.3, 0.5, 1.0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="any elflow model source")
    p.add_argument("--preset", default="bible-tiny", help="gives the data and the objective")
    p.add_argument("--rows", type=int, default=729, help="rows of each split (at most)")
    p.add_argument("--chunk", type=int, default=64)
    args = p.parse_args()

    pipe = ELFPipeline.from_pretrained(args.model)
    acfg, net = pipe.config, pipe.model.eval()
    cfg = preset(args.preset)
    cfg = replace(
        cfg,
        model=acfg.model,
        objective=teacher_objective(args.model, acfg, cfg.objective),
        encoder=model_encoder_config(acfg),
    )
    encoder = model_encoder(acfg)
    pad = pipe.tokens.eos_id if acfg.pad_with_eos else pipe.tokens.pad_id
    L, objective, dev = acfg.model.max_length, ELFObjective(cfg), torch.device("cpu")
    print(f"{args.model}: up to {args.rows} evenly spaced rows per split, preset {args.preset}")
    for name, split in (("train_rows", "train"), ("valid", "valid")):
        data = build_dataset(cfg.data, pipe.tokenizer, L, acfg.max_input_length, pad, split)
        rows, keys = spread_rows(len(data), args.rows)
        subset = RowSubset(data, rows)
        held = HeldOutSplit(
            name,
            lambda i, k, subset=subset: make_batch(cfg, subset, None, encoder, dev, i, k),
            keys,
            args.chunk,
        )
        scores = heldout_loss(objective, TrainForward(net), held, dev)
        bands = _l2_by_band(net, held, cfg)
        print(
            f"{name:>10}: loss {scores[name + '_loss']:.4f}  l2 {scores[name + '_l2']:.4f}  "
            f"ce {scores[name + '_ce']:.4f}  | l2 by t band: "
            + "  ".join(f"[{a:.1f},{b:.1f}) {v:.4f}" for (a, b), v in bands.items())
        )


@torch.no_grad()
def _l2_by_band(net, held: HeldOutSplit, cfg) -> dict[tuple[float, float], float]:
    """Mean of the rows' denoiser L2 per band of t (rows are all L tokens when padding with EOS)."""
    sums: dict[tuple[float, float], list[float]] = {}
    for positions, batch in held.batches():
        L, E = batch.x.shape[1:]
        draws = sample_draws_keyed(positions.tolist(), L, E, cfg.objective, cfg.train.seed)
        for i in range(len(positions)):  # one row at a time: per-row L2 from the pure function
            if draws.decoder_active[i]:
                continue
            row = type(batch)(
                x=batch.x[i : i + 1],
                input_ids=batch.input_ids[i : i + 1],
                attention_mask=batch.attention_mask[i : i + 1],
            )
            one = type(draws)(
                **{f: getattr(draws, f)[i : i + 1] for f in draws.__dataclass_fields__}
            )
            t = float(one.t)
            band = next((a, b) for a, b in pairwise(BANDS) if a <= t < b)
            l2 = float(elf_loss(TrainForward(net), row, one, cfg.objective).l2_loss)
            s = sums.setdefault(band, [0.0, 0.0])
            s[0], s[1] = s[0] + l2, s[1] + 1
    return {b: s[0] / s[1] for b, s in sorted(sums.items())}


if __name__ == "__main__":
    main()
