"""NE and AUC by torchrec.metrics, each rank scoring its slice: a cross-check of recd's own
validation on a sharded run."""

from __future__ import annotations

import torch
import torch.distributed as dist


def torchrec_validation(model, valid, device: torch.device) -> dict[str, float]:
    """NE and AUC of the current weights on the validation batches by `torchrec.metrics`,
    each rank scoring its slice of every batch and the metrics gathered over the ranks onto
    rank 0 (a check beside recd's own, which every rank computes on whole batches; {} on
    the other ranks). A collective."""
    from torchrec.metrics.auc import AUCMetric
    from torchrec.metrics.metrics_config import RecComputeMode, RecTaskInfo
    from torchrec.metrics.ne import NEMetric

    rank, world = dist.get_rank(), dist.get_world_size()
    task = RecTaskInfo(name="click", label_name="label", prediction_name="p", weight_name="w")
    samples = max(valid.samples(), 1)  # the AUC's window: all of them
    metrics = [
        m(
            world_size=world,
            my_rank=rank,
            batch_size=1,
            tasks=[task],
            compute_mode=RecComputeMode.UNFUSED_TASKS_COMPUTATION,
            window_size=samples,
        )
        for m in (NEMetric, AUCMetric)
    ]
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for k in range(len(valid)):
            batch = valid[k].part(rank, world).to(device)
            probs = torch.sigmoid(model(batch)).float().cpu()
            labels = batch.labels.float().cpu()
            for m in metrics:
                m.update(
                    predictions={"click": probs},
                    labels={"click": labels},
                    weights={"click": torch.ones_like(labels)},
                )
    model.train(was_training)
    out = {}
    for m in metrics:  # gathered onto rank 0; the others get nothing back
        out |= {k: float(v) for k, v in m.compute().items()}
    if not out:
        return {}
    return {
        "train.val_ne_torchrec": out["ne-click|lifetime_ne"],
        "train.val_auc_torchrec": out["auc-click|window_auc"],
    }
