"""`device_id` where the device asked for is not there: say what is missing and what to type."""

from __future__ import annotations

import pytest

from app.env import SINGLE
from app.errors import UserError
from app.launch import plan as plan_module
from app.launch.run import launch
from conftest import make_config


@pytest.mark.parametrize("overrides,words", [
    (["accelerator=cuda", "device_id=3"],
     "device_id=3: no cuda device is visible here, so the run would be on the cpu, which is one "
     "device; drop device_id (and use accelerator=cpu)"),
    (["accelerator=auto", "device_id=1"],
     "cpu has one device, and no GPU or other accelerator is visible; drop device_id"),
    (["accelerator=cpu", "device_id=1"], "drop it for accelerator=cpu"),
])
def test_device_id_without_its_device_says_what_to_type(monkeypatch, tmp_path, overrides,
                                                        words) -> None:
    monkeypatch.setattr(plan_module, "available", lambda kind: kind == "cpu")  # a machine, no GPU
    with pytest.raises(UserError) as err:  # (a single process, not a rank of a job)
        launch(make_config(*overrides), tmp_path, SINGLE)
    assert words in str(err.value), str(err.value)
    if "accelerator=cuda" in overrides:
        assert "accelerator=cuda device_id" not in str(err.value)  # not what the user typed
