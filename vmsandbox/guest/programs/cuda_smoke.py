#!/usr/bin/env python3
"""CUDA compute smoke test, run inside a guest with nothing but the NVIDIA driver installed.

Shipped to the guest by ``vmsandbox.guest.verify`` and fed to ``python3 -`` on stdin. It talks to
the CUDA driver API in ``libcuda.so.1`` through ctypes (no toolkit, no numpy): on every device it
creates a context, JIT-loads a hand-written PTX vector add, runs it on 4096 floats and checks the
result. One line per device on stdout::

    PASS <pci bus id> <device name>
    FAIL <pci bus id> <reason>

and ``FAIL - <reason>`` when the driver itself cannot be used. Exit status 0 only when at least one
device exists and every device passed. Standard library only.
"""

from __future__ import annotations

import ctypes
import sys

N = 4096
BLOCK = 256

# c[i] = a[i] + b[i] for i < n. PTX ISA 6.0 for sm_50: every driver since CUDA 9 JIT-compiles it
# for its own GPU, Hopper included.
PTX = b"""\
.version 6.0
.target sm_50
.address_size 64

.visible .entry vadd(
    .param .u64 vadd_a,
    .param .u64 vadd_b,
    .param .u64 vadd_c,
    .param .u32 vadd_n
)
{
    .reg .pred %p<2>;
    .reg .b32 %r<6>;
    .reg .f32 %f<4>;
    .reg .b64 %rd<11>;

    ld.param.u64 %rd1, [vadd_a];
    ld.param.u64 %rd2, [vadd_b];
    ld.param.u64 %rd3, [vadd_c];
    ld.param.u32 %r1, [vadd_n];
    mov.u32 %r2, %ctaid.x;
    mov.u32 %r3, %ntid.x;
    mov.u32 %r4, %tid.x;
    mad.lo.s32 %r5, %r2, %r3, %r4;
    setp.ge.u32 %p1, %r5, %r1;
    @%p1 bra DONE;
    cvta.to.global.u64 %rd4, %rd1;
    cvta.to.global.u64 %rd5, %rd2;
    cvta.to.global.u64 %rd6, %rd3;
    mul.wide.u32 %rd7, %r5, 4;
    add.s64 %rd8, %rd4, %rd7;
    add.s64 %rd9, %rd5, %rd7;
    add.s64 %rd10, %rd6, %rd7;
    ld.global.f32 %f1, [%rd8];
    ld.global.f32 %f2, [%rd9];
    add.f32 %f3, %f1, %f2;
    st.global.f32 [%rd10], %f3;
DONE:
    ret;
}
"""

c_int, c_uint, c_size_t, c_void_p = ctypes.c_int, ctypes.c_uint, ctypes.c_size_t, ctypes.c_void_p
c_char_p, c_uint64, POINTER = ctypes.c_char_p, ctypes.c_uint64, ctypes.POINTER

# The driver API functions used, with their argument types (the _v2 names are what cuda.h maps
# the plain names to on 64-bit hosts).
SIGNATURES = {
    "cuInit": [c_uint],
    "cuDeviceGetCount": [POINTER(c_int)],
    "cuDeviceGet": [POINTER(c_int), c_int],
    "cuDeviceGetName": [c_char_p, c_int, c_int],
    "cuDeviceGetPCIBusId": [c_char_p, c_int, c_int],
    "cuCtxCreate_v2": [POINTER(c_void_p), c_uint, c_int],
    "cuCtxDestroy_v2": [c_void_p],
    "cuModuleLoadData": [POINTER(c_void_p), c_void_p],
    "cuModuleUnload": [c_void_p],
    "cuModuleGetFunction": [POINTER(c_void_p), c_void_p, c_char_p],
    "cuMemAlloc_v2": [POINTER(c_uint64), c_size_t],
    "cuMemFree_v2": [c_uint64],
    "cuMemcpyHtoD_v2": [c_uint64, c_void_p, c_size_t],
    "cuMemcpyDtoH_v2": [c_void_p, c_uint64, c_size_t],
    "cuLaunchKernel": [c_void_p] + [c_uint] * 7 + [c_void_p, POINTER(c_void_p), POINTER(c_void_p)],
    "cuCtxSynchronize": [],
    "cuGetErrorName": [c_int, POINTER(c_char_p)],
}


class CudaError(Exception):
    """A driver API call returned something other than CUDA_SUCCESS."""


class Driver:
    """The few driver API calls the test needs; each raises CudaError on failure."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        for name, argtypes in SIGNATURES.items():
            function = getattr(lib, name)
            function.argtypes = argtypes
            function.restype = c_int

    def __call__(self, name: str, *args: object) -> None:
        status = getattr(self.lib, name)(*args)
        if status != 0:
            raise CudaError(f"{name}: {self.error_name(status)} ({status})")

    def error_name(self, status: int) -> str:
        text = c_char_p()
        if self.lib.cuGetErrorName(status, ctypes.byref(text)) == 0 and text.value:
            return text.value.decode()
        return "unknown error"


def bus_id(cuda: Driver, device: int) -> str:
    buffer = ctypes.create_string_buffer(32)
    cuda("cuDeviceGetPCIBusId", buffer, len(buffer), device)
    return buffer.value.decode()


def device_name(cuda: Driver, device: int) -> str:
    buffer = ctypes.create_string_buffer(256)
    cuda("cuDeviceGetName", buffer, len(buffer), device)
    return buffer.value.decode(errors="replace")


def vector_add(cuda: Driver, device: int) -> None:
    """Run the PTX vector add on ``device``; raise CudaError or ValueError when it fails."""
    context, module, function = c_void_p(), c_void_p(), c_void_p()
    buffers = [c_uint64() for _ in range(3)]
    size = N * ctypes.sizeof(ctypes.c_float)
    host_a = (ctypes.c_float * N)(*range(N))
    host_b = (ctypes.c_float * N)(*(2 * i for i in range(N)))
    host_c = (ctypes.c_float * N)()
    cuda("cuCtxCreate_v2", ctypes.byref(context), 0, device)
    try:
        cuda("cuModuleLoadData", ctypes.byref(module), PTX + b"\0")
        cuda("cuModuleGetFunction", ctypes.byref(function), module, b"vadd")
        for buffer in buffers:
            cuda("cuMemAlloc_v2", ctypes.byref(buffer), size)
        cuda("cuMemcpyHtoD_v2", buffers[0], host_a, size)
        cuda("cuMemcpyHtoD_v2", buffers[1], host_b, size)
        count = c_uint(N)
        values = (*buffers, count)
        params = (c_void_p * len(values))(*(ctypes.addressof(value) for value in values))
        blocks = (N + BLOCK - 1) // BLOCK
        cuda("cuLaunchKernel", function, blocks, 1, 1, BLOCK, 1, 1, 0, None, params, None)
        cuda("cuCtxSynchronize")
        cuda("cuMemcpyDtoH_v2", host_c, buffers[2], size)
        wrong = [i for i in range(N) if host_c[i] != 3.0 * i]
        if wrong:
            first = wrong[0]
            raise ValueError(
                f"wrong result in {len(wrong)} of {N} elements "
                f"(c[{first}] = {host_c[first]}, expected {3.0 * first})"
            )
    finally:
        for buffer in buffers:
            if buffer.value:
                cuda.lib.cuMemFree_v2(buffer)
        if module.value:
            cuda.lib.cuModuleUnload(module)
        cuda.lib.cuCtxDestroy_v2(context)


def main() -> int:
    try:
        cuda = Driver(ctypes.CDLL("libcuda.so.1"))
    except (OSError, AttributeError) as exc:
        print(f"FAIL - cannot load the CUDA driver library libcuda.so.1: {exc}")
        return 1
    count = c_int()
    try:
        cuda("cuInit", 0)
        cuda("cuDeviceGetCount", ctypes.byref(count))
    except CudaError as exc:
        print(f"FAIL - {exc}")
        return 1
    if count.value == 0:
        print("FAIL - no CUDA devices")
        return 1
    failed = 0
    for ordinal in range(count.value):
        device = c_int()
        where = f"device{ordinal}"
        try:
            cuda("cuDeviceGet", ctypes.byref(device), ordinal)
            where = bus_id(cuda, device.value)
            name = device_name(cuda, device.value)
            vector_add(cuda, device.value)
        except (CudaError, ValueError) as exc:
            failed += 1
            print(f"FAIL {where} {exc}", flush=True)
            continue
        print(f"PASS {where} {name}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
