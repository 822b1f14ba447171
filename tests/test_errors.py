"""Bad input through the real CLI: one clear line naming the key or path, non-zero, no traceback."""

from __future__ import annotations

import pytest

from conftest import TINY, run_app

CASES = {
    "unknown key": (["trainer.max_epoch=3"], "max_epoch"),
    "unknown group option": (["model=resnet"], "resnet"),
    "wrong type": (["trainer.max_epochs=many"], "max_epochs"),
    "wrong choice": (["trainer.monitor_mode=up"], "monitor_mode"),
    "negative learning rate": (["optimizer.lr=-0.1"], "optimizer.lr=-0.1"),
    "no stopping rule": (["trainer.max_epochs=null"], "trainer.max_steps"),
    "zero batch": (["data.batch_size=0"], "data.batch_size=0"),
    "batch larger than data": (["data.batch_size=5000"], "data.batch_size=5000"),
    "bad monitor": (["trainer.monitor=val/f1"], "trainer.monitor=val/f1"),
    "eval without checkpoint": (["trainer=eval"], "ckpt=PATH"),
    "missing checkpoint": (["trainer=eval", "ckpt=/nonexistent/best.pt"],
                           "/nonexistent/best.pt: file not found"),
    "missing resume file": (["resume=/nonexistent/last.pt"], "/nonexistent/last.pt"),
    "missing predict input": (["trainer=predict", "ckpt=CKPT", "trainer.input=/no/such.npy"],
                              "trainer.input=/no/such.npy"),
    "checkpoint of another model": (["trainer=eval", "ckpt=CKPT", "model=mlp"],
                                    "does not match the model"),
    "checkpoint of another width": (["trainer=eval", "ckpt=CKPT"], "shape"),
    "several nodes without an address": (["nodes=2"], "dist_url=tcp://HOST:PORT"),
    "missing accelerator, strict": (["accelerator=xpu", "accelerator_strict=true"],
                                    "accelerator=xpu"),
    "unknown accelerator": (["accelerator=tpu"], "accelerator=tpu"),
    "horovod": (["distributed.horovod=true"], "Horovod is not supported"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_gives_one_clear_error(case, trained, tmp_path) -> None:
    overrides, words = CASES[case]
    ckpt = trained / "checkpoints" / "best.pt"
    overrides = [o.replace("CKPT", str(ckpt)) for o in overrides]
    # Cases that change the model, or need the default width, drop TINY's model settings.
    keep_model = "width" not in case and not any(o.startswith("model=") for o in overrides)
    tiny = [t for t in TINY if keep_model or not t.startswith("model.")]
    result = run_app(tmp_path / "run", *tiny, *overrides)
    assert result.returncode != 0
    assert words in result.output, result.output[-3000:]
    assert "Traceback" not in result.output
    assert len(result.stderr.strip().splitlines()) <= 12, result.stderr  # no wall of text
    assert not (tmp_path / "run" / "checkpoints").exists()
