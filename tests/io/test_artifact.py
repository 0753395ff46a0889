"""Official checkpoint import, the elflow model artifact, and model-source resolution."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from elflow import errors
from elflow.config import T5_SMALL, SamplerConfig, elf_tiny
from elflow.errors import ELFError
from elflow.io import artifact
from elflow.io import model_sources as sources
from elflow.io.artifact import ArtifactConfig, import_official, load_model, save_model
from elflow.io.model_sources import resolve_source
from elflow.io.official import (
    elflow_to_official,
    infer_model_config,
    official_to_elflow,
    read_official_checkpoint,
    strip_prefixes,
)
from elflow.model import build_model

CFG = elf_tiny(encoder_dim=8, vocab_size=20, max_length=16)


def _perturbed_model(seed: int = 0):
    torch.manual_seed(seed)
    model = build_model(CFG)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    return model.eval()


def _reference_payload(params, ema=None, prefix: str = "") -> dict:
    """A synthetic checkpoint in the authors' layout, with the non-weight entries they save."""
    payload = {
        "params": {prefix + k: v for k, v in params.items()},
        "opt_state": {"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": [{"lr": 1e-3}]},
        "lr_scheduler": {"last_epoch": 7, "_step_count": 8},
        "step": 1000,
        "epoch": 2,
        "dropout_rng": torch.tensor([1, 2], dtype=torch.int64),
        "grad_accum_buffers": None,
    }
    if ema is not None:
        payload["ema_params1"] = ema
    return payload


def _save_reference(path: Path, model, ema_model=None, prefix: str = "") -> None:
    params = elflow_to_official(model.state_dict())
    ema = None
    if ema_model is not None:
        ema = elflow_to_official(dict(ema_model.named_parameters()))
        ema = {k: v.detach().clone() for k, v in ema.items()}
    torch.save(_reference_payload(params, ema, prefix), path)


def _outputs(model):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 10, 16, generator=g)
    with torch.no_grad():
        out, hidden = model(x, torch.tensor([0.3, 0.9]), 2.0, torch.tensor([0.0, 1.0]))
        return out, model.decode_logits(hidden)


def test_key_map_round_trip_and_layout():
    model = _perturbed_model()
    official = elflow_to_official(model.state_dict())
    assert official["proj_kernel"].shape == (CFG.hidden_size, CFG.encoder_dim)  # (in, out)
    assert official["unembed_kernel"].shape == (CFG.encoder_dim, CFG.vocab_size)
    assert "t_embedder.mlp_0.weight" in official and "self_cond_cfg_embedder.mlp_2.bias" in official
    back = official_to_elflow(official)
    assert back.keys() == model.state_dict().keys()
    for k, v in model.state_dict().items():
        torch.testing.assert_close(back[k], v, rtol=0, atol=0)


def test_strip_prefixes():
    state = {"module._orig_mod.a.b": 1, "_orig_mod.module.c": 2, "d": 3}
    assert strip_prefixes(state) == {"a.b": 1, "c": 2, "d": 3}


def test_infer_model_config_from_shapes():
    model = _perturbed_model()
    cfg = infer_model_config(elflow_to_official(model.state_dict()), max_length=16)
    assert cfg == CFG


@pytest.mark.parametrize("prefix", ["", "module.", "_orig_mod."])
def test_import_official_file_prefers_ema(tmp_path, prefix):
    raw, ema = _perturbed_model(0), _perturbed_model(1)
    path = tmp_path / "checkpoint_1000"
    _save_reference(path, raw, ema, prefix=prefix)
    model, config = load_model(path, task="owt")
    assert config.model.max_length == 1024  # the paper's OWT length (no config in the file)
    for a, b in zip(_outputs(model), _outputs(ema), strict=True):
        torch.testing.assert_close(a, b)
    model_raw, _ = load_model(path, task="owt", use_ema=False)
    torch.testing.assert_close(_outputs(model_raw)[0], _outputs(raw)[0])


def test_params_used_when_no_ema(tmp_path, capsys, monkeypatch):
    raw = _perturbed_model(0)
    _save_reference(tmp_path / "checkpoint_5", raw)
    weights = read_official_checkpoint(tmp_path / "checkpoint_5")
    torch.testing.assert_close(weights["proj_bias"], raw.decoder.proj.bias)
    assert "holds no EMA weights" in capsys.readouterr().err  # said, not silent
    monkeypatch.setattr(errors, "_NOTED", set())
    monkeypatch.setenv("RANK", "1")
    read_official_checkpoint(tmp_path / "checkpoint_5")
    assert capsys.readouterr().err == ""  # said once under torchrun, by rank 0
    monkeypatch.delenv("RANK")
    read_official_checkpoint(tmp_path / "checkpoint_5", use_ema=False)
    assert capsys.readouterr().err == ""  # asked for the raw weights: nothing to say


def test_folder_takes_latest_step_numerically(tmp_path):
    old, new = _perturbed_model(0), _perturbed_model(1)
    _save_reference(tmp_path / "checkpoint_900", old)
    _save_reference(tmp_path / "checkpoint_1000", new)
    (tmp_path / "checkpoint_notes.txt").write_text("ignored")
    resolved = resolve_source(tmp_path)
    assert resolved.kind == "official" and resolved.path.name == "checkpoint_1000"
    model, _ = load_model(tmp_path)
    torch.testing.assert_close(_outputs(model)[0], _outputs(new)[0])


def test_hub_id_goes_through_snapshot_download(tmp_path, monkeypatch):
    raw = _perturbed_model(0)
    repo = tmp_path / "snapshot"
    (repo / "sub").mkdir(parents=True)
    _save_reference(repo / "sub" / "checkpoint_10", raw)
    calls = []

    def fake_snapshot_download(repo_id, allow_patterns=None, **kwargs):
        calls.append((repo_id, allow_patterns))
        return str(repo)

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    model, config = load_model("embedded-language-flows/ELF-B-de-en-torch/sub")
    assert calls == [("embedded-language-flows/ELF-B-de-en-torch", ["sub", "sub/*"])]
    assert config.task == "conditional" and config.max_input_length == 64
    assert config.sampler.sampler == "ode" and config.sampler.cfg == 2.0
    torch.testing.assert_close(_outputs(model)[0], _outputs(raw)[0])


def test_hub_failure_is_one_line_error(monkeypatch):
    import huggingface_hub

    def offline(*args, **kwargs):
        raise OSError("offline")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(ELFError, match="Hugging Face Hub") as e:
        load_model("someone/missing-model")
    assert "\n" not in str(e.value)


def test_missing_and_unexpected_keys_are_listed(tmp_path):
    params = elflow_to_official(_perturbed_model().state_dict())
    params.pop("blocks.1.attn.proj.bias")
    params["extra.weight"] = torch.zeros(2)
    torch.save(_reference_payload(params), tmp_path / "checkpoint_1")
    with pytest.raises(ELFError) as e:
        load_model(tmp_path / "checkpoint_1")
    msg = str(e.value)
    assert "blocks.1.attn.proj.bias" in msg and "extra.weight" in msg and "\n" not in msg


def test_wrong_shape_is_named(tmp_path):
    params = elflow_to_official(_perturbed_model().state_dict())
    params["blocks.0.norm2.weight"] = torch.ones(CFG.hidden_size + 1)
    torch.save(_reference_payload(params), tmp_path / "checkpoint_1")
    with pytest.raises(ELFError, match=r"blocks\.0\.norm2\.weight"):
        load_model(tmp_path / "checkpoint_1")


def test_unsafe_pickle_is_refused(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("unpickled!",))

    torch.save({"params": {}, "evil": Evil()}, tmp_path / "checkpoint_1")
    with pytest.raises(ELFError, match="weights-only"):
        read_official_checkpoint(tmp_path / "checkpoint_1")


def test_not_a_model_errors(tmp_path):
    with pytest.raises(ELFError, match="does not exist"):
        load_model(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ELFError, match="holds no elflow model"):
        load_model(tmp_path / "empty")
    (tmp_path / "empty" / "round-1-4x8").mkdir()  # an elflow distill --out
    with pytest.raises(ELFError, match=r"a distillation folder: pass one of its rounds, e\.g\. ro"):
        load_model(tmp_path / "empty")


def test_artifact_save_load_round_trip(tmp_path):
    model = _perturbed_model()
    config = ArtifactConfig(model=CFG, latent_std=0.35, encoder="enc", tokenizer="tok")
    save_model(tmp_path / "m", model, config)
    assert not list((tmp_path / "m").glob(".*tmp*"))
    loaded, loaded_cfg = load_model(tmp_path / "m")
    assert loaded_cfg == config
    for a, b in zip(_outputs(loaded), _outputs(model), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    data = json.loads((tmp_path / "m" / "config.json").read_text())
    assert data["format"] == "elflow-model" and data["model"]["hidden_size"] == CFG.hidden_size
    assert "encoder_layer" not in data and "packed" not in data  # the defaults stay out:
    # earlier elflow loads the file (0.1's sampler section had exactly these keys)
    assert set(data["sampler"]) == {
        "steps",
        "sampler",
        "gamma",
        "w",
        "cfg",
        "time_grid",
        "time_mean",
        "time_std",
        "project_from",
    }
    assert "length_histogram" not in data and "tokens_per_word" not in data
    scheduled = ArtifactConfig(
        model=CFG, sampler=SamplerConfig(gamma_schedule="cosine", length=4), length_histogram=(0, 2)
    )
    save_model(tmp_path / "s", model, scheduled)
    assert load_model(tmp_path / "s")[1] == scheduled  # non-defaults are written and read back
    layered = ArtifactConfig(model=CFG, encoder="enc", encoder_layer=4, packed=True)
    save_model(tmp_path / "l", model, layered)
    assert load_model(tmp_path / "l")[1] == layered
    assert json.loads((tmp_path / "l" / "config.json").read_text())["packed"] is True
    # A training checkpoint saved before configs recorded it: its run config says.
    data = ArtifactConfig(model=CFG, encoder="enc").to_json()
    data["run"] = {"data": {"packing": True}}
    assert ArtifactConfig.from_json(data).packed


def test_artifact_prefers_ema_and_run_folder_latest(tmp_path):
    raw, ema = _perturbed_model(0), _perturbed_model(1)
    config = ArtifactConfig(model=CFG)
    save_model(tmp_path / "run" / "checkpoint-900", raw, config)
    save_model(tmp_path / "run" / "checkpoint-1000", raw, config, ema_state=ema.state_dict())
    resolved = resolve_source(tmp_path / "run")
    assert resolved.path.name == "checkpoint-1000"
    loaded, _ = load_model(tmp_path / "run")
    torch.testing.assert_close(_outputs(loaded)[0], _outputs(ema)[0])
    loaded_raw, _ = load_model(tmp_path / "run", use_ema=False)
    torch.testing.assert_close(_outputs(loaded_raw)[0], _outputs(raw)[0])


def test_config_unknown_key_is_an_error(tmp_path):
    save_model(tmp_path / "m", _perturbed_model(), ArtifactConfig(model=CFG))
    path = tmp_path / "m" / "config.json"
    data = json.loads(path.read_text())
    data["model"]["hiden_size"] = 3
    path.write_text(json.dumps(data))
    with pytest.raises(ELFError, match=r"model\.hiden_size"):
        load_model(tmp_path / "m")


def test_export_imported_checkpoint(tmp_path):
    raw, ema = _perturbed_model(0), _perturbed_model(1)
    _save_reference(tmp_path / "checkpoint_7", raw, ema)
    out = import_official(tmp_path / "checkpoint_7", tmp_path / "exported", task="xsum")
    model, config = load_model(out)
    assert config.task == "conditional" and config.model.max_length == 1088
    assert config.max_input_length == 1024 and config.pad_with_eos
    torch.testing.assert_close(_outputs(model)[0], _outputs(ema)[0], rtol=0, atol=0)
    with pytest.raises(ELFError, match="already an elflow model"):
        import_official(out, tmp_path / "again")


def test_official_presets_match_paper():
    assert sources.official_task_from_name("embedded-language-flows/ELF-B-owt-torch") == "owt"
    assert sources.official_task_from_name("embedded-language-flows/ELF-B-xsum-torch") == "xsum"
    assert sources.official_task_from_name("x/ELF-B-de-en-torch") == "de-en"
    official = elflow_to_official(_perturbed_model().state_dict())
    cfg = artifact.official_artifact_config(official, "owt")
    assert (cfg.sampler.steps, cfg.sampler.sampler, cfg.sampler.gamma, cfg.sampler.w) == (
        32,
        "sde",
        1.5,
        3.0,
    )
    assert cfg.latent_std == 0.2 and cfg.encoder == T5_SMALL


def test_official_task_comes_from_the_last_parts_and_is_said(tmp_path, capsys, monkeypatch):
    assert sources.official_task_from_name("wmt-runs/ELF-B-owt/checkpoint_5") == "owt"
    assert sources.official_task_from_name("/data/xsum-exp/owt-model/checkpoint_5") == "owt"
    # When the last two parts name none, the whole name does (the Hugging Face cache layout).
    assert sources.official_task_from_name("/data/xsum-exp/run1/checkpoint_5") == "xsum"
    cache = "/hf/models--org--ELF-B-de-en-torch/snapshots/3f2a9c/checkpoint_5"
    assert sources.official_task_from_name(cache) == "de-en"
    assert sources.official_task_from_name("runs/elf-b-de-en-lowtemp/checkpoint_5") == "de-en"
    assert sources.official_task_from_name("runs/openwebtext/checkpoint_5") == "owt"
    assert sources.official_task_from_name("runs/mine/checkpoint_5") is None
    assert sources.official_task_from_name("/home/me/code-env/elf/checkpoint_5") is None
    assert sources.official_task_from_name("/data/wmt14-runs/a/checkpoint_5") == "de-en"
    monkeypatch.setattr(errors, "_NOTED", set())
    _save_reference(tmp_path / "checkpoint_5", _perturbed_model(0), _perturbed_model(1))
    assert load_model(tmp_path / "checkpoint_5")[1].task == "unconditional"
    assert "names no paper task; taken as 'owt'" in capsys.readouterr().err
    assert load_model(tmp_path / "checkpoint_5", task="de-en")[1].max_input_length == 64
    assert capsys.readouterr().err == ""
    deep = tmp_path / "xsum-exp" / "run1"
    deep.mkdir(parents=True)
    _save_reference(deep / "checkpoint_5", _perturbed_model(0), _perturbed_model(1))
    assert load_model(deep / "checkpoint_5")[1].model.max_length == 1088
    assert "taken as the paper's 'xsum' task from a folder above it" in capsys.readouterr().err
    save_model(tmp_path / "m", _perturbed_model(), ArtifactConfig(model=CFG))
    with pytest.raises(ELFError, match="applies to authors' checkpoints"):
        load_model(tmp_path / "m", task="xsum")


def test_save_model_checks_first_and_leaves_no_stale_ema(tmp_path):
    a, b = _perturbed_model(0), _perturbed_model(1)
    config = ArtifactConfig(model=CFG)
    folder = save_model(tmp_path / "m", a, config, ema_state=_perturbed_model(2).state_dict())
    save_model(folder, b, config, overwrite=True)  # no EMA: the earlier one must not win on load
    assert not (folder / "ema.safetensors").exists()
    torch.testing.assert_close(_outputs(load_model(folder)[0])[0], _outputs(b)[0])
    before = (folder / "model.safetensors").read_bytes()
    with pytest.raises(ELFError, match=r"e\.g\. EMA\.shadow"):
        save_model(folder, a, config, ema_state={"shadow": {}, "decay": 0.9}, overwrite=True)
    other = build_model(elf_tiny(encoder_dim=8, vocab_size=21, max_length=16)).state_dict()
    with pytest.raises(ELFError, match="another model's EMA"):
        save_model(folder, a, config, ema_state=other, overwrite=True)
    assert (folder / "model.safetensors").read_bytes() == before  # nothing written
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "state.json").write_text("{}")
    with pytest.raises(ELFError, match="is a training checkpoint or run folder"):
        save_model(tmp_path / "ckpt", a, config)
    (tmp_path / "run" / "checkpoint-5").mkdir(parents=True)  # it would shadow the checkpoints
    with pytest.raises(ELFError, match="is a training checkpoint or run folder"):
        save_model(tmp_path / "run", a, config)


@pytest.mark.parametrize("held", ["config.json", "model.safetensors", "README.md", "tokenizer"])
def test_save_model_refuses_a_folder_holding_a_model_unless_overwrite(tmp_path, held):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")  # other files are no model's: kept, not refused
    if held == "tokenizer":
        (folder / held).mkdir()
        (folder / held / "tokenizer.json").write_text("{}")
    else:
        (folder / held).write_text("an earlier model's")
    with pytest.raises(ELFError) as e:
        save_model(folder, _perturbed_model(), ArtifactConfig(model=CFG))
    assert str(e.value) == (
        f"{folder} already holds {held}; save to a new folder, or pass overwrite=True to replace "
        "that model"
    )
    assert sorted(p.name for p in folder.iterdir()) == sorted([held, "notes.txt"])  # untouched
    # overwrite replaces the model: nothing of the earlier one is left to be read with it
    save_model(folder, _perturbed_model(), ArtifactConfig(model=CFG), overwrite=True)
    left = {"config.json", "model.safetensors", "notes.txt"}
    assert {p.name for p in folder.iterdir()} == left
    assert (folder / "notes.txt").read_text() == "mine"
    load_model(folder)


def test_save_model_into_a_new_or_empty_folder_and_not_into_a_file(tmp_path):
    (tmp_path / "empty").mkdir()
    save_model(tmp_path / "empty", _perturbed_model(), ArtifactConfig(model=CFG))
    save_model(tmp_path / "new" / "deep", _perturbed_model(), ArtifactConfig(model=CFG))
    (tmp_path / "f").write_text("x")
    with pytest.raises(ELFError, match="is a file; save the model to a folder"):
        save_model(tmp_path / "f", _perturbed_model(), ArtifactConfig(model=CFG))


def test_pipeline_save_pretrained_keeps_an_earlier_model_unless_overwrite(uncond_model, tmp_path):
    from elflow import ELFPipeline

    pipe = ELFPipeline.from_pretrained(uncond_model)
    folder = pipe.save_pretrained(tmp_path / "saved")
    card = (folder / "README.md").read_text()
    (folder / "README.md").write_text(card + "my notes\n")
    with pytest.raises(ELFError, match=r"already holds config\.json, model\.safetensors, tokeni"):
        pipe.save_pretrained(folder)
    assert (folder / "README.md").read_text().endswith("my notes\n")  # kept
    with pytest.raises(ELFError, match="already holds"):
        pipe.model.save_pretrained(folder, pipe.config)  # ELF.save_pretrained: the same rule
    assert pipe.save_pretrained(folder, overwrite=True) == folder
    assert (folder / "README.md").read_text() == card
    assert ELFPipeline.from_pretrained(folder)(2, seed=1).texts == pipe(2, seed=1).texts


def test_legacy_unconditional_config_with_max_input_length_loads(tmp_path):
    folder = save_model(tmp_path / "m", _perturbed_model(), ArtifactConfig(model=CFG))
    data = json.loads((folder / "config.json").read_text())
    data["max_input_length"] = 16  # written by earlier versions from an ignored setting
    (folder / "config.json").write_text(json.dumps(data))
    assert load_model(folder)[1].max_input_length == 0


def test_save_model_unwraps_compiled_and_ddp_models(tmp_path):
    model = _perturbed_model()

    class Wrapper(torch.nn.Module):  # what torch.compile (_orig_mod) and DDP (module) hold
        def __init__(self, inner, attr):
            super().__init__()
            setattr(self, attr, inner)

    for attr in ("_orig_mod", "module"):
        folder = save_model(tmp_path / attr, Wrapper(model, attr), ArtifactConfig(model=CFG))
        torch.testing.assert_close(_outputs(load_model(folder)[0])[0], _outputs(model)[0])
    with pytest.raises(ELFError, match="expected an elflow ELF network"):
        save_model(tmp_path / "x", torch.nn.Linear(2, 2), ArtifactConfig(model=CFG))


def test_bad_configs_and_paths_are_one_line(tmp_path):
    folder = save_model(tmp_path / "m", _perturbed_model(), ArtifactConfig(model=CFG))
    with pytest.raises(ELFError, match="pass its folder"):
        load_model(folder / "model.safetensors")
    for text in ("[1, 2]", '"hello"', "null"):
        (folder / "config.json").write_text(text)
        with pytest.raises(ELFError, match="not an elflow model config"):
            load_model(folder)
    (folder / "config.json").write_text('{"format": "elflow-model"}')
    with pytest.raises(ELFError, match="no 'format_version'"):
        load_model(folder)
    for field, value, message in (
        ("t_eps", 0.0, "t_eps must be in"),
        ("noise_scale", -2.0, "noise_scale must be positive"),
        ("encoder_layer", -3, "encoder_layer must be >= 0"),
        ("latent_mean", float("nan"), "latent_mean must be a finite"),
        ("max_input_length", 5, "applies to conditional models"),
    ):
        with pytest.raises(ELFError, match=message):
            ArtifactConfig(model=CFG, **{field: value})


def test_integer_weights_are_not_a_model(tmp_path):
    params = elflow_to_official(_perturbed_model().state_dict())
    params["proj_bias"] = params["proj_bias"].long()
    torch.save(_reference_payload(params), tmp_path / "checkpoint_1")
    with pytest.raises(ELFError, match="integer tensors"):
        read_official_checkpoint(tmp_path / "checkpoint_1")


def test_infer_model_config_at_widths_that_round_down():
    cfg = elf_tiny(encoder_dim=8, vocab_size=20, max_length=16)
    # 405 / 304 * 304 is just below 405 in floating point: the ratio must still give 405.
    assert int(405 / 304 * 304) == 404
    cfg = dataclasses.replace(cfg, hidden_size=304, num_heads=4, mlp_ratio=405.5 / 304)
    assert cfg.mlp_hidden == 270
    model = build_model(cfg)
    inferred = infer_model_config(elflow_to_official(model.state_dict()), max_length=16)
    assert inferred.mlp_hidden == cfg.mlp_hidden


def test_fine_tune_from_an_authors_checkpoint_needs_no_task(tmp_path, capsys, monkeypatch):
    """train.init takes only the weights and dims of an authors' checkpoint (the lengths, task
    and padding are the run's): no task is guessed, and no note asks for one."""
    from elflow.config.run_presets import preset
    from elflow.config.train_config import apply_overrides
    from elflow.train.resume import apply_init

    monkeypatch.setattr(errors, "_NOTED", set())
    raw, ema = _perturbed_model(0), _perturbed_model(1)
    _save_reference(tmp_path / "checkpoint_7", raw, ema)
    for task in ("unconditional", "conditional"):
        sets = [f"train.init={tmp_path / 'checkpoint_7'}", f"task={task}"]
        if task == "conditional":
            sets.append("max_input_length=16")
        cfg, state, _ = apply_init(apply_overrides(preset("bible-tiny"), sets=sets))
        assert cfg.task == task and cfg.model.max_length == preset("bible-tiny").model.max_length
        assert cfg.model.hidden_size == CFG.hidden_size
        torch.testing.assert_close(state["decoder.proj.bias"], ema.decoder.proj.bias)
    err = capsys.readouterr().err
    assert "taken as the paper's" not in err and "--task" not in err
    # The one note: bible-tiny's projected sampling is off for the conditional run.
    assert err.count("elflow: note:") == 1 and "projection" in err


def test_weights_files_follow_the_umask(tmp_path):
    """safetensors writes 0600 files; a model folder on a shared disk must be readable like its
    config.json (the user's umask decides)."""
    import os
    import stat

    old = os.umask(0o027)
    try:
        raw, ema = _perturbed_model(0), _perturbed_model(1)
        save_model(tmp_path / "m", raw, ArtifactConfig(model=CFG), ema_state=ema.state_dict())
    finally:
        os.umask(old)
    for name in ("model.safetensors", "ema.safetensors", "config.json"):
        assert stat.S_IMODE((tmp_path / "m" / name).stat().st_mode) == 0o640, name


def test_a_file_that_is_no_torch_file_says_so(tmp_path):
    script = tmp_path / "checkpoint_1"
    script.write_text("#!/bin/sh\necho hi\n")
    with pytest.raises(ELFError, match=r"not a torch file \(it starts with b'#!/b'") as e:
        read_official_checkpoint(script)
    assert "pickle" not in str(e.value).split("it starts with")[0]


def test_weights_of_another_model_are_one_short_line():
    from elflow.io.official import load_state_dict_strict

    model = build_model(CFG)
    wider = build_model(dataclasses.replace(CFG, hidden_size=2 * CFG.hidden_size)).state_dict()
    with pytest.raises(ELFError, match=r"shapes do not match the network \(\d+ tensors\)") as e:
        load_state_dict_strict(model, wider)
    assert len(str(e.value)) < 500 and "more; the weights are of another model" in str(e.value)
    deeper = build_model(dataclasses.replace(CFG, depth=CFG.depth + 2)).state_dict()
    with pytest.raises(ELFError, match=r"no missing keys, \d+ unexpected keys \[blocks\.") as e:
        load_state_dict_strict(model, deeper)
    assert len(str(e.value)) < 500 and ", ... " in str(e.value)
