"""Training on a Ray cluster (`train.engine: ray`): Ray Train's `TorchTrainer` starts `nproc`
workers on the cluster's nodes and joins them in one torch.distributed process group (gloo
on CPU, nccl on GPU), setting RANK, WORLD_SIZE and LOCAL_RANK as torchrun does. Each worker
runs recd's own `train` as one rank of the run, so the parallelism strategy (replicated or
TorchRec-sharded tables), the checkpoints and the saved model are the code a run on one
machine runs; the batches and the model are read from and written to the warehouse, which
every node reaches.

    driver (recd train, recd run, a task, a RayJob's entrypoint)
      ray_train ──TorchTrainer.fit()──> worker 0 ── train(...) as rank 0: the lock, checkpoints,
                                        worker 1 ── train(...) as rank 1       the model, the summary
                                        ...
      <── rank 0's summary (the trainer's return value)

A worker that dies (a node lost, a process killed): Ray restarts the whole group, up to
`train.max_failures` times, and every rank resumes from the run's latest checkpoint in the
warehouse, so the run ends where an uninterrupted one ends. A bad input is refused in one
line (exit 2) without restarts; restarts used up are a retryable failure (exit 1).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

from recd_core.config import FeatureSet, TrainConfig
from recd_core.errors import BadInput, RecdError, first_line
from recd_core.ray_cluster import ray_session
from recd_core.warehouse import Warehouse


class RayTrainFailed(RecdError):
    """The Ray workers failed more often than `train.max_failures` allows (exit 1: a retry
    of the stage resumes from the run's checkpoint)."""


def ray_train(
    train: Callable[..., dict],
    wh_uri: str,
    ds: str,
    cfg: TrainConfig,
    nproc: int,
    init_from: str | None,
    init_label: str | None,
    features: FeatureSet | None,
) -> dict:
    """`train` (modeling/train.py's, passed in: this module does not import it back) of day
    `ds` as `nproc` Ray Train workers on the Ray cluster; rank 0's summary."""
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    config = {
        "train": train,  # pickled by reference: its module is imported where the worker runs
        "warehouse": wh_uri,
        "ds": ds,
        "cfg": cfg.model_dump_json(),
        "init_from": init_from,
        "init_label": init_label,
        "features": features.model_dump_json() if features is not None else None,
    }
    with ray_session(nproc * (cfg.threads or 1), logs=True):
        gpu = cfg.device == "cuda" or (
            cfg.device == "auto" and ray.cluster_resources().get("GPU", 0) >= nproc
        )
        trainer = TorchTrainer(
            worker,
            train_loop_config=config,
            torch_config=TorchConfig(backend="nccl" if gpu else "gloo"),
            scaling_config=ScalingConfig(
                num_workers=nproc, use_gpu=gpu, resources_per_worker={"CPU": cfg.threads or 1}
            ),
            run_config=RunConfig(
                name=f"recd-train-{ds}-{cfg.mode}-{uuid.uuid4().hex[:8]}",
                # Ray's own records of the run (no checkpoints: recd's are the warehouse's)
                storage_path=f"{wh_uri.rstrip('/')}/checkpoints/_ray",
                failure_config=FailureConfig(max_failures=cfg.max_failures),
            ),
        )
        try:
            result = trainer.fit()
        except Exception as e:  # noqa: BLE001 - Ray wraps the workers' errors in its own
            raise RayTrainFailed(
                f"train {ds} on Ray: the workers failed {cfg.max_failures + 1} time(s), the "
                f"last: {first_line(e, 300, type(e).__name__)}"
            ) from None
    summary = result.return_value or {}
    if "refused" in summary:
        raise BadInput(summary["refused"])
    return summary


def worker(config: dict) -> dict:
    """One Ray Train worker: recd's `train` as the rank Ray gave it (a bad input comes back
    as its one line: Ray would restart the workers on an exception, to the same end)."""

    features = config["features"]
    try:
        return config["train"](
            Warehouse(config["warehouse"]),
            config["ds"],
            TrainConfig.model_validate_json(config["cfg"]),
            init_from=config["init_from"],
            init_label=config["init_label"],
            features=FeatureSet.model_validate_json(features) if features else None,
        )
    except BadInput as e:
        return {"refused": str(e)}
