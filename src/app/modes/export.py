"""`trainer=export`: TorchScript and `torch.export` files, each checked against the eager model."""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path

import torch

from app.config import AppConfig
from app.data import first_samples
from app.errors import ExportMismatch
from app.files import write_text_atomically, written_aside
from app.training.build import build_data, build_trained_model

log = logging.getLogger(__name__)


@torch.no_grad()
def run_export(cfg: AppConfig, run_dir: Path, device: torch.device) -> float:
    # Exported programs are traced on the CPU, where every deployment can load them.
    data = build_data(cfg)
    model, _ = build_trained_model(cfg, data)
    # The example comes from the data (any data set); the check runs on another batch size.
    x_val, _ = first_samples(data.val, 8 + data.val_batch_size)
    example, check = x_val[:8], x_val[8:] if len(x_val) > 8 else x_val[:1]
    out_dir = run_dir / "export"
    out_dir.mkdir(parents=True, exist_ok=True)

    # TorchScript is deprecated upstream in favour of torch.export, but many deployments
    # still load .ts files; the warning says nothing the user can act on here.
    # Each file is written aside and renamed when whole (app.files.written_aside): a kill
    # mid-export leaves no truncated model.ts or model.pt2 under its name.
    ts_path, pt2_path = out_dir / "model.ts", out_dir / "model.pt2"
    with warnings.catch_warnings(), written_aside(ts_path) as tmp:
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"torch\.jit")
        scripted = torch.jit.trace(model, example)
        scripted.save(str(tmp))
        ts_loaded = torch.jit.load(str(tmp))

    batch = torch.export.Dim("batch", min=1)
    program = torch.export.export(model, (example,), dynamic_shapes=({0: batch},))
    with written_aside(pt2_path, keep_suffix=True) as tmp:
        torch.export.save(program, str(tmp))
        pt2_loaded = torch.export.load(str(tmp)).module()

    eager = model(check)
    diffs = {name: (loaded(check) - eager).abs().max().item()
             for name, loaded in (("torchscript", ts_loaded), ("torch_export", pt2_loaded))}
    write_text_atomically(out_dir / "check.json", json.dumps(
        {"batch_size": len(check), "tolerance": cfg.export.tolerance,
         "max_abs_diff": diffs}, indent=2) + "\n")
    # What a deployment needs besides the model: the input it takes and what outputs mean.
    write_text_atomically(out_dir / "model.json", json.dumps(
        {"input_shape": list(data.input_shape), "num_classes": data.num_classes,
         "classes": data.classes, "data": {"_target_": cfg.data["_target_"],
                                           **data.state_dict()},
         "ckpt": str(cfg.ckpt)}, indent=2) + "\n")
    bad = {k: v for k, v in diffs.items() if not v <= cfg.export.tolerance}
    if bad:
        raise ExportMismatch(
            f"exported model differs from the eager model beyond "
            f"export.tolerance={cfg.export.tolerance}: {bad}")
    log.info("exported %s and %s; max abs diff vs eager on %d inputs: %s",
             ts_path, pt2_path, len(check), diffs)
    return max(diffs.values())
