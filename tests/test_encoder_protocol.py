"""The encoder's one description (EncoderConfig), the one function that builds an encoder from it
(load_encoder), the Encoder protocol FrozenEncoder implements, and the model artifact's use of
both: its encoder fields, and the config.json keys it leaves out for elflow 0.1."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

import pytest
import torch
from transformers import T5Config, T5EncoderModel

from elflow.config import SamplerConfig, elf_tiny
from elflow.config.encoder_config import EncoderConfig
from elflow.errors import ELFError
from elflow.io.artifact_config import (
    KEYS_0_1,
    SAMPLER_KEYS_0_1,
    SAMPLER_KEYS_SINCE_0_2,
    ArtifactConfig,
)
from elflow.text.encoder import FrozenEncoder, load_encoder
from elflow.text.encoder_protocol import Encoder

SRC = Path(__file__).resolve().parents[1] / "src" / "elflow"
CFG = elf_tiny(encoder_dim=32, vocab_size=100, max_length=8)


@pytest.fixture(scope="module")
def t5_folder(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    cfg = T5Config(d_model=32, d_kv=8, num_heads=4, num_layers=2, d_ff=64, vocab_size=100)
    folder = tmp_path_factory.mktemp("t5")
    T5EncoderModel(cfg).save_pretrained(folder)
    return folder


def test_frozen_encoder_implements_the_protocol(tiny_encoder):
    assert isinstance(tiny_encoder, Encoder)
    assert tiny_encoder.device == torch.device("cpu") and tiny_encoder.hidden_size == 32
    assert not isinstance(torch.nn.Linear(2, 2), Encoder)


def test_load_encoder_builds_what_the_config_describes(t5_folder):
    config = EncoderConfig(name=str(t5_folder), latent_mean=0.1, latent_std=0.5, layer=1)
    encoder = load_encoder(config, device="cpu", dtype=torch.bfloat16)
    assert isinstance(encoder, FrozenEncoder) and isinstance(encoder, Encoder)
    assert (encoder.name, encoder.layer, encoder.latent_mean, encoder.latent_std) == (
        str(t5_folder),
        1,
        0.1,
        0.5,
    )
    assert encoder.dtype == torch.bfloat16
    ids = torch.randint(5, 100, (2, 6))
    raw = encoder.encode_raw(ids, torch.ones_like(ids))
    torch.testing.assert_close(encoder(ids, torch.ones_like(ids)), (raw - 0.1) / 0.5)
    # latent_std 0 (measure it): the raw hidden states until it is set
    assert load_encoder(EncoderConfig(name=str(t5_folder), latent_std=0)).latent_std == 1.0
    with pytest.raises(ELFError, match="does not exist"):
        load_encoder(EncoderConfig(name=str(t5_folder / "missing")))


def test_the_artifact_describes_its_encoder_with_encoder_config():
    encoder = EncoderConfig(name="enc", tokenizer="tok", latent_mean=0.3, latent_std=0.4, layer=2)
    config = ArtifactConfig(model=CFG, **ArtifactConfig.encoder_fields(encoder))
    assert (config.encoder, config.tokenizer, config.encoder_layer) == ("enc", "tok", 2)
    assert config.encoder_config == encoder
    # the encoder's own tokenizer is written out, as config.json always named one
    own = ArtifactConfig(model=CFG, **ArtifactConfig.encoder_fields(EncoderConfig(name="enc")))
    assert own.tokenizer == "enc" and own.encoder_config.tokenizer_name == "enc"
    data = config.to_json()  # the file keeps its flat keys
    assert (data["encoder"], data["encoder_layer"], data["latent_std"]) == ("enc", 2, 0.4)
    assert ArtifactConfig.from_json(json.loads(json.dumps(data))) == config
    # a model's encoder is described whatever its values (the run config's checks are not here)
    layered = ArtifactConfig(model=CFG, encoder="enc", encoder_layer=4)  # latent_std 0.2
    assert layered.encoder_config.layer == 4 and layered.encoder_config.latent_std == 0.2


def test_keys_left_out_for_elflow_0_1_are_derived_from_the_dataclasses():
    later = {f.name for f in fields(SamplerConfig)} - set(SAMPLER_KEYS_0_1)
    assert set(SAMPLER_KEYS_SINCE_0_2) == later >= {"gamma_schedule", "pc_snr", "length"}
    assert all(
        SAMPLER_KEYS_SINCE_0_2[f.name] == f.default
        for f in fields(SamplerConfig)
        if f.name in later
    )
    data = ArtifactConfig(model=CFG).to_json()
    assert set(data["sampler"]) == set(SAMPLER_KEYS_0_1)
    assert set(data) == {"format", "format_version", *KEYS_0_1}
    changed = ArtifactConfig(model=CFG, sampler=SamplerConfig(pc_snr=0.2), packed=True).to_json()
    assert changed["sampler"]["pc_snr"] == 0.2 and changed["packed"] is True
    old = {k: v for k, v in data.items()}  # a config.json of elflow 0.1 loads unchanged
    assert ArtifactConfig.from_json(old) == ArtifactConfig(model=CFG)
