"""The config's typed schemas and the checks Hydra's types cannot express.

docs/configuration.md says where a key goes. A closed set of values is an Enum, so that a
wrong value fails while Hydra composes; a key that moved is in RENAMED. The schemas sit first
in `conf/config.yaml`'s defaults list, so a misspelt key or a wrong type fails at compose
time; a number's range is declared with its field (`_bound(20, ge=1)`) and checked by
`validate`.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import math
import operator
import re
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf, open_dict, read_write
from omegaconf.errors import OmegaConfBaseException

from app.checks import seed_value
from app.errors import UserError, first_line


class _Choice(StrEnum):
    """A closed set of strings, members named by their values ("bf16-mixed" is no identifier:
    hence `_choice`). A member compares and hashes as its string."""

    @classmethod
    def _missing_(cls, value: object) -> _Choice | None:
        return cls.__members__.get(str(value))  # `precision=32` arrives as the int 32


def _choice(name: str, *values: str) -> Any:
    return _Choice(name, [(v, v) for v in values], module=__name__, qualname=name)


Mode = _choice("Mode", "trainval", "eval", "predict", "export")
MonitorMode = _choice("MonitorMode", "max", "min")
Precision = _choice("Precision", "32", "bf16-mixed", "16-mixed", "bf16-true")
Accelerator = _choice("Accelerator", "auto", "cuda", "cpu", "mps", "npu", "xpu", "hpu")
StartMethod = _choice("StartMethod", "spawn", "forkserver", "fork")
# torch.distributed's backends; auto picks the device type's own (app.launch.plan.BACKENDS).
Backend = _choice("Backend", "auto", "nccl", "gloo", "mpi", "ucc", "hccl", "xccl")
# How the model is laid over the ranks (app.training.sharding).
Strategy = _choice("Strategy", "ddp", "fsdp")
# What the loop validates and logs (val/loss, val/acc): the metrics a run can monitor.
Monitor = _choice("Monitor", "val/acc", "val/loss")
WandbMode = _choice("WandbMode", "online", "offline", "disabled")


def _bound(default: Any, **bounds: float) -> Any:
    """A field that `validate` keeps within `bounds` (ge, gt, lt, le: pydantic's names);
    OmegaConf leaves a field's metadata out of the config."""
    return field(default=default, metadata={"bounds": bounds})


@dataclass
class TrainerConfig:
    mode: Mode = Mode("trainval")
    max_epochs: int | None = _bound(20, ge=1)
    max_steps: int | None = _bound(None, ge=1)
    val_every_n_epochs: int | None = _bound(1, ge=1)
    val_every_n_steps: int | None = _bound(None, ge=1)
    log_every_n_steps: int = _bound(10, ge=1)
    ckpt_every_n_epochs: int | None = _bound(1, ge=1)
    ckpt_every_n_steps: int | None = _bound(None, ge=1)
    keep_last: int = _bound(3, ge=0)
    async_checkpoint: bool = True
    monitor: Monitor = Monitor("val/acc")
    monitor_mode: MonitorMode = MonitorMode("max")
    progress_bar: bool | None = None
    accumulate_grad_batches: int = _bound(1, ge=1)
    grad_clip_norm: float | None = _bound(None, gt=0)
    skip_nonfinite: bool = False
    replay_nonfinite: bool = False
    ema: bool = False
    ema_decay: float = _bound(0.9998, gt=0, lt=1)
    ema_warmup_steps: int = _bound(2000, ge=1)
    decay_norm_and_bias: bool = False
    lr_scale_batch: int | None = _bound(None, ge=1)
    activation_checkpointing: list[str] = field(default_factory=list)  # module classes
    telemetry: bool = False
    peak_flops: float | None = _bound(None, gt=0)


@dataclass
class PredictConfig:
    """Read by `trainer=predict` only."""

    input: str | None = None
    num_show: int = _bound(32, ge=1)


@dataclass
class ExportConfig:
    """Read by `trainer=export` only."""

    tolerance: float = _bound(1e-5, gt=0)


@dataclass
class FSDPConfig:
    """Read with `distributed.strategy=fsdp` only."""

    wrap: list[str] = field(default_factory=list)  # module classes sharded as units
    reshard_after_forward: bool = True  # free a unit's gathered parameters after its forward


@dataclass
class DistributedConfig:
    strategy: Strategy = Strategy("ddp")
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    backend: Backend = Backend("auto")
    # Seconds: finite (nan never elapses), and at most 1e9 (31 years): gloo counts it in
    # 64-bit microseconds, timedelta stops at 8.6e13 s (1e300 was an OverflowError in a rank).
    timeout_s: float = _bound(1800.0, gt=0, lt=math.inf, le=10**9)
    stall_timeout_s: float | None = _bound(600.0, gt=0, lt=math.inf)  # null: no watchdog
    start_method: StartMethod = StartMethod("forkserver")
    set_device_rank: bool = True
    kill_grace_s: float = _bound(5.0, gt=0, lt=math.inf)
    max_restarts: int = _bound(0, ge=0)
    horovod: bool = False
    sync_batchnorm: bool = False
    find_unused_parameters: bool = False
    static_graph: bool = False
    broadcast_buffers: bool = True
    bucket_cap_mb: float = 25.0
    omp_threads: int | None = None
    nccl_env: dict[str, str] = field(default_factory=dict)


@dataclass
class LoggerConfig:
    tensorboard: bool = False
    mlflow: bool = False
    mlflow_uri: str | None = None  # null: sqlite:///<the runs' folder>/mlflow.db
    mlflow_experiment: str = "app"
    wandb: bool = False
    wandb_project: str = "app"
    wandb_mode: WandbMode | None = None  # null: W&B's own (WANDB_MODE)


@dataclass
class LoaderConfig:
    """The loader keys every `data` node has: composed first (`app_data_loader`), the data set's
    own YAML over them, so a data config states only what differs."""

    batch_size: int = _bound(64, ge=1)  # samples per optimizer step and process
    val_batch_size: int | None = _bound(None, ge=1)  # per validation batch (null: batch_size)
    num_workers: int = _bound(0, ge=0)  # loader worker processes (0: load in this process)
    pin_memory: bool = True  # page-locked batches for faster copies to a GPU (ignored on CPU)
    persistent_workers: bool = True  # keep loader workers alive across epochs
    cache: bool = False  # the decoded data set in shared memory, mapped by every loader worker


@dataclass
class AppConfig:
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    predict: PredictConfig = field(default_factory=PredictConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    model: dict[str, Any] | None = None
    data: dict[str, Any] | None = None
    optimizer: dict[str, Any] | None = None
    scheduler: dict[str, Any] | None = None
    callbacks: dict[str, Any] = field(default_factory=dict)  # name -> `_target_` node (or null)
    accelerator: Accelerator = Accelerator("auto")
    device_id: int | None = _bound(None, ge=0)
    accelerator_strict: bool = False
    devices: Any = 1  # an int, or "auto"
    nodes: int = _bound(1, ge=1)
    machine_rank: int = 0
    dist_url: str = "auto"
    seed: int = 0
    run: str | None = None
    ckpt: str | None = None
    ckpt_strict: bool = True
    resume: str | None = "auto"
    precision: Precision = Precision("32")
    compile: bool = False
    deterministic: bool = False
    tf32: bool | None = None
    occupy: float = _bound(0.0, ge=0, lt=1)  # a fraction of the free GPU memory
    detail: bool = False


# Keys that moved (old -> new), for the one-line error an old command line gets.
RENAMED = {
    "ema": "trainer.ema",
    "trainer.input": "predict.input",
    "trainer.num_show": "predict.num_show",
    "trainer.export_tolerance": "export.tolerance",
}


def renamed(key: str, value: str | None = None) -> str | None:
    """`OLD was renamed to NEW` when `key` (as typed, maybe with `+`) is a key that moved."""
    new = RENAMED.get(key.lstrip("+~"))
    if new is None:
        return None
    if value in ("True", "False"):  # (a sweep's job: Hydra's sweeper writes a bool so)
        value = value.lower()
    return f"{key.lstrip('+~')} was renamed to {new}" + (
        f": write {new}={value}" if value is not None else "")


def to_app_config(composed: Any) -> AppConfig:
    """The typed, resolved and validated config of a composed job (its `hydra` node dropped)."""
    if "hydra" in composed:
        composed = composed.copy()
        with read_write(composed), open_dict(composed):
            del composed["hydra"]
    unknown = _unknown_keys(composed)
    if unknown:
        raise UserError(unknown[0])
    try:
        cfg = OmegaConf.to_object(composed)
    except OmegaConfBaseException as e:  # a bad interpolation such as seed=${oops}
        key = getattr(e, "full_key", None)
        raise UserError(f"{key}: {first_line(e)}" if key else first_line(e)) from None
    validate(cfg)
    return cfg


def _unknown_keys(node: DictConfig, path: str = "") -> list[str]:
    """Keys a `+key=value` override added to a typed section: the schema has no such field, so
    without this check the value would be ignored without a word."""
    schema = OmegaConf.get_type(node)
    if not dataclasses.is_dataclass(schema):
        return []  # model, data, optimizer, scheduler: free-form `_target_` nodes
    names = [f.name for f in dataclasses.fields(schema)]
    found = []
    for key, child in node.items_ex(resolve=False):  # (unresolved: ${hydra:...} outside a run)
        full = f"{path}{key}"
        if key not in names and (moved := renamed(full)):
            found.append(moved)
        elif key not in names:
            near = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean {path}{near[0]}?)" if near else ""
            found.append(f"{full}: not a key of the config{hint}; "
                         f"`python -m app --cfg job` prints every key")
        elif isinstance(child, DictConfig):
            found += _unknown_keys(child, f"{full}.")
    return found


def register_schemas() -> None:
    store = ConfigStore.instance()
    store.store(name="app_schema", node=AppConfig)
    # Plain values, not a typed node: the data set's YAML adds its own keys to this node
    # (their types are checked in `validate`, the rest by the data set's constructor).
    store.store(name="app_data_loader", node=dataclasses.asdict(LoaderConfig()),
                package="data")


_COMPARE = {"ge": (operator.ge, ">="), "gt": (operator.gt, ">"), "lt": (operator.lt, "<"),
            "le": (operator.le, "<=")}


def _check_fields(node: Any, schema: type, path: str = "") -> None:
    """The fields of `node` within their `_bound`s (`< inf`: finite; nan fails every
    comparison), and of their types in the data node, whose plain values OmegaConf leaves."""
    for f in dataclasses.fields(schema):
        key = path + f.name
        value = node.get(f.name) if isinstance(node, dict) else getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            _check_fields(value, type(value), f"{key}.")
        elif f.type == "bool" and not isinstance(value, bool):
            raise UserError(f"{key}={value}: expected true or false")
        elif (bounds := f.metadata.get("bounds")) and not (value is None and "None" in f.type):
            whole = f.type.startswith("int")
            typed = not whole or isinstance(value, int) and not isinstance(value, bool)
            if not typed or not all(_COMPARE[op][0](value, n) for op, n in bounds.items()):
                kind = ("a whole number" if whole else "a finite number"
                        if math.inf in bounds.values() else "a number")
                limits = [f"{_COMPARE[op][1]} {n}" for op, n in bounds.items() if n != math.inf]
                raise UserError(f"{key}={value}: expected {'null or ' if 'None' in f.type else ''}"
                                f"{kind} {' and '.join(limits)}")


def validate(cfg: AppConfig) -> None:
    """The declared bounds, and checks across keys that types alone cannot catch; raises
    UserError."""
    t = cfg.trainer
    if t.mode == Mode.trainval and t.max_epochs is None and t.max_steps is None:
        raise UserError("trainer.max_epochs and trainer.max_steps are both null: set one of them "
                        "(for example trainer.max_epochs=10)")
    _check_fields(cfg, AppConfig)
    if t.mode != Mode.trainval and cfg.ckpt is None:
        raise UserError(f"trainer={t.mode.value} needs a checkpoint: add ckpt=PATH/TO/best.pt")
    if cfg.devices != "auto" and (not isinstance(cfg.devices, int) or cfg.devices < 1):
        raise UserError(f"devices={cfg.devices}: expected a positive number or auto")
    if not 0 <= cfg.machine_rank < cfg.nodes:
        raise UserError(f"machine_rank={cfg.machine_rank}: must lie in [0, nodes={cfg.nodes})")
    if cfg.dist_url != "auto":
        match = re.fullmatch(r"tcp://([^:/\s]+):(\d{1,5})", cfg.dist_url)
        if not match:
            raise UserError(f"dist_url={cfg.dist_url}: expected auto or tcp://HOST:PORT")
        if not 1 <= int(match[2]) <= 65535:
            raise UserError(f"dist_url={cfg.dist_url}: port {int(match[2])} is out of range; "
                            f"give a port from 1 to 65535, e.g. tcp://{match[1]}:29500")
    seed_value("seed", cfg.seed)
    for extra, name, package in (("mlflow", "MLflow", "mlflow-skinny"),  # (optional extras)
                                 ("wandb", "Weights & Biases", "wandb")):
        if getattr(cfg.logger, extra) and importlib.util.find_spec(extra) is None:
            raise UserError(f"logger.{extra}=true needs {name}: pip install {package} "
                            f"(or pip install -e '.[{extra}]')")
    for group in ("model", "data", "optimizer"):
        node = getattr(cfg, group)
        if not isinstance(node, dict) or "_target_" not in node:
            raise UserError(f"{group}: needs a `_target_` node; pick one with {group}=NAME")
    _check_fields(cfg.data, LoaderConfig, "data.")
    for key in ("lr", "weight_decay", "momentum"):
        value = cfg.optimizer.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise UserError(f"optimizer.{key}={value!r}: expected a number")
        if isinstance(value, int | float) and value < 0:
            raise UserError(f"optimizer.{key}={value}: must not be negative")
    if cfg.optimizer.get("lr") == 0:
        raise UserError("optimizer.lr=0: the model would never change; give a positive rate")
