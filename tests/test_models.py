"""The built-in ResNet for real images, and torchvision's and timm's models by name (optional:
they are tested where they import; elsewhere their configs fail in one line saying why)."""

from __future__ import annotations

import pytest
import torch

from app.errors import UserError
from app.models import ResNet, timm_model, torchvision_model


def _imports(name: str) -> bool:
    try:
        __import__(name)
    except (ImportError, RuntimeError):  # (PyPI's torchvision on a CPU build of torch)
        return False
    return True


@pytest.mark.parametrize("shape", [(3, 32, 32), (1, 17, 23), (3, 8, 8)])
def test_the_resnet_takes_any_image_size_and_its_channels(shape) -> None:
    model = ResNet(shape, num_classes=5, channels=[8, 16], blocks=2).eval()
    assert model(torch.zeros(2, *shape)).shape == (2, 5)


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"input_shape": (64,)}, "model=resnet needs images"),
    ({"channels": [8, 0]}, "model.channels"), ({"blocks": 0}, "model.blocks=0"),
    ({"dropout": 1.0}, "model.dropout=1.0")])
def test_the_resnets_bad_settings_are_named(kwargs, words) -> None:
    with pytest.raises(UserError, match=words):
        ResNet(**{"input_shape": (3, 8, 8), "num_classes": 2, **kwargs})


@pytest.mark.parametrize(("factory", "package"), [(torchvision_model, "torchvision"),
                                                  (timm_model, "timm")])
def test_a_model_library_that_does_not_import_is_one_line(factory, package) -> None:
    if _imports(package):
        pytest.skip(f"{package} imports here: test_models_by_name covers it")
    with pytest.raises(UserError, match=f"model={package} needs {package}, which does not "
                                        f"import here"):
        factory((3, 32, 32), 10)


@pytest.mark.skipif(not (_imports("torchvision") and _imports("timm")),
                    reason="torchvision and timm do not import here (PyPI's torchvision needs a "
                           "CUDA build of torch); the GPU machine has both: run this file there")
def test_models_by_name() -> None:
    for model in (torchvision_model((3, 32, 32), 7, name="resnet18"),
                  timm_model((1, 32, 32), 7, name="resnet18")):
        assert model.eval()(torch.zeros(1, model.conv1.in_channels, 32, 32)).shape == (1, 7)
    with pytest.raises(UserError, match="model.name=nonet"):
        timm_model((3, 32, 32), 7, name="nonet")
    with pytest.raises(UserError, match="take 3 channels"):
        torchvision_model((1, 32, 32), 7)

