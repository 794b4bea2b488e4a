"""Write components/image-requirements.txt: every dependency of the components image pinned,
as pip resolves them for `.[tracking,server,torchrec,trainer]` with torch 2.13.0 (`make image-lock`).

The image installs this file in a layer of its own before recd's source (components/
Dockerfile), so a build is reproducible and a change to recd_core rebuilds only its layer.
torch (its own layer, pinned) and recd itself (`--no-deps`) are left out.
"""

import json
import subprocess
import sys
import tempfile
from pathlib import Path

OUT = Path(__file__).with_name("image-requirements.txt")
LEFT_OUT = {"recd", "torch"}


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--dry-run",
                "--quiet",
                "--ignore-installed",
                "--report",
                str(report),
                "torch==2.13.0",
                ".[tracking,server,torchrec,trainer]",
            ],
            check=True,
        )
        items = json.loads(report.read_text())["install"]
    pins = sorted(
        (i["metadata"]["name"].lower(), i["metadata"]["version"])
        for i in items
        if i["metadata"]["name"].lower() not in LEFT_OUT
    )
    lines = [f"{name}=={version}" for name, version in pins]
    OUT.write_text(
        "# The components image's dependencies, pinned (`make image-lock` writes this file from\n"
        "# pyproject.toml; torch and recd are installed apart: components/Dockerfile).\n"
        + "\n".join(lines)
        + "\n"
    )
    print(f"{OUT}: {len(lines)} pinned")


if __name__ == "__main__":
    main()
