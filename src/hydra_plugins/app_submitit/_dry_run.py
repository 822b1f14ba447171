"""`hydra.launcher.dry_run=true`: each array's sbatch script, the arithmetic and every request
the cluster cannot grant; nothing is submitted (`dry_run=json`: the same as one JSON document,
docs/json.md). A real submission is refused where no node could ever run the job: sbatch
accepts it, and it pends forever."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from app import slurm

from . import refuse

# sbatch --signal: "the signal may be sent up to 60 seconds earlier than specified" (Slurm's
# event resolution): a limit of 1 minute and a delay of 30 s requeued jobs as they started.
SIGNAL_EARLY_S = 60


def invalid(params: dict[str, Any], max_num_failures: int) -> list[str]:
    """Values no cluster could mean (checked before any submission, dry run or not)."""
    found = []
    timeout, delay = params.get("timeout_min"), params.get("signal_delay_s") or 0
    if timeout is not None and timeout < 1:
        found.append(f"hydra.launcher.timeout_min={timeout}: give 1 minute or more")
    elif timeout is not None and delay + SIGNAL_EARLY_S >= timeout * 60:
        found.append(f"hydra.launcher.signal_delay_s={delay} is not under timeout_min="
                     f"{timeout} ({timeout * 60} s) by more than the {SIGNAL_EARLY_S} s Slurm "
                     f"may send it early: the time-limit signal would come as the job starts; "
                     f"raise timeout_min or lower signal_delay_s")
    for key, least in (("mem_gb", 0), ("cpus_per_task", 1), ("max_num_timeout", 0),
                       ("signal_delay_s", 0), ("max_num_failures", 0)):
        value = max_num_failures if key == "max_num_failures" else params.get(key)
        if value is not None and value < least:
            found.append(f"hydra.launcher.{key}={value}: give {least} or more")
    return found


def problems(params: dict[str, Any]) -> list[str]:
    partitions, nodes = slurm.partitions(), slurm.nodes()
    if partitions is None or nodes is None:
        return ["Slurm does not answer here (scontrol failed): nothing could be checked"]
    names = requested(params, partitions)
    if not names:
        return ["no partition given (hydra.launcher.partition) and the cluster has no "
                "default one"]
    unknown = [name for name in names if name not in partitions]
    if unknown:
        return [f"hydra.launcher.partition={','.join(names)}: no such partition "
                f"{', '.join(unknown)}; the cluster has {', '.join(sorted(partitions))}"]
    found = [f"partition {name} is {partitions[name]['State']}: jobs would wait"
             for name in names if partitions[name].get("State", "UP") != "UP"]
    return found + never_runs(params, partitions, nodes)


def requested(params: dict[str, Any], partitions: dict[str, dict[str, str]]) -> list[str]:
    """`partition` (a list: Slurm runs the job in the first that can), or the default one."""
    given = params.get("partition") or next(
        (name for name, f in partitions.items() if f.get("Default") == "YES"), "")
    return [name.strip() for name in str(given).split(",") if name.strip()]


def never_runs(params: dict[str, Any], partitions: dict[str, dict[str, str]] | None,
               nodes: dict[str, dict[str, str]] | None) -> list[str]:
    """Why none of the requested partitions could ever run the job; [] when one can, when
    Slurm did not answer, or for a partition the cluster lacks (sbatch refuses that itself)."""
    names = requested(params, partitions) if partitions and nodes is not None else []
    if not names or any(name not in partitions for name in names):
        return []
    found = [_never_runs_on(params, name, partitions, nodes) for name in names]
    return [line for lines in found for line in lines] if all(found) else []


def refuse_never_runs(params: dict[str, Any], num_jobs: int) -> None:
    found, one = never_runs(params, slurm.partitions(), slurm.nodes()), num_jobs == 1
    if found:
        refuse("Slurm would never start %s (%s wait forever): %s. Ask for less or choose "
               "another hydra.launcher.partition; hydra.launcher.dry_run=true checks a request",
               "the job" if one else f"the {num_jobs} jobs", "it would" if one else
               "they would", "; ".join(found))


def _never_runs_on(params: dict[str, Any], name: str, partitions: dict[str, dict[str, str]],
                   nodes: dict[str, dict[str, str]]) -> list[str]:
    found: list[str] = []
    part = partitions[name]
    limit = slurm.minutes(part.get("MaxTime", ""))
    if limit is not None and params["timeout_min"] > limit:
        found.append(f"hydra.launcher.timeout_min={params['timeout_min']}: over partition "
                     f"{name}'s MaxTime of {limit:g} min")
    members = [n for n, f in nodes.items() if name in f.get("Partitions", "").split(",")]
    max_nodes = part.get("MaxNodes", "UNLIMITED")
    if max_nodes.isdigit() and params["nodes"] > int(max_nodes) or \
            params["nodes"] > len(members):
        found.append(f"nodes={params['nodes']}: partition {name} has {len(members)} node(s)"
                     + (f", at most {max_nodes} per job" if max_nodes.isdigit() else ""))
    cpus = (params.get("cpus_per_task") or 1) * params["tasks_per_node"]
    max_cpus = part.get("MaxCPUsPerNode", "UNLIMITED")
    if max_cpus.isdigit() and cpus > int(max_cpus):
        found.append(f"{cpus} CPU(s) per node (hydra.launcher.cpus_per_task="
                     f"{params.get('cpus_per_task') or 1} x {params['tasks_per_node']} "
                     f"task(s)): over partition {name}'s MaxCPUsPerNode of {max_cpus}")
    gpus = params.get("gpus_per_node") or 0
    mem_mb = None if params.get("mem_gb") is None else params["mem_gb"] * 1024
    offered = {}  # each node's CPUs, memory (MB; None for RealMemory=1: not set) and GPUs
    for n in members:
        real = int(nodes[n].get("RealMemory", "1") or 1)
        offered[n] = (int(nodes[n].get("CPUTot", "0") or 0), None if real <= 1 else real,
                      slurm.gpus(nodes[n].get("Gres", "")))
    fitting = [n for n, (c, m, g) in offered.items()
               if c >= cpus and g >= gpus and (mem_mb is None or m is None or m >= mem_mb)]
    # (fewer nodes than asked, all of which fit: the node count alone, said above)
    if len(fitting) < min(params["nodes"], len(members)):
        most = max(members, key=lambda n: offered[n][0])
        have = (f" (node {most}: {offered[most][0]} CPUs, "
                f"{int(nodes[most].get('RealMemory', '0')) / 1024:g} GB, "
                f"{offered[most][2]} GPUs)")
        found.append(f"a node must offer {cpus} CPU(s), "
                     f"{'' if mem_mb is None else f'{mem_mb / 1024:g} GB, '}{gpus} GPU(s): "
                     f"{len(fitting)} of partition {name}'s nodes do, {params['nodes']} "
                     f"needed{have}{'' if fitting else _over(params, list(offered.values()))}")
    return found


def _over(params: dict[str, Any], offered: list[tuple[int, int | None, int]]) -> str:
    tasks, per_task = params["tasks_per_node"], params.get("cpus_per_task") or 1
    over = []
    if per_task * tasks > max(o[0] for o in offered):
        over.append(f"hydra.launcher.cpus_per_task={per_task}"
                    + (f" x {tasks} tasks per node (devices={tasks})" if tasks > 1 else ""))
    memory = [o[1] for o in offered if o[1] is not None]
    if params.get("mem_gb") and memory and params["mem_gb"] * 1024 > max(memory):
        over.append(f"hydra.launcher.mem_gb={params['mem_gb']}")
    if (params.get("gpus_per_node") or 0) > max(o[2] for o in offered):
        over.append(f"{params['gpus_per_node']} GPU(s) per node (devices with "
                    f"accelerator=cuda, or hydra.launcher.gpus_per_node)")
    return f"; over every node: {', '.join(over)}" if over else \
        "; no node offers all of it at once"


def arrays(nums: list[int], params: dict[str, Any], on_slurm: bool
           ) -> tuple[list[list[int]], bool, int | None]:
    """The arrays to submit (an array's task ids must stay below MaxArraySize), whether each
    waits for the one before it (when they hold more jobs than array_parallelism, so that it
    caps the whole sweep), and MaxArraySize."""
    limit = slurm.max_array_size() if on_slurm else None
    size, cap = max(1, limit or len(nums)), params.get("array_parallelism")
    parts = [nums[start:start + size] for start in range(0, len(nums), size)]
    return parts, len(parts) > 1 and cap is not None and len(nums) > cap, limit


def after(executor: Any, params: dict[str, Any], previous: str | None) -> None:
    """The next array waits for array `previous` (None: for nothing)."""
    extra = dict(params.get("additional_parameters") or {})
    executor.update_parameters(slurm_additional_parameters={
        **extra, **({"dependency": f"afterany:{previous}"} if previous else {})})


def plan(executor: Any, params: dict[str, Any], max_num_failures: int,
         overrides: dict[int, list[str]], run_dirs: dict[int, Path], on_slurm: bool,
         batch: int | None = None) -> dict[str, Any]:
    """What the dry run says (the text and hydra.launcher.dry_run=json alike): docs/json.md.
    `batch`: the sweeper's max_batch_size."""
    from hydra.core.utils import filter_overrides

    from app._private import sbatch_script
    from app.sweeps.dirs import conflicts

    nums = sorted(overrides)
    parts, chain, limit = arrays(nums, params, on_slurm)
    scripts = []
    for i, part in enumerate(parts):
        if chain and i > 0:  # (the job id is Slurm's answer to the submission before)
            after(executor, params, f"JOB_ID_OF_JOBS_{parts[i - 1][0]}-{parts[i - 1][-1]}")
        scripts.append({"jobs": part, "sbatch_script": sbatch_script(executor, len(part))})
    nodes, tasks, per_task = params["nodes"], params["tasks_per_node"], params.get(
        "cpus_per_task") or 1
    problems_found = invalid(params, max_num_failures) + (problems(params) if on_slurm else [])
    return {
        "arrays": scripts,
        "jobs": [{"job": num, "overrides": filter_overrides(overrides[num]),
                  "run_dir": str(run_dirs[num])} for num in nums],
        "nodes": nodes, "tasks_per_node": tasks, "ranks": nodes * tasks,
        "gpus_per_node": params.get("gpus_per_node") or 0, "cpus_per_task": per_task,
        "cpus_per_node": per_task * tasks, "mem_gb": params.get("mem_gb"),
        "timeout_min": params["timeout_min"],
        "max_num_timeout": params.get("max_num_timeout", 0),
        "max_num_failures": max_num_failures,
        "array_parallelism": params.get("array_parallelism", len(nums)),
        "max_array_size": limit,
        "problems": problems_found + conflicts(overrides, run_dirs),
        "first_batch_of": batch if batch and len(nums) >= batch else None,
    }


def report(executor: Any, params: dict[str, Any], max_num_failures: int,
           overrides: dict[int, list[str]], run_dirs: dict[int, Path], on_slurm: bool,
           batch: int | None = None, as_json: bool = False) -> int:
    """Print it all (`as_json`: as one JSON document); the exit status (2: a problem)."""
    found = plan(executor, params, max_num_failures, overrides, run_dirs, on_slurm, batch)
    if as_json:
        from app.reporting.results import emit

        emit(found)
        return 2 if found["problems"] else 0
    for part in found["arrays"]:
        jobs = part["jobs"]
        print(f"# sbatch script of jobs #{jobs[0]}-#{jobs[-1]} ({len(jobs)} job(s))"
              if len(jobs) > 1 else f"# sbatch script of job #{jobs[0]}")
        print(part["sbatch_script"])
    for job in found["jobs"]:
        print(f"job #{job['job']}: {' '.join(job['overrides']) or '(no overrides)'}"
              f" -> {job['run_dir']}")
    mem = found["mem_gb"]  # (Slurm reads --mem=0 as all of a node's memory)
    memory = "the partition default" if mem is None else "all of a node" if mem == 0 else \
        f"{mem} GB"
    sizes = ", ".join(f"{n} of {size}" for size, n in sorted(
        Counter(len(part["jobs"]) for part in found["arrays"]).items(), reverse=True))
    print(f"each job: {found['nodes']} node(s) x {found['tasks_per_node']} task(s) = "
          f"{found['ranks']} rank(s); per node {found['gpus_per_node']} GPU(s), "
          f"{found['cpus_per_node']} CPU(s) ({found['cpus_per_task']} per task), {memory} of "
          f"memory\ntime limit {found['timeout_min']} min per run; requeued up to "
          f"{found['max_num_timeout']} time(s) at the limit and up to "
          f"{found['max_num_failures']} time(s) after a fault (it resumes)\n"
          f"{len(found['jobs'])} job(s) in {len(found['arrays'])} submission(s) ({sizes} "
          f"job(s)), at most {found['array_parallelism']} running at once")
    limit = found["max_array_size"]
    if limit:
        print(f"the cluster's MaxArraySize is {limit}: an array holds at most {limit} jobs")
    for problem in found["problems"]:
        print(f"problem: {problem}")
    print(f"dry run: nothing was submitted; {len(found['problems'])} problem(s) found")
    if found["first_batch_of"]:
        print(f"(the sweeper gives the launcher {found['first_batch_of']} job(s) at a time, "
              f"hydra.sweeper.max_batch_size: this dry run is of the first batch)")
    return 2 if found["problems"] else 0
