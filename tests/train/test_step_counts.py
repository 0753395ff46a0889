"""The training step at GPU efficiency, proved by counts on a CPU: keyed batched draws, no host
syncs outside logging steps, FLOPs as the formulas say, Muon's work shared, the log lines'
throughput figures."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from elflow.config import ObjectiveConfig, elf_b, elf_tiny
from elflow.model import build_model
from elflow.objective import Batch, elf_loss
from elflow.runtime.profiling import OpCounter, optimizer_host_tensors
from elflow.train.flops import (
    encoder_flops_per_token,
    executed_row_flops,
    expected_padding,
    model_row_flops,
    pass_flops,
    reference_step_flops,
    train_row_flops,
)
from elflow.train.forward import TrainForward
from elflow.train.muon import assign_owners, newton_schulz_flops
from elflow.train.objective_draws import RowPlan, sample_draws, sample_draws_keyed
from tests.train_helpers import run_config, train_cli

E, V, L = 8, 20, 10
DRAW_FIELDS = ("t", "noise", "decoder_active", "decoder_lambda", "use_self_cond", "w")


# --- keyed draws -----------------------------------------------------------------------------


def test_keyed_draws_depend_only_on_the_position():
    cfg = ObjectiveConfig()
    a = sample_draws_keyed([3, 7, 11], L, E, cfg, seed=5)
    b = sample_draws_keyed([11, 42], L, E, cfg, seed=5)
    for f in DRAW_FIELDS:
        assert torch.equal(getattr(a, f)[2], getattr(b, f)[0]), f
    assert not torch.equal(a.noise[0], a.noise[1])
    assert not torch.equal(sample_draws_keyed([3], L, E, cfg, seed=6).noise[0], a.noise[0])
    # A row uses its path noise or its decoder noise, never both: one tensor serves as both.
    assert a.decoder_noise is a.noise
    # The host's plan is the tensors' own.
    plan = RowPlan.of(a)
    assert np.array_equal(plan.decoder, a.plan.decoder)
    assert np.array_equal(plan.self_cond, a.plan.self_cond)


def test_keyed_draws_have_the_objectives_distributions():
    cfg = ObjectiveConfig()
    n = 20_000
    d = sample_draws_keyed(np.arange(n), 4, 6, cfg, seed=0)
    g = sample_draws(n, 4, 6, cfg, torch.Generator().manual_seed(0))  # the generator's draws
    assert d.decoder_active.mean().item() == pytest.approx(cfg.decoder_prob, abs=0.01)
    assert d.use_self_cond.mean().item() == pytest.approx(cfg.self_cond_prob, abs=0.01)
    for f in ("t", "w", "decoder_lambda"):
        keyed, reference = getattr(d, f), getattr(g, f)
        error = 4 * math.sqrt(2 / keyed.numel()) * reference.std().item()  # 4 standard errors
        assert keyed.mean().item() == pytest.approx(reference.mean().item(), abs=error), f
        assert keyed.std().item() == pytest.approx(reference.std().item(), rel=0.03), f
    assert cfg.w_min <= d.w.min().item() and d.w.max().item() <= cfg.w_max
    assert 0 < d.t.min().item() and d.t.max().item() < 1
    noise = d.noise.flatten()
    assert noise.mean().item() == pytest.approx(0.0, abs=0.01)
    assert noise.std().item() == pytest.approx(1.0, abs=0.01)
    assert ((noise**4).mean().item()) == pytest.approx(3.0, abs=0.1)  # normal, not uniform


def test_keyed_draws_take_a_fixed_number_of_ops_whatever_the_batch():
    cfg = ObjectiveConfig()

    def ops(batch: int) -> int:
        with OpCounter() as c:
            sample_draws_keyed(np.arange(batch), L, E, cfg, seed=0)
        assert c.counts.num_syncs == 0
        return c.counts.num_ops

    # Host and device ops together; per-example generators took ~21 ops an example (1,351 at 64).
    assert ops(4) == ops(64) < 80


# --- a real training step: no host syncs outside logging, counted -----------------------------


def test_a_training_step_reads_the_device_only_when_it_logs(tmp_path, assets):
    from elflow.train.loop import Trainer
    from elflow.train.setup import prepare_run
    from elflow.train.step import ELFObjective

    cfg = run_config(assets, train={"log_every": 3, "max_steps": 6, "save_every": 100})
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    from elflow.config.run_presets import preset
    from elflow.config.train_config import apply_overrides

    run_cfg = apply_overrides(preset("bible-tiny"), tmp_path / "cfg.json")
    run = prepare_run(run_cfg, tmp_path / "run", "never")
    trainer = Trainer(run, ELFObjective(run.cfg))
    try:
        trainer.step(0)  # makes the optimizers' state, their host step counters among it
        host = [trainer.stop.flag, *optimizer_host_tensors(run.optimizer)]
        counts = [None]
        for step in range(1, 5):
            with OpCounter(host=host) as c:
                trainer.step(step)
            counts.append(c.counts)
    finally:
        trainer.close()
    # Steps 2 and 3 are steady; step 3's window (done = 3) logs, so it reads the device.
    assert counts[1].num_syncs == 0 and counts[3].num_syncs == 0, counts[3].syncs
    assert counts[2].num_syncs >= 1 and all(r.startswith("host read") for r in counts[2].syncs)
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [3]
    assert math.isfinite(lines[0]["loss"]) and lines[0]["tokens_per_s"] > 0


def test_the_log_lines_give_tokens_per_second_mfu_and_memory(tmp_path, assets):
    cfg = run_config(assets, train={"log_every": 2, "max_steps": 4, "peak_tflops": 0.5})
    assert train_cli(tmp_path, tmp_path / "run", cfg) == 0
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [2, 4]
    for x in lines:
        assert x["tokens_per_s"] > 0 and x["step_s"] > 0 and x["peak_memory_gb"] > 0
        assert 0 < x["mfu"] < 1  # a CPU against a 0.5 TFLOP/s peak
        # The efficient step runs more than the model's work (flash attention's recomputation).
        assert x["mfu"] < x["hfu"] and x["model_tflops"] < x["executed_tflops"]
        assert x["hfu"] / x["mfu"] == pytest.approx(x["executed_tflops"] / x["model_tflops"])


def test_throughput_counts_valid_tokens_over_training_time(monkeypatch):
    from elflow.train import throughput

    clock = iter([100.0, 110.0])
    monkeypatch.setattr(throughput.time, "perf_counter", lambda: next(clock))
    meter = throughput.ThroughputMeter.__new__(throughput.ThroughputMeter)
    meter.flops_per_step, meter.peak, meter.device = 1e12, 4e12, torch.device("cpu")
    meter.executed_per_step = 1.5e12
    meter.start, meter.paused = next(clock), 0.0
    meter.pause(6.0)  # a checkpoint took 6 of the 10 seconds
    figures = meter.figures(steps=2, tokens=800)
    assert figures["tokens_per_s"] == pytest.approx(200.0)
    assert figures["step_s"] == pytest.approx(2.0)
    assert figures["mfu"] == pytest.approx(2e12 / 4 / 4e12)
    assert figures["hfu"] == pytest.approx(3e12 / 4 / 4e12)
    assert figures["model_tflops"] == pytest.approx(0.5)
    assert figures["executed_tflops"] == pytest.approx(0.75)


def test_host_batches_know_the_loss_and_text_tokens(tmp_path, assets):
    from elflow.config.run_presets import preset
    from elflow.config.train_config import apply_overrides
    from elflow.data.rows import build_dataset
    from elflow.text.tokenizer import load_tokenizer
    from elflow.text.tokens import token_spec
    from elflow.train.batches import host_batch
    from elflow.train.step import loss_mask

    (tmp_path / "cfg.json").write_text(json.dumps(run_config(assets)))
    for eos in (False, True):
        cfg = apply_overrides(
            preset("bible-tiny"),
            tmp_path / "cfg.json",
            [f"objective.pad_with_eos={str(eos).lower()}"],
        )
        tok = load_tokenizer(cfg.encoder.tokenizer_name)
        data = build_dataset(cfg.data, tok, 12, 0, token_spec(tok).pad_id, "train")
        host = host_batch(cfg, data, None, np.arange(8), np.arange(8))
        batch = Batch(torch.zeros(8, 12, 4), host.input_ids, host.attention_mask, host.cond_mask)
        assert host.loss_tokens == loss_mask(batch, eos).sum().item()
        assert host.text_tokens == host.attention_mask.sum().item() < 8 * 12


# --- FLOPs: the formulas against the counter ---------------------------------------------------


@pytest.mark.parametrize("procedure", ["efficient", "reference"])
def test_the_flops_formula_is_the_counted_step(procedure):
    torch.manual_seed(0)
    B = 16
    cfg = elf_tiny(encoder_dim=E, vocab_size=V, max_length=12)
    model = build_model(cfg)
    batch = Batch(torch.randn(B, L, E), torch.randint(0, V, (B, L)), torch.ones(B, L))
    draws = sample_draws_keyed(range(100, 100 + B), L, E, ObjectiveConfig(), seed=0)
    with OpCounter() as c:
        elf_loss(TrainForward(model), batch, draws, ObjectiveConfig(), procedure).loss.backward()
    dec, sc = len(draws.plan.decoder) / B, len(draws.plan.self_cond) / B
    assert 0 < dec < 1 and 0 < sc < 1
    # torch counts flash attention's backward with its recomputed product (2.5x the forward).
    expected = B * train_row_flops(cfg, L, dec, sc, procedure=procedure, attention_backward=2.5)
    assert sum(c.counts.flops.values()) == pytest.approx(expected, rel=1e-12)


def _draws(B):
    return sample_draws_keyed(range(100, 100 + B), L, E, ObjectiveConfig(), seed=0)


def _counted_step(cfg, draws, procedure="efficient", plan=None, checkpointing=False):
    """Counted FLOPs of one step of ``procedure``, with ``plan`` (a padded one, as
    ``train.compile=step`` makes) instead of the draws' own."""
    from elflow.objective import branch_loss
    from elflow.train.objective_draws import BranchRows

    torch.manual_seed(0)
    B = draws.t.shape[0]
    model = build_model(cfg)
    model.train()
    model.activation_checkpointing = checkpointing
    batch = Batch(torch.randn(B, L, E), torch.randint(0, V, (B, L)), torch.ones(B, L))
    forward = TrainForward(model)
    with OpCounter() as c:
        if plan is None:
            out = elf_loss(forward, batch, draws, ObjectiveConfig(), procedure)
        else:
            rows = BranchRows.of(plan, batch.x.device)
            out = branch_loss(forward, batch, draws, rows, ObjectiveConfig(), False)
        out.loss.backward()
    return sum(c.counts.flops.values())


def test_model_flops_are_the_efficient_steps_work_and_executed_flops_add_what_runs_besides():
    cfg = elf_tiny(encoder_dim=E, vocab_size=V, max_length=12)
    obj = ObjectiveConfig()
    dec, sc = obj.decoder_prob, obj.self_cond_prob * (1 - obj.decoder_prob)
    p = pass_flops(cfg, L)
    model = model_row_flops(cfg, obj, L, encoder_per_token=7.0)
    # Model FLOPs: trained pass (attention backward 2x), head on decoder rows, one no-grad pass on
    # the self-conditioned rows, the encoder: whatever the procedure or the settings.
    assert model == train_row_flops(cfg, L, dec, sc, 7.0, "efficient", True, 2.0)
    assert model == model_row_flops(elf_tiny(**{**vars(cfg), "dropout": 0.1}), obj, L, 7.0)
    plain = executed_row_flops(cfg, obj, L, 7.0, attention_backward=2.0)
    assert plain == pytest.approx(model, rel=1e-12)
    # Flash attention's recomputed product, then each extra on top of it.
    flash = executed_row_flops(cfg, obj, L, 7.0)
    assert flash - model == pytest.approx(0.5 * p.attention)
    ckpt = executed_row_flops(cfg, obj, L, 7.0, checkpointing=True)
    assert 0.5 * p.blocks < ckpt - flash < p.blocks  # the blocks' forward, less a product each
    dropout = executed_row_flops(elf_tiny(**{**vars(cfg), "dropout": 0.1}), obj, L, 7.0)
    assert dropout - flash == pytest.approx(sc * p.body)  # the second no-grad pass
    reference = executed_row_flops(cfg, obj, L, 7.0, procedure="reference")
    assert reference - flash == pytest.approx(
        3 * (1 - dec) * p.head + 2 * (p.body + p.head) - sc * p.body
    )
    padded = executed_row_flops(cfg, obj, L, 7.0, micro_batch=4, min_branch_rows=2)
    extra = 3 * expected_padding(4, dec, 2) * p.head + expected_padding(4, sc, 2) * p.body
    assert padded - flash == pytest.approx(extra / 4) and extra > 0
    # The authors' step: elflow's reference procedure without the heads of the no-grad passes.
    assert reference_step_flops(cfg, L, 7.0) == pytest.approx(reference - 2 * p.head)


def test_expected_padding_is_the_binomial_expectation():
    # 3 rows at p 1/2: 0 rows (1/8) need 2, 1 row (3/8) needs 1.
    assert expected_padding(3, 0.5, 2) == pytest.approx(2 / 8 + 3 / 8)
    assert expected_padding(1, 0.3, 2) == pytest.approx(2 * 0.7 + 0.3)
    assert 0 < expected_padding(64, 0.2, 2) < 1e-4 and expected_padding(8, 0.2, 0) == 0.0


def test_executed_flops_count_the_compiled_steps_padding_and_the_recomputed_blocks():
    from elflow.train.objective_draws import RowPlan

    B = 6
    cfg = elf_tiny(encoder_dim=E, vocab_size=V, max_length=12)
    draws = _draws(B)
    # A plan with one decoder row and no self-conditioned row, padded as a compiled step pads it.
    plan = RowPlan(draws.plan.decoder[:1], draws.plan.self_cond[:0]).padded(B)
    keep = np.zeros(B, bool)
    keep[plan.decoder[:1]] = True
    draws.decoder_active = torch.tensor(keep, dtype=torch.float32)
    draws.use_self_cond = torch.zeros(B)
    counted = _counted_step(cfg, draws, plan=plan)
    # Two head rows and two no-grad rows run though one row and none count as model work.
    expected = B * train_row_flops(cfg, L, 2 / B, 2 / B, attention_backward=2.5)
    assert counted == pytest.approx(expected, rel=1e-12)
    # Activation checkpointing runs every row's blocks forward once more (their last product
    # excepted: torch stops recomputing once the saved tensors are back).
    plain, again = _counted_step(cfg, _draws(B)), _counted_step(cfg, _draws(B), checkpointing=True)
    obj = ObjectiveConfig()
    recomputed = executed_row_flops(cfg, obj, L, checkpointing=True) - executed_row_flops(
        cfg, obj, L
    )
    assert again - plain == pytest.approx(B * recomputed, rel=1e-12)


def test_the_encoder_flops_formula_is_close_to_the_counted_forward():
    from transformers import T5Config, T5EncoderModel

    config = T5Config(vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)
    model = T5EncoderModel(config).eval()
    ids = torch.randint(0, 100, (3, 16))
    with OpCounter() as c, torch.no_grad():
        model(input_ids=ids)
    per_token = sum(c.counts.flops.values()) / ids.numel()
    assert per_token == pytest.approx(encoder_flops_per_token(config, 16), rel=1e-9)


# --- Muon: each matrix on one process ---------------------------------------------------------


def _elf_b_shapes() -> tuple[tuple[int, ...], ...]:
    with torch.device("meta"):
        from elflow.model import ELF

        model = ELF(elf_b(encoder_dim=512, vocab_size=32100, max_length=1024))
    return tuple(tuple(p.shape) for p in model.parameters() if p.ndim == 2)


@pytest.mark.parametrize("world", [1, 2, 4, 8, 32])
def test_muon_owners_share_the_newton_schulz_work(world):
    shapes = _elf_b_shapes()
    owners = assign_owners(shapes, world)
    loads = [0.0] * world
    for shape, rank in zip(shapes, owners, strict=True):
        loads[rank] += newton_schulz_flops(shape, 5)
    total, largest = sum(loads), max(newton_schulz_flops(s, 5) for s in shapes)
    # Greedy (largest first) is within the largest matrix of a perfect 1/world split.
    assert max(loads) <= total / world + largest
    assert max(loads) <= max(1.1 * total / world, largest)
    assert set(owners) == set(range(world)) or len(shapes) < world


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.xdist_group("gloo-work")  # one worker launches gloo_work once
def test_two_processes_share_muon_and_match_one_process(gloo_work):
    from tests.dist import muon_work

    shared = gloo_work["muon_work"]  # (tests/dist/muon_work.py's, launched with fsdp_muon's)
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        alone, total = muon_work.run(dtype, distributed=False)
        # Each matrix's update comes from its owner's arithmetic alone: bitwise one process's.
        for key, value in alone.items():
            assert torch.equal(shared[name]["weights"][key], value), (name, key)
        per_rank = shared[name]["flops"]
        assert sum(per_rank) == total  # the work is split, not repeated
        shapes = tuple(tuple(w.shape) for w in alone.values())
        largest = muon_work.STEPS * max(newton_schulz_flops(s, 5) for s in shapes)
        assert max(per_rank) <= total / 2 + largest and min(per_rank) > 0


def _same_checkpoints(a, b, atol):
    from safetensors.torch import load_file

    for name in ("model.safetensors", "ema.safetensors"):
        x, y = load_file(str(a / name)), load_file(str(b / name))
        worst = max((x[k] - y[k]).abs().max().item() for k in x)
        assert worst <= atol, (name, worst)


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("parallel", ["ddp", "fsdp2"])
def test_two_processes_with_accumulation_equal_one(tmp_path, assets, parallel):
    from tests.train_helpers import train_processes

    train = {"max_steps": 3, "global_batch": 8, "save_every": 3}
    assert train_cli(tmp_path, tmp_path / "single", run_config(assets, train=train)) == 0
    # 2 ranks x micro-batch 1 x 4 accumulation steps: gradients reduced on the fourth only.
    # (Two processes, not four: the claim is the same, on half the processes for 2 cores.)
    two = {**train, "micro_batch": 1, "parallel": parallel}
    train_processes(tmp_path, tmp_path / "two", run_config(assets, train=two), 2)
    _same_checkpoints(tmp_path / "single" / "checkpoint-3", tmp_path / "two" / "checkpoint-3", 1e-5)


def test_fsdp2_computes_the_blocks_in_bf16_and_keeps_the_rest_fp32(monkeypatch):
    import torch.distributed as dist

    from elflow.runtime.distributed import DistInfo, parallelize
    from tests.dist.launch import free_port

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        model = build_model(elf_tiny(encoder_dim=E, vocab_size=V, max_length=12))
        forward = TrainForward(model)
        info = DistInfo(0, 1, 0, torch.device("cpu"))
        parallelize(forward, model.blocks, info, "fsdp2", bf16=True)
        seen = {}
        model.blocks[0].attn.qkv.register_forward_hook(
            lambda m, i, o: seen.update(block=m.weight.dtype, stream=i[0].dtype)
        )
        model.text_proj.proj2.register_forward_hook(
            lambda m, i, o: seen.update(projection=m.weight.dtype)
        )
        with torch.autocast("cpu", torch.bfloat16):
            x_pred, _ = forward(torch.randn(2, L, 2 * E), torch.rand(2), torch.rand(2), 0.0)
        x_pred.float().sum().backward()
        # Block weights gathered in bf16; the projections (outside the blocks) stay fp32.
        assert seen == {
            "block": torch.bfloat16,
            "stream": torch.float32,
            "projection": torch.float32,
        }
        grads = [p.grad for p in model.blocks[0].parameters()]
        assert all(g is not None and g.dtype == torch.float32 for g in grads)  # reduced in fp32
    finally:
        dist.destroy_process_group()


def test_non_finite_weights_are_never_checkpointed(tmp_path, assets, monkeypatch, capsys):
    from elflow.train import loop

    real = loop.Trainer.step

    def poisoned(trainer, step):
        real(trainer, step)
        if step == 5:  # finite loss and gradients, then an optimizer that breaks the weights
            with torch.no_grad():
                next(trainer.run.model.parameters()).view(-1)[0] = float("nan")

    monkeypatch.setattr(loop.Trainer, "step", poisoned)
    # Step 6 (index 5) saves but does not log: the weights check before the save finds it.
    cfg = run_config(assets, train={"log_every": 4, "max_steps": 8, "save_every": 3})
    assert train_cli(tmp_path, tmp_path / "run", cfg) == 2
    err = [x for x in capsys.readouterr().err.splitlines() if "elflow: error:" in x]
    assert len(err) == 1 and "the weights hold NaN or inf values" in err[0], err
    assert "checkpoint-3" in err[0]
    assert sorted(p.name for p in (tmp_path / "run").glob("checkpoint-*")) == ["checkpoint-3"]


def test_elementwise_traffic_splits_weights_from_activations():
    weight = torch.randn(64, 32)
    x = torch.randn(5, 64, 32)
    with OpCounter(weights=[weight]) as counter:
        y = x + 1.0  # activations only: 5*64*32 floats read and written
        z = y * weight.to(
            torch.bfloat16
        )  # a weight's copy (read fp32, write bf16), then a mixed op
    c = counter.counts
    act, w = x.numel() * 4, weight.numel()
    assert c.activation_traffic["add"] == 2 * act
    assert c.activation_traffic["_to_copy"] == 0
    assert c.activation_traffic["mul"] == 2 * act  # y read, z written; the weight's copy is not
    assert c.weight_traffic_bytes == 4 * w + 2 * w + 2 * w  # the cast's read and write, mul's read
    assert c.traffic_bytes == sum(c.activation_traffic.values()) + c.weight_traffic_bytes
    assert z.dtype == torch.float32


@pytest.mark.parametrize("autocast", [False, True])
def test_activation_traffic_per_token_does_not_depend_on_the_batch(autocast):
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Embedding(50, 16),
        torch.nn.Linear(16, 24),
        torch.nn.SiLU(),
        torch.nn.Linear(24, 50),
    )
    per_token, on_weights = [], []
    for rows in (2, 8):
        ids = torch.randint(0, 50, (rows, 12))
        with OpCounter(weights=net.parameters()) as counter:
            with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
                logits = net(ids)
            torch.nn.functional.cross_entropy(
                logits.float().flatten(0, 1), ids.flatten()
            ).backward()
        c = counter.counts
        per_token.append(sum(c.activation_traffic.values()) / ids.numel())
        on_weights.append(c.weight_traffic_bytes)
        net.zero_grad(set_to_none=True)
    assert per_token[0] == pytest.approx(per_token[1], rel=0.02), per_token
    assert on_weights[0] == on_weights[1] > 0  # casts, gradients: once a micro-batch
