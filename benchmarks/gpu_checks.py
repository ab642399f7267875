"""Every GPU check in one call: the CUDA test tier, then the CLI's tokens/s on one GPU.

    python benchmarks/gpu_checks.py
"""

import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 0
    print(f"device: {torch.cuda.get_device_name()}")
    rc = subprocess.call([sys.executable, "-m", "pytest", "-q", str(ROOT / "tests" / "gpu")], cwd=ROOT)
    rayzero = Path(sys.executable).with_name("rayzero")
    rc |= subprocess.call([str(rayzero), "train", "cluster.num_workers=1", "cluster.use_gpu=true",
                           "model.preset=small", "train.steps=50", "train.global_batch_size=32",
                           "train.micro_batch_size=8", "train.seq_len=256", "tracking.enabled=false",
                           "--no-progress"], cwd=ROOT)
    return rc


if __name__ == "__main__":
    sys.exit(main())
