"""What a GPU sandbox's suspend costs in the guest, by the GPU memory its processes hold: a
CUDA process holding N GiB of device memory (a pattern written by a kernel) checkpointed and
restored in place with NVIDIA's ``cuda-checkpoint``, as ``gpu_quiesce.py`` does it (lock,
checkpoint; restore, unlock), each step timed, the process's host memory (RSS) read before and
while checkpointed, and the pattern checked on the GPU after the restore.

Runs on a machine with an NVIDIA GPU, its driver (550 or later), ``cuda-checkpoint`` and
``nvcc``, as root (a GPU guest, not a vmsandbox host; not part of ``run_all.py``):

    python3 bench/gpu_checkpoint.py [--sizes 0.25,1,4,16] [--json FILE]

Read-only towards the GPU's settings: it resets nothing and changes no clock or mode; the
only GPU work is its own process's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HOLDER_CU = r"""
#include <cstdio>
#include <cstdlib>
__global__ void fill(unsigned long long *p, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    p[i] = i * 0x9E3779B97F4A7C15ull;
}
__global__ void check(const unsigned long long *p, size_t n, unsigned long long *bad) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    if (p[i] != i * 0x9E3779B97F4A7C15ull) atomicAdd(bad, 1ull);
}
int main(int argc, char **argv) {
  size_t n = strtoull(argv[1], 0, 10) / 8;
  unsigned long long *p, *bad, h = 0;
  if (cudaMalloc(&p, n * 8) != cudaSuccess || cudaMalloc(&bad, 8) != cudaSuccess) {
    printf("ERR cudaMalloc\n");
    return 1;
  }
  fill<<<1024, 256>>>(p, n);
  cudaDeviceSynchronize();
  printf("READY\n");
  fflush(stdout);
  char line[64];
  while (fgets(line, sizeof line, stdin)) {
    cudaMemset(bad, 0, 8);
    check<<<1024, 256>>>(p, n, bad);
    cudaError_t e = cudaMemcpy(&h, bad, 8, cudaMemcpyDeviceToHost);
    printf("%s %llu\n", e == cudaSuccess ? "CHECKED" : cudaGetErrorString(e), h);
    fflush(stdout);
  }
}
"""
GIB = 1 << 30
HEADER_END = "checkpointed RSS MiB  intact"


def build(folder: Path) -> Path:
    source, program = folder / "holder.cu", folder / "holder"
    source.write_text(HOLDER_CU)
    subprocess.run(["nvcc", "-O2", "-o", str(program), str(source)], check=True)
    return program


def rss_mib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) // 1024
    return 0


def step(pid: int, action: str) -> float:
    began = time.monotonic()
    done = subprocess.run(
        ["cuda-checkpoint", "--action", action, "--pid", str(pid)], capture_output=True, text=True
    )
    if done.returncode:
        raise RuntimeError(f"cuda-checkpoint {action}: {(done.stderr or done.stdout).strip()}")
    return round(time.monotonic() - began, 3)


def checked(holder: subprocess.Popen[str]) -> str:
    assert holder.stdin is not None and holder.stdout is not None
    holder.stdin.write("check\n")
    holder.stdin.flush()
    return holder.stdout.readline().strip()


def one(program: Path, size_gib: float) -> dict[str, Any]:
    holder = subprocess.Popen(
        [str(program), str(int(size_gib * GIB))],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None
        if holder.stdout.readline().strip() != "READY":
            raise RuntimeError(f"the holder of {size_gib} GiB did not start")
        before = checked(holder)
        found: dict[str, Any] = {"size_gib": size_gib, "rss_mib": rss_mib(holder.pid)}
        found["lock_s"] = step(holder.pid, "lock")
        found["checkpoint_s"] = step(holder.pid, "checkpoint")
        found["rss_checkpointed_mib"] = rss_mib(holder.pid)
        found["restore_s"] = step(holder.pid, "restore")
        found["unlock_s"] = step(holder.pid, "unlock")
        after = checked(holder)
        found["intact"] = before == after == "CHECKED 0"
        return found
    finally:
        holder.kill()
        holder.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="0.25,1,4,16", help="GiB held, comma-separated")
    parser.add_argument("--json", type=Path, help="write the figures here too")
    args = parser.parse_args(argv)
    sizes = [float(size) for size in args.sizes.split(",")]
    with tempfile.TemporaryDirectory() as folder:
        program = build(Path(folder))
        rows = []
        for size in sizes:
            rows.append(one(program, size))
            print(json.dumps(rows[-1]), flush=True)
    print(
        "GiB held  lock s  checkpoint s  restore s  unlock s  RSS MiB  checkpointed RSS MiB  intact"
    )
    for row in rows:
        print(
            f"{row['size_gib']:>8}  {row['lock_s']:>6}  {row['checkpoint_s']:>12}  "
            f"{row['restore_s']:>9}  {row['unlock_s']:>8}  {row['rss_mib']:>7}  "
            f"{row['rss_checkpointed_mib']:>20}  {row['intact']}"
        )
    if args.json:
        gpu = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
        ).stdout.strip()
        report = {"gpu": gpu, "kernel": os.uname().release, "rows": rows}
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if all(row["intact"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
