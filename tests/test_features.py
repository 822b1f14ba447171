"""The training features: precision, EMA, accumulation, clipping, optimizer hygiene, compile,
SyncBatchNorm, data loading, memory reservation, runtime flags, custom components, partial
loading and the detail view."""

from __future__ import annotations

import json
import math
import signal
import textwrap

import pytest
import torch
from torch import nn

from app.data import ShiftedImages
from app.errors import UserError, WorkerFailed
from app.schedulers import constant
from app.training.build import build_data, build_model, build_optimizer, parameter_groups
from app.training.ema import ModelEMA
from app.training.step import TrainStep
from conftest import (
    TINY,
    assert_ok,
    assert_same_weights,
    load_state,
    make_config,
    read_metrics,
    run_app,
    run_job,
)

FAST = [*TINY, "trainer.max_epochs=2"]


def _losses(run_dir) -> list[float]:
    return [float(r["loss"]) for r in read_metrics(run_dir) if r["split"] == "train"]


# -- precision ------------------------------------------------------------------------------

def test_bf16_mixed_and_bf16_true_train_on_cpu(tmp_path) -> None:
    mixed = run_job(tmp_path / "mixed", *FAST, "precision=bf16-mixed").run_dir
    true = run_job(tmp_path / "true", *FAST, "precision=bf16-true").run_dir
    full = run_job(tmp_path / "full", *FAST).run_dir
    assert _losses(mixed) != _losses(full)  # autocast really ran in bf16
    assert all(torch.isfinite(torch.tensor(_losses(mixed))))
    weights = load_state(true / "checkpoints" / "last.pt")["model"]
    assert all(w.dtype == torch.bfloat16 for w in weights.values())
    assert load_state(mixed / "checkpoints" / "last.pt")["model"]["head.2.weight"].dtype == (
        torch.float32)


def test_fp16_mixed_on_cpu_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(UserError, match="precision=bf16-mixed"):  # (exit 2 in the CLI)
        run_job(tmp_path / "run", *FAST, "precision=16-mixed", "accelerator=cpu")


# -- EMA ------------------------------------------------------------------------------------

def test_ema_ramps_up_and_follows_the_model() -> None:
    model = nn.Linear(2, 1)
    with torch.no_grad():
        model.weight.fill_(0.0)
    ema = ModelEMA(model, decay=0.9, warmup_steps=10)
    with torch.no_grad():
        model.weight.fill_(1.0)
    ema.update(model)  # first decay: 0.9 * (1 - e^-0.1) ~ 0.086, mostly the new weights
    d = 0.9 * (1 - math.exp(-0.1))
    assert ema.module.weight.flatten().tolist() == pytest.approx([1 - d, 1 - d])
    ema.update(model)  # the second decay is larger; the weights keep approaching 1
    assert 1 - d < ema.module.weight[0, 0].item() < 1
    state = ema.state_dict()
    other = ModelEMA(nn.Linear(2, 1), decay=0.9, warmup_steps=10)
    other.load_state_dict(state)
    assert other.updates == 2 and torch.equal(other.module.weight, ema.module.weight)


def test_ema_validates_is_checkpointed_and_is_what_eval_uses(tmp_path) -> None:
    run_dir = run_job(tmp_path / "ema", *FAST, "trainer.ema=true",
                      "trainer.ema_warmup_steps=10").run_dir
    state = load_state(run_dir / "checkpoints" / "best.pt")
    ema = state["train_step"]["ema"]
    assert ema["updates"] == state["loop"]["step"]
    assert not torch.equal(ema["module"]["head.2.weight"], state["model"]["head.2.weight"])
    result = run_job(tmp_path / "eval", "trainer=eval", "model.channels=[8,16]",
                     f"ckpt={run_dir}/checkpoints/best.pt")
    assert json.loads((result.run_dir / "eval.json").read_text())["acc"] == (
        state["metrics"]["acc"])


# -- accumulation and clipping --------------------------------------------------------------

def _step_once(model: nn.Module, batches, clip: float | None = None, lr: float = 0.1) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    TrainStep(model, model, optimizer, constant(optimizer, 1), torch.device("cpu"), "32",
              clip, None)(batches)


def test_accumulating_two_half_batches_equals_one_full_batch() -> None:
    torch.manual_seed(0)
    x, y = torch.randn(64, 6), torch.randint(0, 3, (64,))
    a, b = nn.Linear(6, 3), nn.Linear(6, 3)
    b.load_state_dict(a.state_dict())
    _step_once(a, [(x, y)])
    _step_once(b, [(x[:32], y[:32]), (x[32:], y[32:])])
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.allclose(pa, pb, atol=1e-6)


def test_clipping_bounds_the_update() -> None:
    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    _step_once(model, [(torch.randn(8, 6) * 100, torch.randint(0, 3, (8,)))], clip=1e-3, lr=1.0)
    after = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert (after - before).norm() <= 1e-3 + 1e-6


def test_accumulation_in_the_cli_and_under_ddp(tmp_path) -> None:
    same = [*TINY, "trainer.max_epochs=1", "model.dropout=0", "trainer.ckpt_every_n_epochs=null"]
    full = run_job(tmp_path / "full", *same, "data.batch_size=64").run_dir
    accum = run_job(tmp_path / "accum", *same, "data.batch_size=32",
                    "trainer.accumulate_grad_batches=2").run_dir
    ddp = run_job(tmp_path / "ddp", *same, "data.batch_size=16", "devices=2",
                  "trainer.accumulate_grad_batches=2").run_dir
    for other in (accum, ddp):
        assert _losses(other) == pytest.approx(_losses(full), rel=1e-4, abs=1e-6)


# -- optimizer hygiene ----------------------------------------------------------------------

def test_no_weight_decay_on_biases_and_norm_weights() -> None:
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4, 2))
    decay, no_decay = parameter_groups(model, decay_norm_and_bias=False)
    assert {p.ndim for p in decay["params"]} == {2, 4}
    assert len(no_decay["params"]) == 4 and no_decay["weight_decay"] == 0.0
    assert len(parameter_groups(model, decay_norm_and_bias=True)) == 1


def test_lr_scaled_by_global_batch() -> None:
    cfg = make_config("trainer.lr_scale_batch=32", "optimizer.lr=0.01")
    data = build_data(cfg)
    optimizer = build_optimizer(cfg, build_model(cfg, data), global_batch=128)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.04)
    assert optimizer.param_groups[1]["weight_decay"] == 0.0


# -- compile, SyncBatchNorm and DDP options -------------------------------------------------

def test_compile_keeps_checkpoints_free_of_prefixes(tmp_path) -> None:
    run_dir = assert_ok(run_app(tmp_path / "run", "debug=fast", "model=mlp", "model.hidden=[32]",
                                "compile=true", timeout=600)).run_dir
    keys = load_state(run_dir / "checkpoints" / "last.pt")["model"].keys()
    assert keys and not [k for k in keys if "_orig_mod" in k or k.startswith("module.")]


def test_ddp_options_under_two_workers(tmp_path) -> None:
    run_dir = run_job(
        tmp_path / "run", "debug=fast", "model.channels=[8,16]", "model.batch_norm=true",
        "devices=2", "distributed.static_graph=true", "distributed.find_unused_parameters=true",
        "distributed.bucket_cap_mb=1", "distributed.broadcast_buffers=false").run_dir
    assert load_state(run_dir / "checkpoints" / "last.pt")["loop"]["step"] == 6


def test_sync_batchnorm_on_cpu_is_a_clear_error(tmp_path) -> None:
    # PyTorch's SyncBatchNorm runs on GPUs only; the conversion itself is PyTorch's.
    with pytest.raises(WorkerFailed, match="SyncBatchNorm has no CPU kernel"):
        run_job(tmp_path / "run", "debug=fast", "model.batch_norm=true", "devices=2",
                "distributed.sync_batchnorm=true")


# -- data loading ---------------------------------------------------------------------------

def test_shift_augmentation_depends_on_seed_epoch_and_index_only() -> None:
    images = torch.arange(16 * 64, dtype=torch.float32).reshape(16, 1, 8, 8)
    data = ShiftedImages(images, torch.zeros(16, dtype=torch.long), shift=2)
    data.set_epoch(epoch=3, seed=0)
    first = [data[i][0] for i in range(16)]
    assert all(torch.equal(data[i][0], first[i]) for i in range(16))  # any worker, same shift
    shifted = sum(not torch.equal(first[i], images[i]) for i in range(16))
    assert shifted >= 12  # 1 in 25 samples keeps (0, 0)
    data.set_epoch(epoch=4, seed=0)
    assert sum(torch.equal(data[i][0], first[i]) for i in range(16)) < 8


def test_cache_puts_the_data_in_shared_memory() -> None:
    data = build_data(make_config("data.cache=true", "data.shift=1"))
    assert data.train.images.is_shared() and data.val.tensors[0].is_shared()


def test_loader_workers_with_augmentation_resume_exactly(tmp_path) -> None:
    overrides = [*TINY, "trainer.max_epochs=2", "data.num_workers=2", "data.shift=1",
                 "trainer.ckpt_every_n_steps=10", "trainer.keep_last=100"]
    reference = run_job(tmp_path / "reference", *overrides).run_dir
    resumed = run_job(tmp_path / "resumed", *overrides,
                      f"resume={reference}/checkpoints/step-00000030.pt").run_dir
    assert_same_weights(reference / "checkpoints" / "last.pt", resumed / "checkpoints" / "last.pt")


def test_resume_is_exact_with_ema_accumulation_and_bf16_mixed(tmp_path) -> None:
    overrides = [*TINY, "trainer.max_epochs=3", "trainer.ema=true",
                 "trainer.accumulate_grad_batches=2", "precision=bf16-mixed",
                 "trainer.ckpt_every_n_steps=4", "trainer.keep_last=100"]
    reference = run_job(tmp_path / "reference", *overrides).run_dir
    # 11 optimizer steps per epoch: step 16 lies in the middle of epoch 2
    resumed = run_job(tmp_path / "resumed", *overrides,
                      f"resume={reference}/checkpoints/step-00000016.pt").run_dir
    assert_same_weights(reference / "checkpoints" / "last.pt", resumed / "checkpoints" / "last.pt")
    ema_a = load_state(reference / "checkpoints" / "last.pt")["train_step"]["ema"]["module"]
    ema_b = load_state(resumed / "checkpoints" / "last.pt")["train_step"]["ema"]["module"]
    assert all(torch.equal(ema_a[k], ema_b[k]) for k in ema_a)
    after = [r for r in read_metrics(reference) if int(r["step"]) > 16]
    assert [r for r in read_metrics(resumed) if int(r["step"]) > 16] == after


# -- runtime flags, memory reservation, detail ----------------------------------------------

def test_runtime_flags_occupy_and_detail(tmp_path) -> None:
    handler = signal.getsignal(signal.SIGTERM)
    result = run_job(tmp_path / "run", "debug=fast", "model.channels=[8,16]",
                     "deterministic=true", "tf32=false", "occupy=0.5",
                     "distributed.omp_threads=1", "detail=true")
    assert "occupy=0.5: no GPU here, nothing reserved" in result.output
    assert "model summary:" in result.output and "total" in result.output
    assert "config:" in result.output and "deterministic: true" in result.output
    # The run turned deterministic algorithms on for the whole process; run_job put the
    # process back as it was, so that the next test in this pytest worker is not affected.
    assert not torch.are_deterministic_algorithms_enabled()
    assert signal.getsignal(signal.SIGTERM) is handler


# -- custom components and partial loading --------------------------------------------------

def test_a_model_and_config_from_outside_the_repo(tmp_path) -> None:
    package = tmp_path / "my_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "models.py").write_text(textwrap.dedent("""
        import math
        from torch import nn

        class TinyNet(nn.Module):
            def __init__(self, input_shape, num_classes, width=16):
                super().__init__()
                self.net = nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), width),
                                         nn.ReLU(), nn.Linear(width, num_classes))

            def forward(self, x):
                return self.net(x)
    """))
    (tmp_path / "conf" / "model").mkdir(parents=True)
    (tmp_path / "conf" / "model" / "tiny.yaml").write_text(
        "_target_: my_pkg.models.TinyNet\nwidth: 12\n")
    result = run_job(tmp_path / "run", "model=tiny", "debug=fast",
                     f"hydra.searchpath=[file://{tmp_path / 'conf'}]", user_code=tmp_path)
    weights = load_state(result.run_dir / "checkpoints" / "last.pt")["model"]
    assert weights["net.1.weight"].shape == (12, 64)


def test_partial_loading_for_a_changed_head(trained, tmp_path) -> None:
    ckpt = f"ckpt={trained}/checkpoints/best.pt"
    head = ["data=synthetic", "data.num_classes=4", "data.num_samples=256",
            "model.channels=[8,16]", "debug=fast"]
    with pytest.raises(UserError, match=r"head\.2\.weight"):  # (exit 2 in the CLI)
        run_job(tmp_path / "strict", *head, ckpt)
    loose = run_job(tmp_path / "loose", *head, ckpt, "ckpt_strict=false")
    assert "loaded 8 of 10 weights" in loose.output
    assert "skipped: head.2.bias (10,) vs (4,), head.2.weight (10, 64) vs (4, 64)" in loose.output


def test_occupy_validation() -> None:
    from hydra.errors import ConfigCompositionException

    from app.config import validate
    from app.errors import UserError

    with pytest.raises(UserError, match="occupy=1.5"):
        validate(make_config("occupy=1.5"))
    # A closed set: refused while composing (Hydra's report names the value).
    with pytest.raises(ConfigCompositionException, match="precision=fp8"):
        make_config("precision=fp8")
