#!/usr/bin/env bash
# The checks that need the GPU machine (CUDA; torchvision and timm, which import only with a
# CUDA build of torch), as one command for the device tool, from the repository's root:
#   scripts/gpu-check.sh            (with app's own dependencies carried as wheels in .whl/,
#                                    see docs/development.md)
# Prints each check's result; exits non-zero when one failed.
set -uo pipefail
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests/helpers
fi
export PYTHONUNBUFFERED=1
failed=0
check() { echo "== $*"; "$@" || { echo "!! FAILED: $*"; failed=1; }; }

nvidia-smi -L
check python3 -c "import torch, torchvision, timm, hydra, submitit, matplotlib, psutil; print('torch', torch.__version__, 'torchvision', torchvision.__version__, 'timm', timm.__version__, 'cuda', torch.cuda.is_available())"
check python3 -m pytest -q -p no:cacheprovider -o addopts="" -rs tests/test_models.py \
  tests/test_gpu.py
out=/tmp/gpu-runs  # (their files stay there; the log says what they did)
for model in torchvision timm; do
  run=$out/$model
  check python3 -m app hydra.run.dir="$run" accelerator=cuda accelerator_strict=true \
    model=$model model.name=resnet18 data=synthetic data.input_shape=[3,32,32] \
    data.num_samples=2048 trainer.max_epochs=2 precision=bf16-mixed trainer.progress_bar=false
  check python3 -m app hydra.run.dir="$run-eval" trainer=eval run="$run"
  check python3 -m app hydra.run.dir="$run-export" trainer=export run="$run"
  check python3 -m app hydra.run.dir="$run-predict" trainer=predict run="$run"
done
# The default job and the built-in ResNet on the GPU, with AMP and compile.
check python3 -m app hydra.run.dir="$out/cnn" accelerator=cuda accelerator_strict=true \
  trainer.max_epochs=3 trainer.progress_bar=false
check python3 -m app hydra.run.dir="$out/resnet" accelerator=cuda accelerator_strict=true \
  model=resnet data=synthetic data.input_shape=[3,32,32] data.num_samples=2048 \
  trainer.max_epochs=2 precision=bf16-mixed compile=true trainer.progress_bar=false
grep -h "eval of\|exported\|predicted\|done:" "$out"/*/train.log 2>/dev/null | cut -c1-220
# The step ratio against a plain loop, and where the app's step goes (a table each; the
# numbers go to docs/development.md by hand: nothing here asserts a time).
check bash -c "cd bench && python3 gpu_steps.py cuda"
echo "gpu-check: $([ $failed = 0 ] && echo all passed || echo some FAILED)"
exit $failed
