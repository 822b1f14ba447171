# app: `make help` lists the targets.
PYTHON ?= python3
# On a machine without torch this installs the CPU build that lies on disk here (pip finds it);
# elsewhere pip takes it from PyPI. A torch already installed (a CUDA build, say) is kept.
TORCH_SPEC ?= torch==2.13.0
# One stamp per environment (named by its sys.prefix): a new virtualenv or conda environment
# gets an install of its own instead of trusting the stamp of another.
STAMP := .installed-$(shell $(PYTHON) -c "import sys, zlib; print(zlib.crc32(sys.prefix.encode()))" 2>/dev/null)

.PHONY: help install run test test-slow test-docs test-gpu bench lint clean slurm-up slurm-down

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-10s %s\n", $$1, $$2}'

# An environment inside the checkout (python3 -m venv v) is no part of the code: a .gitignore
# of `*` in it, as Python 3.13's venv writes one, keeps it out of git and so out of a Slurm
# job's code snapshot (which copies the untracked files git does not ignore).
$(STAMP): pyproject.toml
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install "$(TORCH_SPEC)"
	$(PYTHON) -m pip install -e ".[dev]"
	@$(PYTHON) -c "import pathlib, sys; env, here = (pathlib.Path(p).resolve() for p in (sys.prefix, '.')); ignore = env / '.gitignore'; here in env.parents and not ignore.exists() and ignore.write_text('# made by make install: this environment is not part of the code\n*\n')"
	@touch $(STAMP)

install:  ## install torch (if missing), app (editable) and the dev tools into $(PYTHON)
	@rm -f $(STAMP)
	@$(MAKE) --no-print-directory $(STAMP)

run: $(STAMP)  ## train the default job (CNN on digits) into outputs/
	$(PYTHON) -m app

# Four pytest workers, the tests spread one by one: many tests wait (on a Slurm queue, a
# timeout, a process starting), so two per core keep both cores busy (docs/measurements.md).
# The files that share a module fixture stay on one worker (tests/conftest.py ONE_WORKER).
test: $(STAMP)  ## run the test suite
	$(PYTHON) -m pytest -n 4 --dist loadgroup

# The four slow trials on two workers: 10 min against about 15 one at a time (docs/measurements.md).
test-slow: $(STAMP)  ## the slow fault trials: SIGKILL during checkpoints, a soak, override fuzzing
	$(PYTHON) -m pytest -m slow -n 2 -rP

# Every page's commands, as a reader runs them (tests/test_docs_run.py); the pages side by side.
test-docs: $(STAMP)  ## run every command of README.md and docs/ and check the output they quote
	$(PYTHON) -m pytest -m docs -n 4 -rP

test-gpu: $(STAMP)  ## the GPU lane, on a machine with CUDA (elsewhere each test skips, saying why)
	$(PYTHON) -m pytest -rs -o addopts="" tests/test_gpu.py tests/test_models.py

bench: $(STAMP)  ## benchmarks against baselines, side by side; writes BENCHMARKS.md
	$(PYTHON) bench/run.py

lint: $(STAMP)  ## ruff
	$(PYTHON) -m ruff check src tests bench

slurm-up:  ## start a local Slurm cluster of 3 emulated nodes (root; installs Debian's slurm; safe to rerun)
	scripts/slurm-local.sh up

slurm-down:  ## stop the local Slurm cluster
	scripts/slurm-local.sh down

clean:  ## remove caches and build files (never outputs/: runs are kept)
	rm -rf .pytest_cache .ruff_cache build dist src/*.egg-info .installed*
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
