"""Cluster operations on the local Slurm cluster (`make slurm-up`): a detached sweep (submit and
walk away; `python -m app.status`, `python -m app.report`), no job submitted twice, a dry run
that submits nothing, sweeps larger than MaxArraySize, refused submissions (the code
snapshot: tests/test_code_snapshot.py; the status lines, in-process: tests/test_status.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from app import slurm
from conftest import HELPERS, REPO, TINY
from test_status import UNREADABLE_RECORDS

sys.path.insert(0, str(HELPERS))
from slurm_cluster import job_ids, slurm_cluster, submit, wait_for  # noqa: E402, F401

# The cluster's tests need it (skipped without one outside CI); the in-process ones do not.
on_the_cluster = pytest.mark.usefixtures("slurm_cluster")


def _app_module(module: str, path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, str(path)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def _recorded(sweep: Path) -> dict[int, str]:
    record = json.loads((sweep / "submission.json").read_text())
    return {job["num"]: job["job_id"] for job in record["jobs"]}


def _scancel(sweep: Path) -> None:
    if (sweep / "submission.json").is_file():
        subprocess.run(["scancel", *{j.split("_")[0] for j in _recorded(sweep).values()}])


# -- on the cluster ------------------------------------------------------------------------------

@on_the_cluster
def test_a_detached_sweep_is_followed_then_summarised(tmp_path) -> None:
    """Submit 4 jobs and exit at once; status while they are held, running and done (one
    fails: its error is named and status exits 1); the same command again submits nothing
    that is queued; app.report summarises them."""
    sweep = tmp_path / "sweep"
    sweep_args = ["hydra.launcher.wait=false", "+hydra.launcher.additional_parameters.hold=true",
                  *TINY, "trainer.max_epochs=3", "model._target_=faults.FaultyCNN",
                  "+model.fault=raise", "+model.fault_rank=0",
                  "+model.fault_call=5,90000,90001,90002"]  # (job #0 fails at its 5th step)
    try:
        started = time.monotonic()
        first = submit(sweep, *sweep_args, timeout=120)
        output = first.stdout + first.stderr
        assert first.returncode == 0, output[-3000:]
        assert "4 job(s) submitted; this command does not wait for them" in output
        assert f"python -m app.status {sweep}" in output
        ids = _recorded(sweep)
        assert sorted(ids) == [0, 1, 2, 3] and len(set(ids.values())) == 4
        for num, job_id in ids.items():
            assert f"job #{num} (slurm job {job_id}): " in output
            assert (sweep / str(num) / ".hydra" / "submitted.yaml").is_file()
        held = _app_module("app.status", sweep)
        assert held.returncode == 0, held.stdout + held.stderr
        assert held.stdout.count(": queued (held)") == 4, held.stdout
        # The same command again: every job is still queued, none is submitted twice.
        again = submit(sweep, *sweep_args, timeout=120)
        assert again.returncode == 0
        assert (again.stdout + again.stderr).count("not submitted again") == 4
        assert _recorded(sweep) == ids
        assert {j.split("_")[0] for j in job_ids(sweep)} == {ids[0].split("_")[0]}  # one array
        subprocess.run(["scontrol", "release", next(iter(ids.values())).split("_")[0]],
                       check=True)
        seen: list[str] = []

        def ended() -> bool:
            seen.append(_app_module("app.status", sweep).stdout)
            return "4 job(s): 3 completed, 1 failed" in seen[-1]

        wait_for(ended, 300, "the 4 jobs to end", every=0.5)
        assert any(" running on node" in s and " of " in s for s in seen), seen
        final = _app_module("app.status", sweep)
        assert final.returncode == 1  # a job failed
        failed = [line for line in final.stdout.splitlines() if "failed" in line.lower()
                  and line.startswith("job #")]
        assert len(failed) == 1 and "RuntimeError: injected fault" in failed[0], final.stdout
        report = _app_module("app.report", sweep)
        assert report.returncode == 0, report.stderr
        rows = (sweep / "summary.csv").read_text().splitlines()[1:]
        assert len(rows) == 4 and sum(",completed," in r for r in rows) == 3, rows
        # Once more: the failed job is submitted again, and the command says so.
        last = submit(sweep, *sweep_args, timeout=120)
        output = last.stdout + last.stderr
        assert output.count("not submitted again") == 3, output[-3000:]
        assert f"job #0 (slurm job {ids[0]}) of an earlier submission of this sweep ended " \
            "failed: submitted again" in output, output[-3000:]
        print(f"detached sweep: submitted and ended in {time.monotonic() - started:.0f} s")
    finally:
        _scancel(sweep)


@on_the_cluster
def test_a_dry_run_prints_the_request_and_submits_nothing(tmp_path) -> None:
    sweep = tmp_path / "sweep"
    fits = submit(sweep, "hydra.launcher.dry_run=true", "optimizer.lr=0.1,0.01", *TINY,
                  timeout=120)
    assert fits.returncode == 0, fits.stdout + fits.stderr
    assert "#SBATCH --array=0-1%2" in fits.stdout and "#SBATCH --mem=1GB" in fits.stdout
    assert "#SBATCH --job-name=app\n" in fits.stdout  # (was __main__, python -m app's name)
    assert "each job: 1 node(s) x 1 task(s) = 1 rank(s); per node 0 GPU(s), 1 CPU(s)" in \
        fits.stdout
    assert "dry run: nothing was submitted; 0 problem(s) found" in fits.stdout
    assert "at a time" not in fits.stdout
    batched = submit(sweep, "hydra.launcher.dry_run=true", "optimizer.lr=0.1,0.01", *TINY,
                     "hydra.sweeper.max_batch_size=1", timeout=120)
    assert batched.returncode == 0 and "job #1" not in batched.stdout
    assert "(the sweeper gives the launcher 1 job(s) at a time, hydra.sweeper.max_batch_size: " \
        "this dry run is of the first batch)" in batched.stdout
    refused = submit(sweep, "hydra.launcher.dry_run=true", "hydra.launcher.partition=gpu",
                     "nodes=3", "hydra.launcher.cpus_per_task=64", *TINY, timeout=120)
    assert refused.returncode == 2
    assert "problem: hydra.launcher.partition=gpu: no such partition gpu; the cluster has " \
        "debug, faults" in refused.stdout
    # A list of partitions (Slurm runs the job in the first that can): each one checked.
    listed = submit(sweep, "hydra.launcher.dry_run=true", 'hydra.launcher.partition="debug,'
                    'faults"', *TINY, timeout=120)
    assert listed.returncode == 0 and "0 problem(s) found" in listed.stdout, listed.stdout
    too_big = submit(sweep, "hydra.launcher.dry_run=true", "nodes=3",
                     "hydra.launcher.cpus_per_task=64", *TINY, timeout=120)
    assert too_big.returncode == 2
    assert "problem: nodes=3: partition debug has 2 node(s)" in too_big.stdout
    assert "a node must offer 64 CPU(s), 1 GB, 0 GPU(s): 0 of partition debug's nodes do" in \
        too_big.stdout
    assert not (sweep / ".submitit").exists() and not (sweep / "submission.json").exists()


@on_the_cluster
def test_a_sweep_larger_than_max_array_size_runs_complete(tmp_path) -> None:
    """The test cluster's MaxArraySize is 4 (scripts/slurm-local.sh): 6 jobs go as arrays of 4
    and 2, the second after the first (array_parallelism=2 caps the sweep, not each array)."""
    limit = slurm.max_array_size()
    assert limit == 4, f"the test cluster's MaxArraySize is {limit}: run `make slurm-up`"
    sweep = tmp_path / "sweep"
    six = ["optimizer.lr=0.01,0.02,0.03,0.04,0.05,0.06", *TINY, "trainer.max_epochs=1",
           "hydra.launcher.array_parallelism=2"]
    dry = submit(tmp_path / "dry", *six, "hydra.launcher.dry_run=true", timeout=120)
    scripts = dry.stdout.split("# sbatch script of jobs ")[1:]
    assert [s.splitlines()[0] for s in scripts] == ["#0-#3 (4 job(s))", "#4-#5 (2 job(s))"]
    # The second array waits for the first, as the real submission asks.
    assert "--dependency" not in scripts[0]
    assert "#SBATCH --dependency=afterany:JOB_ID_OF_JOBS_0-3" in scripts[1], dry.stdout
    result = submit(sweep, *six, timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    ids = _recorded(sweep)
    arrays = sorted({j.split("_")[0] for j in ids.values()}, key=int)
    assert len(arrays) == 2
    assert [sum(j.startswith(f"{a}_") for j in ids.values()) for a in arrays] == [4, 2]
    assert f"jobs #4-#5: slurm job {arrays[1]}" in output
    rows = (sweep / "summary.csv").read_text().splitlines()[1:]
    assert len(rows) == 6 and all(",completed," in r for r in rows), rows


@on_the_cluster
def test_a_sweeper_that_needs_results_refuses_to_detach(tmp_path) -> None:
    sweep = tmp_path / "sweep"
    result = submit(sweep, "hparams_search=digits_optuna", "hydra.launcher.wait=false", *TINY,
                    timeout=120)
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-3000:]
    assert "hydra.launcher.wait=false: the sweeper" in output and "nothing was submitted" in \
        output
    assert "Traceback" not in output and not (sweep / ".submitit").exists()


def test_a_sweep_directory_of_other_values_is_refused(tmp_path) -> None:
    from app.sweeps.dirs import conflicts

    earlier = {0: ["optimizer.lr=0.01", "trainer.max_epochs=3"],
               1: ["optimizer.lr=0.003", "trainer.max_epochs=3"]}
    run_dirs = {num: tmp_path / str(num) for num in earlier}
    for num, found in earlier.items():
        (run_dirs[num] / ".hydra").mkdir(parents=True)
        (run_dirs[num] / ".hydra" / "overrides.yaml").write_text(
            "".join(f"- {o}\n" for o in found))
    same = {0: ["trainer.max_epochs=3", "++optimizer.lr=0.01"],  # (in another order, with ++)
            1: ["optimizer.lr=0.003", "trainer.max_epochs=3"]}
    assert conflicts(same, run_dirs) == []
    # A job's identity is its whole override set: a value every job shares counts too.
    longer = {0: ["optimizer.lr=0.01", "trainer.max_epochs=6"]}
    assert conflicts(longer, {0: run_dirs[0]}) == [
        f"job #0: its run directory {run_dirs[0]} holds a job of trainer.max_epochs=3, this "
        f"one is trainer.max_epochs=6"]
    other = {0: ["optimizer.lr=0.01", "trainer.max_epochs=3"],
             1: ["optimizer.lr=0.02", "trainer.max_epochs=3", "seed=1"],
             2: ["optimizer.lr=0.001"]}
    (said,) = conflicts(other, {**run_dirs, 2: tmp_path / "2"})
    assert said == (f"job #1: its run directory {run_dirs[1]} holds a job of "
                    f"optimizer.lr=0.003 (no seed), this one is optimizer.lr=0.02 seed=1")


def test_values_no_cluster_could_mean_are_named() -> None:
    from hydra_plugins.app_submitit._dry_run import invalid

    params = {"timeout_min": 60, "signal_delay_s": 120, "mem_gb": 0, "cpus_per_task": 1,
              "max_num_timeout": 3}
    assert invalid(params, 3) == []  # (mem_gb=0: all of a node's memory, as Slurm reads it)
    assert invalid({**params, "timeout_min": -5}, 3) == [
        "hydra.launcher.timeout_min=-5: give 1 minute or more"]
    assert "the time-limit signal would come as the job starts" in invalid(
        {**params, "timeout_min": 1}, 3)[0]
    # Slurm may send the signal up to 60 s early: 1 minute with 30 s requeued every job as
    # it started (burning its timeout retries); 2 minutes with 30 s leave it 30 s or more.
    assert "the 60 s Slurm may send it early" in invalid(
        {**params, "timeout_min": 1, "signal_delay_s": 30}, 3)[0]
    assert invalid({**params, "timeout_min": 2, "signal_delay_s": 30}, 3) == []
    assert invalid({**params, "mem_gb": -1}, -1) == [
        "hydra.launcher.mem_gb=-1: give 0 or more",
        "hydra.launcher.max_num_failures=-1: give 0 or more"]


@on_the_cluster
def test_a_sweep_of_other_values_into_a_used_sweep_directory_submits_nothing(tmp_path) -> None:
    sweep = tmp_path / "sweep"
    held = ["hydra.launcher.wait=false", "+hydra.launcher.additional_parameters.hold=true",
            *TINY]
    try:
        first = submit(sweep, *held, "optimizer.lr=0.01,0.003", timeout=120)
        assert first.returncode == 0, first.stdout + first.stderr
        ids = _recorded(sweep)
        dry = submit(sweep, *held, "optimizer.lr=0.01,0.02", "hydra.launcher.dry_run=true",
                     timeout=120)
        assert dry.returncode == 2 and "problem: job #1: its run directory" in dry.stdout
        again = submit(sweep, *held, "optimizer.lr=0.01,0.02", timeout=120)
        said = again.stdout + again.stderr
        assert again.returncode == 2, said[-3000:]
        assert "was used by a sweep of other values: job #1: its run directory" in said
        assert "this one is optimizer.lr=0.02" in said and "nothing was submitted" in said
        assert _recorded(sweep) == ids  # nothing new
        bad = submit(tmp_path / "other", *held, "hydra.launcher.timeout_min=1", timeout=120)
        assert bad.returncode == 2 and "signal_delay_s=120 is not under timeout_min=1" in \
            bad.stdout + bad.stderr
        assert not (tmp_path / "other" / "submission.json").exists()
    finally:
        _scancel(sweep)


@on_the_cluster
@pytest.mark.parametrize("content,words", [UNREADABLE_RECORDS[0], UNREADABLE_RECORDS[3]])
def test_an_unreadable_submission_record_submits_nothing(tmp_path, content, words) -> None:
    # Read as "no earlier submission", it would submit again jobs still queued from it.
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "submission.json").write_bytes(content)
    again = submit(sweep, "hydra.launcher.wait=false", "optimizer.lr=0.01,0.003", *TINY,
                   timeout=120)
    said = again.stdout + again.stderr
    assert again.returncode == 2, said[-3000:]
    assert words in said and "nothing was submitted" in said and "Traceback" not in said
    assert (sweep / "submission.json").read_bytes() == content
    assert not (sweep / ".submitit").exists() or not job_ids(sweep)


def test_each_job_of_a_sweep_is_composed_once_not_twice() -> None:
    # Hydra's sweeper composes each job to check the batch, then the launcher composes it
    # again: ComposedOnce hands the launcher the first composition (half the sweep's start).
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from app.config import register_schemas
    from hydra_plugins.app_submitit._job import ComposedOnce

    register_schemas()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        master = compose("config", return_hydra_config=True)
        loader = GlobalHydra.instance().config_loader()
        calls = []

        def load(master_config, sweep_overrides):
            calls.append(list(sweep_overrides))
            return loader.load_sweep_config(master_config, sweep_overrides)

        once = ComposedOnce(load)
        # Jobs 1 and 2 have the same overrides: each gets a config of its own.
        batch = [["seed=0"], ["seed=1"], ["seed=1"]]
        for overrides in batch:  # the sweeper's check
            once(master, overrides)
        composed = [once.take(master, overrides) for overrides in batch]  # the launcher's
        assert calls == batch and [c.seed for c in composed] == [0, 1, 1]
        assert len({id(c) for c in composed}) == 3
        # Without the sweeper's check (or once taken), each take composes anew.
        again = [once.take(master, ["seed=2"]) for _ in range(2)]
        assert again[0] is not again[1] and len(calls) == 5
        once(master, ["seed=3"])
        once.forget()
        assert not once.kept


@on_the_cluster
def test_a_submission_sbatch_refuses_is_one_line_with_sbatchs_words(tmp_path) -> None:
    refused = submit(tmp_path / "sweep", "hydra.launcher.partition=gpu",
                     "hydra.launcher.wait=false", *TINY, timeout=120)
    said = refused.stdout + refused.stderr
    assert refused.returncode == 1, said[-3000:]
    assert "slurm refused the submission: invalid partition specified: gpu; Batch job " \
           "submission failed: Invalid partition name specified" in said, said[-3000:]
    # (sbatch's own lines came through before ours: told once, in our line)
    assert "sbatch: error" not in said and "Traceback" not in said
