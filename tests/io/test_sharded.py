"""Model folders saved in shards (``save_model(max_shard_size=...)``) and loading either layout."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from elflow.config import elf_tiny
from elflow.errors import ELFError
from elflow.io.artifact import ArtifactConfig, load_model, save_model, shard_bytes
from elflow.io.model_sources import WEIGHTS, WEIGHTS_INDEX, resolve_source
from elflow.model import build_model
from tests.builders import perturb

CFG = elf_tiny(encoder_dim=8, vocab_size=20, max_length=16)


def _model(seed: int = 0):
    torch.manual_seed(seed)
    return perturb(build_model(CFG), seed)


def _nbytes(model) -> int:
    return sum(v.numel() * v.element_size() for v in model.state_dict().values())


def _same(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def _shards(folder):
    return sorted(p.name for p in folder.glob("model-*-of-*.safetensors"))


def test_sharded_save_writes_an_index_and_loads_the_same_weights(tmp_path):
    model = _model()
    limit = _nbytes(model) // 3
    save_model(tmp_path / "m", model, ArtifactConfig(model=CFG), max_shard_size=limit)
    folder = tmp_path / "m"
    shards = _shards(folder)
    assert not (folder / WEIGHTS).exists()
    assert len(shards) >= 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((folder / WEIGHTS_INDEX).read_text())
    assert index["metadata"]["total_size"] == _nbytes(model)
    assert set(index["weight_map"]) == set(model.state_dict())
    assert sorted(set(index["weight_map"].values())) == shards
    for name in shards:
        part = load_file(str(folder / name))
        assert sum(v.numel() * v.element_size() for v in part.values()) <= limit
        assert all(index["weight_map"][k] == name for k in part)
    assert resolve_source(str(folder)).path == folder
    loaded, config = load_model(folder)
    assert _same(loaded, model) and config.model == CFG


def test_small_weights_stay_one_file_and_sizes_parse(tmp_path):
    save_model(tmp_path / "m", _model(), ArtifactConfig(model=CFG), max_shard_size="1GiB")
    assert (tmp_path / "m" / WEIGHTS).is_file() and not (tmp_path / "m" / WEIGHTS_INDEX).exists()
    assert shard_bytes("15MiB") == 15 * 2**20 and shard_bytes("16MB") == 16 * 10**6
    assert shard_bytes(" 2 kb ") == 2000 and shard_bytes(123) == 123
    for bad in ("0MB", "15 parsecs", -1, 0, True, 1.5):
        with pytest.raises(ELFError, match="max_shard_size must be a positive"):
            shard_bytes(bad)


def test_resaving_in_the_other_layout_removes_the_earlier_weights(tmp_path):
    folder = tmp_path / "m"
    first, second, third = _model(0), _model(1), _model(2)
    save_model(folder, first, ArtifactConfig(model=CFG))
    save_model(folder, second, ArtifactConfig(model=CFG), overwrite=True, max_shard_size=4096)
    assert not (folder / WEIGHTS).exists() and len(_shards(folder)) > 1
    assert _same(load_model(folder)[0], second)
    save_model(folder, third, ArtifactConfig(model=CFG), overwrite=True)
    assert (folder / WEIGHTS).is_file() and _shards(folder) == []
    assert not (folder / WEIGHTS_INDEX).exists()
    assert _same(load_model(folder)[0], third)


def test_a_folder_holding_only_shards_is_not_replaced_without_overwrite(tmp_path):
    folder = tmp_path / "m"
    save_model(folder, _model(0), ArtifactConfig(model=CFG), max_shard_size=4096)
    (folder / "config.json").unlink()  # the index alone marks the model
    with pytest.raises(ELFError, match=r"already holds model\.safetensors\.index\.json"):
        save_model(folder, _model(1), ArtifactConfig(model=CFG))


def test_sharding_refuses_ema_weights(tmp_path):
    model = _model()
    ema = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ELFError, match="save without ema_state"):
        save_model(tmp_path / "m", model, ArtifactConfig(model=CFG), ema, max_shard_size=4096)
    assert not (tmp_path / "m").exists()


def test_damaged_shards_are_one_line_errors(tmp_path):
    folder = tmp_path / "m"
    save_model(folder, _model(), ArtifactConfig(model=CFG), max_shard_size=4096)
    shards = _shards(folder)
    index_text = (folder / WEIGHTS_INDEX).read_text()

    (folder / shards[-1]).unlink()
    with pytest.raises(ELFError, match=f"names the shard '{shards[-1]}', which is not a file"):
        load_model(folder)
    save_model(folder, _model(), ArtifactConfig(model=CFG), overwrite=True, max_shard_size=4096)

    index = json.loads(index_text)
    key = next(iter(index["weight_map"]))
    index["weight_map"][key] = "../elsewhere.safetensors"
    (folder / WEIGHTS_INDEX).write_text(json.dumps(index))
    with pytest.raises(ELFError, match="which is not a file in"):
        load_model(folder)

    index = json.loads(index_text)
    moved = [k for k, v in index["weight_map"].items() if v == shards[-1]][-1]
    index["weight_map"][moved] = shards[0]  # the index says shard 1, the tensor is in the last
    (folder / WEIGHTS_INDEX).write_text(json.dumps(index))
    with pytest.raises(ELFError, match=f"holds {moved}, which {WEIGHTS_INDEX} does not put"):
        load_model(folder)

    index = json.loads(index_text)
    index["weight_map"]["decoder.extra"] = shards[0]
    (folder / WEIGHTS_INDEX).write_text(json.dumps(index))
    with pytest.raises(ELFError, match=r"places 1 weights \(decoder\.extra"):
        load_model(folder)

    (folder / WEIGHTS_INDEX).write_text("{not json")
    with pytest.raises(ELFError, match="the index is damaged"):
        load_model(folder)

    (folder / WEIGHTS_INDEX).write_text(index_text)
    save_file({"x": torch.zeros(2)}, str(folder / shards[0]))  # a shard with other contents
    with pytest.raises(ELFError, match="holds x, which"):
        load_model(folder)


def test_a_tensor_larger_than_a_shard_is_split_into_rows_and_joined(tmp_path):
    model = _model()
    big = max(model.state_dict().items(), key=lambda kv: kv[1].numel())
    limit = big[1].numel() * big[1].element_size() // 3 + 1  # 3 blocks of rows, at least
    save_model(tmp_path / "m", model, ArtifactConfig(model=CFG), max_shard_size=limit)
    folder = tmp_path / "m"
    index = json.loads((folder / WEIGHTS_INDEX).read_text())
    pieces = index["metadata"]["split"][big[0]]
    assert len(pieces) >= 3 and pieces[0] == f"{big[0]}:0" and big[0] not in index["weight_map"]
    for name in _shards(folder):
        part = load_file(str(folder / name))
        assert sum(v.numel() * v.element_size() for v in part.values()) <= limit
    assert _same(load_model(folder)[0], model)

    index["metadata"]["split"][big[0]] = [*pieces, f"{big[0]}:99"]
    (folder / WEIGHTS_INDEX).write_text(json.dumps(index))
    with pytest.raises(ELFError, match=f"splits {big[0]}, but its part {big[0]}:99 is in no"):
        load_model(folder)
    index["metadata"]["split"] = {big[0]: "not a list"}
    (folder / WEIGHTS_INDEX).write_text(json.dumps(index))
    with pytest.raises(ELFError, match=r"metadata\.split is not a mapping"):
        load_model(folder)
