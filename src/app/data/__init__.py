"""Data sets, built from `conf/data/*.yaml` by `_target_`.

A data object (a `DataModule`) owns its train and validation data sets and the loader
settings; the loop builds the loaders (it owns samplers and their position, for exact
resume). Models are built with the `input_shape` and `num_classes` a data object reports.
Any map-style `Dataset` of `(input, target)` pairs works as `train` and `val`, in every mode.
"""

from app.data.base import DataModule, first_samples
from app.data.digits import Digits, ShiftedImages, load_digits_arrays
from app.data.folders import ImageFolder
from app.data.hf import HFImages
from app.data.synthetic import Synthetic

__all__ = ["DataModule", "Digits", "HFImages", "ImageFolder", "ShiftedImages",
           "Synthetic", "first_samples", "load_digits_arrays"]
