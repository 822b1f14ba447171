"""Installing app changes nothing for another Hydra program in the same environment: the stock
submitit launchers keep their own nodes, results and exit codes there, and its submitting
process imports neither torch nor app. In app, the same names mean app's launchers.

"Without app" is an interpreter that sees the same site-packages but not app: a virtualenv
whose one `.pth` line adds this environment's site-packages folder, so that the `.pth` files
in it (app's editable install among them) are not run. Its jobs (submitit starts them with
`sys.executable`) see no app either.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from app.config import register_schemas
from conftest import CONF_DIR

sys.path.insert(0, str(Path(__file__).resolve().parent / "helpers"))
from slurm_cluster import cluster_up  # noqa: E402

PEER = Path(__file__).resolve().parent / "peer" / "hydra-submitit-launcher-1.2.0"

# A Hydra program of someone else's: returns x, raises when told to, and leaves its return
# value in its job's output folder (the submitting process never prints it).
FOREIGN = textwrap.dedent("""\
    import sys
    from pathlib import Path

    import hydra
    from hydra.core.hydra_config import HydraConfig

    @hydra.main(version_base="1.3", config_path=None)
    def main(cfg) -> float:
        if cfg.get("fail"):
            raise RuntimeError("this job fails")
        value = float(cfg.x) * 2
        Path(HydraConfig.get().runtime.output_dir, "value.txt").write_text(str(value))
        return value

    if __name__ == "__main__":
        main()
        # What the submitting process imported (it ends here; Hydra returns after a sweep).
        # (Hydra's plugin scan runs every plugin module: app's small ones too.)
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "app"))
        print("IMPORTED:", " ".join(loaded) or "-")
""")


@pytest.fixture(scope="module")
def without_app(tmp_path_factory: pytest.TempPathFactory) -> str:
    """An interpreter with this environment's packages, app's left out."""
    venv = tmp_path_factory.mktemp("without-app")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()"
                           "['purelib'])"], capture_output=True, text=True, check=True)
    folders = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    Path(site.stdout.strip(), "environment.pth").write_text("\n".join(folders) + "\n")
    check = subprocess.run([python, "-c", "import importlib.util as u; import hydra, submitit; "
                            "print(u.find_spec('app'), u.find_spec('hydra_plugins.app_submitit'))"],
                           capture_output=True, text=True, cwd=venv)
    assert check.stdout.split() == ["None", "None"], check.stdout + check.stderr
    return python


def _foreign(tmp_path: Path, python: str, *overrides: str) -> dict:
    """Run the foreign program's sweep; what it left: exit code, files, values, imports."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "my_app.py").write_text(FOREIGN)
    proc = subprocess.run([python, "my_app.py", "-m", "hydra.sweep.dir=sweep", *overrides],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    sweep = tmp_path / "sweep"
    files = sorted(str(p.relative_to(sweep)) for p in sweep.rglob("*")
                   if p.is_file() and ".submitit" not in p.parts) if sweep.is_dir() else []
    values = {p.parent.name: p.read_text() for p in sweep.glob("*/value.txt")}
    imported = re.findall(r"^IMPORTED: (.*)$", proc.stdout, re.M)
    return {"rc": proc.returncode, "files": files, "values": values, "imported": imported,
            "output": proc.stdout[-3000:] + proc.stderr[-3000:]}


def _same_with_and_without_app(tmp_path: Path, without_app: str, *overrides: str) -> dict:
    stock = _foreign(tmp_path / "without", without_app, *overrides)
    with_app = _foreign(tmp_path / "with", sys.executable, *overrides)
    for key in ("rc", "files", "values"):
        assert with_app[key] == stock[key], (key, with_app["output"], stock["output"])
    return with_app


def test_the_stock_plugins_own_tests_pass_with_app_installed() -> None:
    """hydra-submitit-launcher 1.2.0's test file (tests/peer/, warnings as errors) against the
    installed plugin, in this environment, where app is installed."""
    import importlib.util

    assert importlib.util.find_spec("hydra_plugins.app_submitit") is not None
    proc = subprocess.run([sys.executable, "-m", "pytest", ".", "-p", "no:cacheprovider", "-c",
                           "pytest.ini", "--rootdir", ".", "-q"], cwd=PEER,
                          capture_output=True, text=True, timeout=600,
                          # (as its authors run it: not as a worker of this suite's xdist)
                          env={k: v for k, v in os.environ.items()
                               if not k.startswith("PYTEST_XDIST")})
    out = proc.stdout[-4000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, out
    assert re.search(r"^23 passed", proc.stdout.splitlines()[-1]), out


def test_a_foreign_local_sweep_is_the_stock_one(tmp_path: Path, without_app: str) -> None:
    seen = _same_with_and_without_app(tmp_path, without_app, "hydra/launcher=submitit_local",
                                      "+x=1,2")
    assert seen["rc"] == 0 and seen["values"] == {"0": "2.0", "1": "4.0"}, seen["output"]
    assert seen["imported"] == ["-"], seen["imported"]  # (neither torch nor app)
    assert "0/.hydra/overrides.yaml" in seen["files"]


def test_a_foreign_local_job_that_raises_fails_the_command(tmp_path: Path,
                                                           without_app: str) -> None:
    seen = _same_with_and_without_app(tmp_path, without_app, "hydra/launcher=submitit_local",
                                      "+x=1", "+fail=true")
    assert seen["rc"] == 1 and "this job fails" in seen["output"], seen["output"]


def test_a_foreign_slurm_sweep_is_the_stock_one(tmp_path: Path, without_app: str) -> None:
    problem = cluster_up("debug")
    if problem is not None:
        message = f"no local Slurm cluster ({problem}): start one with `make slurm-up` (root)"
        pytest.fail(message) if os.environ.get("CI") else pytest.skip(message)
    seen = _same_with_and_without_app(tmp_path, without_app, "hydra/launcher=submitit_slurm",
                                      "hydra.launcher.timeout_min=5", "+x=1,3", "+fail=false")
    assert seen["rc"] == 0 and seen["values"] == {"0": "2.0", "1": "6.0"}, seen["output"]
    failed = _same_with_and_without_app(tmp_path / "failing", without_app,
                                        "hydra/launcher=submitit_slurm",
                                        "hydra.launcher.timeout_min=5", "+x=1", "+fail=true")
    assert failed["rc"] == 1 and "this job fails" in failed["output"], failed["output"]


def _launcher_target(config_dir: Path, config_name: str | None, *overrides: str) -> str:
    register_schemas()
    GlobalHydra.instance().clear()
    with initialize_config_dir(str(config_dir), version_base="1.3"):
        cfg = compose(config_name, overrides=list(overrides), return_hydra_config=True)
    return str(OmegaConf.select(cfg, "hydra.launcher._target_"))


@pytest.mark.parametrize("name", ["submitit_slurm", "submitit_local"])
def test_in_one_process_app_gets_its_launchers_and_another_program_the_stock_ones(
        tmp_path: Path, name: str) -> None:
    """Composing app first (a test, a notebook) leaves the stock nodes to the next program."""
    ours = _launcher_target(CONF_DIR, "config", f"hydra/launcher={name}")
    theirs = _launcher_target(tmp_path, None, f"hydra/launcher={name}")
    again = _launcher_target(CONF_DIR, "config", f"hydra/launcher={name}")
    assert ours == again and ours.startswith("hydra_plugins.app_submitit.launcher.App")
    assert theirs.startswith("hydra_plugins.hydra_submitit_launcher.submitit_launcher.")


@pytest.mark.parametrize("executor, shape, said", [
    ("local", {"tasks_per_node": 2, "nodes": 1},
     "hydra.launcher.tasks_per_node=2 nodes=1: a local job is one process on this machine"),
    ("local", {"tasks_per_node": 1, "nodes": 3},
     "hydra.launcher.tasks_per_node=1 nodes=3: a local job is one process"),
    ("slurm", {"tasks_per_node": 4, "nodes": 1},
     "devices=2 nodes=1 differ from the sweep's allocation (4 tasks per node, 1 nodes)"),
])
def test_a_stock_shape_app_cannot_honour_is_refused_in_one_line(executor, shape, said) -> None:
    """Every task of app's Slurm job is a rank; a local job spawns its workers itself."""
    from app.errors import UserError
    from hydra_plugins.app_submitit.launcher import AppLocalLauncher, AppSlurmLauncher

    launcher = {"local": AppLocalLauncher, "slurm": AppSlurmLauncher}[executor](
        submitit_folder="unused", timeout_min=1, **shape)
    with pytest.raises(UserError, match="^" + re.escape(said)):
        launcher._check_allocation(2, 1)
    if executor == "slurm":
        launcher._check_allocation(4, 1)  # (the shape of devices=4: taken)
