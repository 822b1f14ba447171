"""Pictures of what the model gets right and wrong, as training goes."""

from __future__ import annotations

import torch

from app.checks import whole
from app.data import first_samples
from app.reporting.grids import save_grid
from app.training.hooks import Callback, Run


class EvalVisuals(Callback):
    """Every `every_n_validations`-th validation: a PNG grid of the first `num_show` validation
    samples (as they are: the data's `show`) with predicted and true labels,
    `eval_visuals/step-NNNNNNNN.png` of the run. Uses the weights that validate (the EMA's
    with ema=true); draws no random numbers, so training is unchanged by it."""

    def __init__(self, every_n_validations: int = 1, num_show: int = 16) -> None:
        self.every = whole("every_n_validations", every_n_validations, 1)
        self.num_show = whole("num_show", num_show, 1)
        self.validations = 0

    def on_validation_end(self, run: Run, step: int, metrics: dict[str, float]) -> None:
        self.validations += 1
        if self.validations % self.every:
            return

        x, y = first_samples(run.data.val, self.num_show)
        model = run.eval_model
        was_training = model.training
        model.eval()
        with torch.no_grad():
            dtype = next(model.parameters()).dtype
            preds = model(x.to(run.device, dtype)).argmax(1).cpu()
        model.train(was_training)
        right = int((preds == y).sum())
        title = (f"step {step}: {right}/{len(y)} right (green), val/acc "
                 f"{metrics['val/acc']:.4f} over the whole split")
        out = run.run_dir / "eval_visuals"
        out.mkdir(exist_ok=True)
        save_grid(run.data.show(x), preds.tolist(), y.tolist(), title,
                  out / f"step-{step:08d}.png", classes=run.data.classes)

    def state_dict(self) -> dict[str, int]:
        return {"validations": self.validations}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.validations = state["validations"]
