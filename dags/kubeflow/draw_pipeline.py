"""The compiled pipeline's steps and the artifacts they pass, drawn from its spec: what the
Kubeflow UI's run graph shows, for a reader without a cluster (docs/operations.md).

    python dags/kubeflow/draw_pipeline.py build/kfp/recd_pipeline.yaml docs/images/kfp-lineage.png
"""

import sys

import matplotlib
import yaml

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def draw(spec_path: str, out: str) -> None:
    with open(spec_path) as f:
        spec, _ = yaml.safe_load_all(f.read())
    tasks = spec["root"]["dag"]["tasks"]
    name = {t: v["taskInfo"]["name"] for t, v in tasks.items()}
    deps = {t: set(v.get("dependentTasks", [])) for t, v in tasks.items()}
    passed = [
        (a["taskOutputArtifact"]["producerTask"], t, a["taskOutputArtifact"]["outputArtifactKey"])
        for t, v in tasks.items()
        for a in v.get("inputs", {}).get("artifacts", {}).values()
    ]
    depth: dict[str, int] = {}

    def level(t: str) -> int:
        if t not in depth:
            depth[t] = 1 + max((level(u) for u in deps[t]), default=-1)
        return depth[t]

    layers: dict[int, list[str]] = {}
    # the evaluation day's steps below the training day's
    for t in sorted(tasks, key=lambda t: (name[t].endswith("_eval"), name[t])):
        layers.setdefault(level(t), []).append(t)
    pos = {
        t: (x * 2.2, -(i - (len(ts) - 1) / 2) * 1.3)
        for x, ts in layers.items()
        for i, t in enumerate(ts)
    }
    fig, ax = plt.subplots(figsize=(15, 3.8))

    def arrow(u: str, t: str, **style) -> None:
        (x0, y0), (x1, y1) = pos[u], pos[t]
        ax.annotate("", xy=(x1 - 0.75, y1), xytext=(x0 + 0.75, y0), arrowprops=style)

    for t, ds in deps.items():
        for u in ds - {p for p, c, _ in passed if c == t}:
            arrow(u, t, arrowstyle="->", color="#bbbbbb", linestyle="--")
    for u, t, key in passed:
        arrow(u, t, arrowstyle="-|>", color="#1f6fb2", lw=1.6)
        (x0, y0), (x1, y1) = pos[u], pos[t]
        ax.text((x0 + x1) / 2, (y0 + y1) / 2 + 0.12, key, fontsize=8, color="#1f6fb2", ha="center")
    for t, (x, y) in pos.items():
        ax.text(
            x,
            y,
            name[t],
            ha="center",
            va="center",
            fontsize=9,
            bbox={"boxstyle": "round,pad=0.4", "fc": "#f3f6fa", "ec": "#444444"},
        )
    ax.set_xlim(-1, max(p[0] for p in pos.values()) + 1)
    ax.set_ylim(-1.6, 1.6)
    ax.axis("off")
    ax.set_title(
        f"{spec['pipelineInfo']['name']}: steps and the artifacts they pass "
        "(blue; grey dashed: order only)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    draw(sys.argv[1], sys.argv[2])
    print(f"wrote {sys.argv[2]}")
