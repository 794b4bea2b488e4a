"""The CUDA path, measured: one day of daily training per mode on a GPU, side by side.

    python -m recd_core.bench.cuda --warehouse build/bench/warehouse --ds 2026-11-01

needs the day's clustered samples (`make bench` leaves the standard day there). It runs DPP
in both modes, the bench's interleaved step timing (`bench_train`) on `cuda`, and the daily
training of each mode in fp32 and with bf16 autocast; it prints one JSON line per
measurement and a table at the end. docs/benchmarks.md ("On a GPU") holds a run's figures.
"""

from __future__ import annotations

import argparse
import json
import time

from recd_core.config_files import load_pipeline_config
from recd_core.report import print_summary
from recd_core.warehouse import Warehouse


def main(argv: list[str] | None = None) -> None:
    import torch

    from recd_core.bench.training import bench_train
    from recd_core.dpp.preprocess import preprocess
    from recd_core.modeling.train import train

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--warehouse", required=True)
    p.add_argument("--ds", required=True)
    p.add_argument("--config", default=None, help="pipeline config YAML (default: built-in)")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("recd_core.bench.cuda: no CUDA device")
    wh, pipe = Warehouse(a.warehouse), load_pipeline_config(a.config)
    out: dict = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}

    def show(line: dict) -> None:
        print(json.dumps(line, default=str), flush=True)

    for mode in ("dedup", "baseline"):
        s = preprocess(wh, a.ds, pipe.preprocess.model_copy(update={"mode": mode}))
        show({"dpp": mode, "samples_per_s": s["dpp.samples_per_s"]})
    table = wh.read("samples", a.ds, layout="clustered")
    cfg = pipe.train.model_copy(update={"batch_size": pipe.preprocess.batch_size})
    steps = bench_train(table, cfg, repeats=15, device="cuda")
    show(steps)
    out |= {
        k: steps[k]
        for k in ("train.step_ms.dedup", "train.step_ms.baseline", "bench.train_speedup")
    }
    for amp in (False, True):
        for mode in ("dedup", "baseline"):
            run = pipe.train.model_copy(update={"mode": mode, "device": "cuda", "amp": amp})
            t0 = time.perf_counter()
            s = train(wh, a.ds, run)
            tag = f"{mode}{'.bf16' if amp else ''}"
            out[f"day.seconds.{tag}"] = time.perf_counter() - t0
            out[f"day.samples_per_s.{tag}"] = s["train.samples_per_s"]
            out[f"day.val_ne.{tag}"] = s["train.val_ne"]
            show({"train": tag, **{k: v for k, v in s.items() if not isinstance(v, dict | list)}})
    out["day.speedup"] = out["day.samples_per_s.dedup"] / out["day.samples_per_s.baseline"]
    print_summary("recd bench (cuda)", out)


if __name__ == "__main__":
    main()
