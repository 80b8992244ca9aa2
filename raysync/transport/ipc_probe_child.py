"""The child of raysync's quick CUDA IPC probe (raysync.transport.ipc_probe), run as a script by path: it imports
neither torch nor raysync, so it costs Python's start-up and the CUDA driver's, no more.

stdin, one line: ``<device ordinal> <cudaIpcMemHandle_t, 128 hex digits> <byte offset>``. The child opens the
handle on that device (its ordinal is the parent's: the child inherits CUDA_VISIBLE_DEVICES), reads 256 bytes at
the offset and prints ``ipc ok`` when they are 0, 1, ..., 255. Any failure: a message on stderr, exit status 1.
"""

import ctypes
import sys


class _Handle(ctypes.Structure):  # CUipcMemHandle, passed by value
    _fields_ = [("reserved", ctypes.c_ubyte * 64)]


def main() -> int:
    ordinal, handle_hex, offset = sys.stdin.read().split()
    cuda = ctypes.CDLL("libcuda.so.1")

    def call(name: str, *args: object) -> None:
        rc = getattr(cuda, name)(*args)
        if rc != 0:
            raise RuntimeError(f"{name} failed: CUresult {rc}")

    cuda.cuIpcOpenMemHandle_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), _Handle, ctypes.c_uint]
    cuda.cuMemcpyDtoH_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t]
    cuda.cuIpcCloseMemHandle.argtypes = [ctypes.c_uint64]
    call("cuInit", 0)
    device, ctx = ctypes.c_int(), ctypes.c_void_p()
    call("cuDeviceGet", ctypes.byref(device), int(ordinal))
    call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), device)
    call("cuCtxSetCurrent", ctx)
    raw, handle = bytes.fromhex(handle_hex), _Handle()
    if len(raw) != ctypes.sizeof(handle):
        raise ValueError(f"a CUDA IPC handle has {ctypes.sizeof(handle)} bytes, not {len(raw)}")
    ctypes.memmove(ctypes.addressof(handle), raw, len(raw))
    base = ctypes.c_uint64()
    call("cuIpcOpenMemHandle_v2", ctypes.byref(base), handle, 1)  # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
    got = (ctypes.c_ubyte * 256)()
    try:
        call("cuMemcpyDtoH_v2", got, base.value + int(offset), 256)
    finally:
        call("cuIpcCloseMemHandle", base)
        call("cuDevicePrimaryCtxRelease_v2", device)
    print("ipc ok" if bytes(got) == bytes(range(256)) else "ipc read wrong bytes", flush=True)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception as e:
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(1)
