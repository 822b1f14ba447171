"""`device_id` where the device asked for is not there: say what is missing and what to type."""

from __future__ import annotations

import pytest

from app.env import SINGLE
from app.errors import UserError
from app.launch import plan as plan_module
from app.launch.run import launch
from conftest import make_config


@pytest.mark.parametrize("accelerator", ["accelerator=cuda", "accelerator=auto", "accelerator=cpu"])
def test_device_id_without_its_device_says_to_drop_it(monkeypatch, tmp_path, accelerator) -> None:
    # accelerator=cuda falls back to the CPU here (accelerator_strict=false, with a warning).
    monkeypatch.setattr(plan_module, "available", lambda kind: kind == "cpu")  # a machine, no GPU
    with pytest.raises(UserError) as err:  # (a single process, not a rank of a job)
        launch(make_config(accelerator, "accelerator_strict=false", "device_id=1"), tmp_path,
               SINGLE)
    assert "device_id=1: the run is on the cpu, which is one device" in str(err.value)
    assert str(err.value).endswith("drop device_id")
