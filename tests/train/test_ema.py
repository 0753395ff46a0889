import io

import pytest
import torch
from torch import nn

from elflow.config import elf_tiny
from elflow.errors import ELFError
from elflow.model import build_model
from elflow.train.ema import EMA, initial_share


class Scalar(nn.Module):
    def __init__(self, value: float, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.tensor([value], dtype=dtype))


def _set(model: Scalar, value: float) -> None:
    with torch.no_grad():
        model.p.fill_(value)


def test_ema_starts_as_a_copy_and_follows_the_decay():
    model = Scalar(1.0)
    ema = EMA(model, decay=0.5)
    _set(model, 3.0)
    assert ema.shadow["p"].item() == 1.0  # a copy, not a view of the weights
    ema.update(model)
    assert ema.shadow["p"].item() == 2.0  # 0.5 * 1 + 0.5 * 3
    _set(model, 4.0)
    ema.update(model)
    assert ema.shadow["p"].item() == 3.0
    assert ema.num_updates == 2


def test_initial_share_is_the_product_of_the_decays():
    assert initial_share(0.5, False, 3) == pytest.approx(0.125)
    assert initial_share(0.9999, False, 5000) == pytest.approx(0.6065, abs=1e-4)
    assert initial_share(0.999, True, 1) == pytest.approx(0.1)
    assert initial_share(0.999, True, 2) == pytest.approx(0.1 * 2 / 11)
    ema = EMA(nn.Linear(1, 1, bias=False), 0.95, warmup=True)
    expected = 1.0
    for _ in range(300):
        expected *= ema.current_decay()
        ema.num_updates += 1
    assert initial_share(0.95, True, 300) == pytest.approx(expected)


def test_warmup_decay_schedule():
    model = Scalar(0.0)
    ema = EMA(model, decay=0.5, warmup=True)
    decays = []
    for _ in range(11):
        decays.append(ema.current_decay())
        ema.update(model)
    expected = [min(0.5, (1 + k) / (10 + k)) for k in range(11)]
    assert decays == pytest.approx(expected)
    assert decays[0] == pytest.approx(0.1) and decays[8] == 0.5 and decays[10] == 0.5

    model = Scalar(1.0)
    ema = EMA(model, decay=0.9999, warmup=True)
    _set(model, 11.0)
    ema.update(model)
    assert ema.shadow["p"].item() == pytest.approx(0.1 * 1.0 + 0.9 * 11.0)


def test_shadows_are_fp32_for_a_bf16_model():
    model = Scalar(1.0, dtype=torch.bfloat16)
    ema = EMA(model, decay=0.999)
    assert ema.shadow["p"].dtype == torch.float32
    ema.update(model)
    ema.copy_to(model)
    assert model.p.dtype == torch.bfloat16


def test_state_round_trip_continues_identically():
    model = build_model(elf_tiny(encoder_dim=8, vocab_size=20, max_length=8))
    ema = EMA(model, decay=0.9, warmup=True)

    def perturb(step: int) -> None:
        g = torch.Generator().manual_seed(step)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g), alpha=0.01)

    for step in range(2):
        perturb(step)
        ema.update(model)
    buf = io.BytesIO()
    torch.save(ema.state_dict(), buf)
    buf.seek(0)
    changed = EMA(model, decay=0.5)  # a resume with another train.ema_decay follows it
    changed.load_state_dict(torch.load(buf, weights_only=True))
    assert changed.num_updates == 2 and changed.decay == 0.5 and not changed.warmup
    buf.seek(0)
    restored = EMA(model, decay=0.9, warmup=True)
    restored.load_state_dict(torch.load(buf, weights_only=True))
    assert restored.num_updates == 2
    for step in range(2, 4):
        perturb(step)
        ema.update(model)
        restored.update(model)
    for name, s in ema.shadow.items():
        assert torch.equal(s, restored.shadow[name]), name


def test_save_dict_has_the_model_state_dict_keys_and_loads_back():
    model = build_model(elf_tiny(encoder_dim=8, vocab_size=20, max_length=8))
    ema = EMA(model, decay=0.9)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ema.update(model)
    saved = ema.state_dict_for_save()
    assert list(saved) == list(model.state_dict())
    fresh = build_model(elf_tiny(encoder_dim=8, vocab_size=20, max_length=8))
    fresh.load_state_dict(saved)  # strict: same keys, same shapes
    ema.copy_to(model)
    for name, p in model.named_parameters():
        assert torch.equal(p, saved[name])


def test_bad_decay_and_mismatched_state_are_clear_errors():
    with pytest.raises(ELFError, match="decay"):
        EMA(Scalar(0.0), decay=1.5)
    ema = EMA(Scalar(0.0), decay=0.5)
    state = ema.state_dict()
    state["shadow"] = {"q": torch.zeros(1)}
    with pytest.raises(ELFError, match="missing"):
        ema.load_state_dict(state)
    state["shadow"] = {"p": torch.zeros(2)}
    with pytest.raises(ELFError, match="shape"):
        ema.load_state_dict(state)
