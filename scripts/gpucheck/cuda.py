"""The CUDA clients the checks run (libcuda through ctypes, a kernel in PTX) and the GPU's SM count."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

CLIENT = r"""
import ctypes, json, os, sys
limit_mib = int(os.environ["CHECK_LIMIT_MIB"])
result = {"pid": os.getpid(), "pinned_limit_env": os.environ.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"),
          "thread_env": os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")}
cuda = ctypes.CDLL("libcuda.so.1")
def check(code, what):
    if code != 0:
        raise SystemExit(json.dumps({**result, "error": f"{what}: CUresult {code}"}))
check(cuda.cuInit(0), "cuInit")
device = ctypes.c_int()
check(cuda.cuDeviceGet(ctypes.byref(device), 0), "cuDeviceGet")
sms = ctypes.c_int()
check(cuda.cuDeviceGetAttribute(ctypes.byref(sms), 16, device), "SM count")  # MULTIPROCESSOR_COUNT
context = ctypes.c_void_p()
check(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), device), "cuDevicePrimaryCtxRetain")
check(cuda.cuCtxSetCurrent(context), "cuCtxSetCurrent")
class Affinity(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("smCount", ctypes.c_uint)]
affinity = Affinity()
code = cuda.cuCtxGetExecAffinity(ctypes.byref(affinity), 0)  # CU_EXEC_AFFINITY_TYPE_SM_COUNT
result.update(device_sms=sms.value, context_sms=affinity.smCount if code == 0 else None)
free, total = ctypes.c_size_t(), ctypes.c_size_t()
check(cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)), "cuMemGetInfo")
result.update(mem_total_mib=total.value >> 20, mem_free_mib=free.value >> 20)
over = ctypes.c_void_p()
code = cuda.cuMemAlloc_v2(ctypes.byref(over), ctypes.c_size_t((limit_mib + 512) << 20))
result["over_limit_allocation"] = "failed" if code != 0 else "SUCCEEDED"
if code == 0:
    cuda.cuMemFree_v2(over)
chunk, held, pointers = 64, 0, []
while held < limit_mib + 4096:
    pointer = ctypes.c_void_p()
    if cuda.cuMemAlloc_v2(ctypes.byref(pointer), ctypes.c_size_t(chunk << 20)) != 0:
        break
    pointers.append(pointer)
    held += chunk
result["allocated_mib"] = held
print(json.dumps(result))
"""


#: A kernel that spins ``iters`` times per thread and, from thread 0 of each block, writes the SM it ran on
#: (``%smid``) and the spin count (so the loop is not optimized away). PTX for sm_70: the driver JITs it for
#: any newer GPU.
SPIN_PTX = r"""
.version 7.0
.target sm_70
.address_size 64
.visible .entry spin(.param .u64 smids, .param .u64 counts, .param .u32 iters) {
  .reg .u32 %r<8>;
  .reg .u64 %rd<8>;
  .reg .pred %p<3>;
  ld.param.u64 %rd1, [smids];
  ld.param.u64 %rd2, [counts];
  ld.param.u32 %r1, [iters];
  mov.u32 %r2, %ctaid.x;
  mov.u32 %r3, %smid;
  mov.u32 %r4, 0;
  mov.u32 %r6, %clock;
SPIN:
  add.u32 %r4, %r4, 1;
  xor.b32 %r6, %r6, %r4;
  setp.lt.u32 %p1, %r4, %r1;
  @%p1 bra SPIN;
  mov.u32 %r5, %tid.x;
  setp.ne.u32 %p2, %r5, 0;
  @%p2 bra DONE;
  mul.wide.u32 %rd3, %r2, 4;
  add.u64 %rd4, %rd1, %rd3;
  st.global.u32 [%rd4], %r3;
  add.u64 %rd5, %rd2, %rd3;
  st.global.u32 [%rd5], %r6;
DONE:
  ret;
}
"""


#: One client: load SPIN_PTX, launch it over BLOCKS blocks of 128 threads, time it, count the SMs used.
SPIN_CLIENT = r"""
import ctypes, json, os, time
BLOCKS, ITERS = int(os.environ["CHECK_BLOCKS"]), int(os.environ["CHECK_ITERS"])
result = {"pid": os.getpid(), "thread_env": os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")}
cuda = ctypes.CDLL("libcuda.so.1")
def check(code, what):
    if code != 0:
        raise SystemExit(json.dumps({**result, "error": f"{what}: CUresult {code}"}))
check(cuda.cuInit(0), "cuInit")
device = ctypes.c_int()
check(cuda.cuDeviceGet(ctypes.byref(device), 0), "cuDeviceGet")
context = ctypes.c_void_p()
check(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), device), "cuDevicePrimaryCtxRetain")
check(cuda.cuCtxSetCurrent(context), "cuCtxSetCurrent")
module, function = ctypes.c_void_p(), ctypes.c_void_p()
check(cuda.cuModuleLoadData(ctypes.byref(module), os.environ["CHECK_PTX"].encode() + b"\0"), "cuModuleLoadData")
check(cuda.cuModuleGetFunction(ctypes.byref(function), module, b"spin"), "cuModuleGetFunction")
smids, counts = ctypes.c_uint64(), ctypes.c_uint64()
check(cuda.cuMemAlloc_v2(ctypes.byref(smids), ctypes.c_size_t(4 * BLOCKS)), "cuMemAlloc")
check(cuda.cuMemAlloc_v2(ctypes.byref(counts), ctypes.c_size_t(4 * BLOCKS)), "cuMemAlloc")
iters = ctypes.c_uint32(ITERS)
params = (ctypes.c_void_p * 3)(ctypes.addressof(smids), ctypes.addressof(counts), ctypes.addressof(iters))
def launch():
    check(cuda.cuLaunchKernel(function, BLOCKS, 1, 1, 128, 1, 1, 0, None, params, None), "cuLaunchKernel")
    check(cuda.cuCtxSynchronize(), "cuCtxSynchronize")
launch()  # warm: the JIT and the first launch are not timed
if os.environ.get("CHECK_START_AT"):
    time.sleep(max(float(os.environ["CHECK_START_AT"]) - time.time(), 0))
started = time.perf_counter()
runs = int(os.environ.get("CHECK_RUNS", "5"))
for _ in range(runs):
    launch()
seconds = time.perf_counter() - started
out = (ctypes.c_uint32 * BLOCKS)()
check(cuda.cuMemcpyDtoH_v2(out, smids, ctypes.c_size_t(4 * BLOCKS)), "cuMemcpyDtoH")
result.update(blocks=BLOCKS, runs=runs, seconds=round(seconds, 4),
              blocks_per_second=round(runs * BLOCKS / seconds, 1), sms_used=len(set(out)))
print(json.dumps(result))
"""


SM_PROBE = r"""
import ctypes
cuda = ctypes.CDLL("libcuda.so.1")
device, sms = ctypes.c_int(), ctypes.c_int()
assert cuda.cuInit(0) == 0 and cuda.cuDeviceGet(ctypes.byref(device), 0) == 0
assert cuda.cuDeviceGetAttribute(ctypes.byref(sms), 16, device) == 0
print(sms.value)
"""


def whole_gpu_sms(uuid: str) -> int | None:
    """The GPU's SM count seen by a client outside MPS, before any daemon runs.

    Under an MPS server a client's CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT already reports its share (on an H100
    at 25 %: 32 of 132), so the whole GPU's count must come from a client that reaches the GPU directly.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUDA_MPS_")}
    env.update(CUDA_VISIBLE_DEVICES=uuid, CUDA_MPS_PIPE_DIRECTORY=tempfile.mkdtemp(prefix="no-mps-"))
    argv = [sys.executable, "-c", SM_PROBE]
    probe = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, check=False)
    return int(probe.stdout) if probe.returncode == 0 and probe.stdout.strip().isdigit() else None


GREEDY = r"""
import ctypes, os, sys, time
cuda = ctypes.CDLL("libcuda.so.1")
assert cuda.cuInit(0) == 0
device, context = ctypes.c_int(), ctypes.c_void_p()
assert cuda.cuDeviceGet(ctypes.byref(device), int(os.environ.get("CHECK_ORDINAL", "0"))) == 0
assert cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), device) == 0
assert cuda.cuCtxSetCurrent(context) == 0
pointer = ctypes.c_void_p()
assert cuda.cuMemAlloc_v2(ctypes.byref(pointer), ctypes.c_size_t(int(os.environ["CHECK_HOLD_MIB"]) << 20)) == 0
print("holding", flush=True)
time.sleep(300)
"""
