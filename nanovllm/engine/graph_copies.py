"""Host->device copies inside CUDA graphs whose addresses change between replays.

A copy captured in a CUDA graph keeps the addresses it was captured with. The CUDA runtime can change
them in the instantiated graph (`cudaGraphExecMemcpyNodeSetParams1D`) without re-capturing, and the
next replay then copies the new range on a copy engine (DMA), concurrently with the graph's kernels.
PyTorch exposes the graph's handles (`CUDAGraph(keep_graph=True)`, `raw_cuda_graph[_exec]`) but not
these calls, so they go through ctypes into the CUDA runtime that torch itself loaded.

Use: during capture, `capture_copy` enqueues a placeholder copy with a unique (dst, src) pair and a
key; after instantiation `GraphCopies(graph, keys)` finds each key's memcpy node; before a replay,
`set` gives keys new (dst, src, nbytes), or None to turn a copy off, skipping those that did not change.
"""
from __future__ import annotations

import ctypes
import functools

import torch

_MEMCPY_NODE = 1  # cudaGraphNodeTypeMemcpy
_HOST_TO_DEVICE = 1  # cudaMemcpyHostToDevice


class _Pos(ctypes.Structure):
    _fields_ = [("x", ctypes.c_size_t), ("y", ctypes.c_size_t), ("z", ctypes.c_size_t)]


class _PitchedPtr(ctypes.Structure):
    _fields_ = [("ptr", ctypes.c_void_p), ("pitch", ctypes.c_size_t), ("xsize", ctypes.c_size_t),
                ("ysize", ctypes.c_size_t)]


class _Memcpy3DParms(ctypes.Structure):  # cudaMemcpy3DParms
    _fields_ = [("srcArray", ctypes.c_void_p), ("srcPos", _Pos), ("srcPtr", _PitchedPtr),
                ("dstArray", ctypes.c_void_p), ("dstPos", _Pos), ("dstPtr", _PitchedPtr),
                ("extent", _Pos), ("kind", ctypes.c_int)]


class CudaRuntimeError(RuntimeError):
    pass


@functools.cache
def cudart() -> ctypes.CDLL | None:
    """The CUDA runtime library this process loaded for torch (None where there is none or it lacks the calls)."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.init()
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart" in line}
    except OSError:
        return None
    for path in sorted(paths):
        lib = ctypes.CDLL(path)
        if all(hasattr(lib, f) for f in ("cudaGraphExecMemcpyNodeSetParams1D", "cudaGraphMemcpyNodeGetParams",
                                         "cudaGraphNodeSetEnabled")):
            return lib
    return None


def available() -> bool:
    return cudart() is not None and hasattr(torch.cuda.CUDAGraph, "raw_cuda_graph_exec")


def _check(code: int, what: str) -> None:
    if code != 0:
        lib = cudart()
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        raise CudaRuntimeError(f"{what} failed: {lib.cudaGetErrorString(code).decode()} ({code})")


def capture_copy(dst: int, src: int, nbytes: int) -> None:
    """Enqueue cudaMemcpyAsync(dst <- pinned src) on the current stream (during capture: a memcpy node).
    ctypes rather than Tensor.copy_, which would also record events for torch's pinned-memory allocator."""
    stream = torch.cuda.current_stream().cuda_stream
    _check(cudart().cudaMemcpyAsync(ctypes.c_void_p(dst), ctypes.c_void_p(src), ctypes.c_size_t(nbytes),
                                    _HOST_TO_DEVICE, ctypes.c_void_p(stream)), "cudaMemcpyAsync")


def memcpy_nodes(graph_handle: int) -> list[tuple[int, int, int, int]]:
    """(node, dst, src, nbytes) of every memcpy node of a cudaGraph_t."""
    lib = cudart()
    count = ctypes.c_size_t(0)
    _check(lib.cudaGraphGetNodes(ctypes.c_void_p(graph_handle), None, ctypes.byref(count)), "cudaGraphGetNodes")
    nodes = (ctypes.c_void_p * count.value)()
    _check(lib.cudaGraphGetNodes(ctypes.c_void_p(graph_handle), nodes, ctypes.byref(count)), "cudaGraphGetNodes")
    found = []
    for node in nodes:
        kind = ctypes.c_int(-1)
        _check(lib.cudaGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(kind)), "cudaGraphNodeGetType")
        if kind.value != _MEMCPY_NODE:
            continue
        p = _Memcpy3DParms()
        _check(lib.cudaGraphMemcpyNodeGetParams(ctypes.c_void_p(node), ctypes.byref(p)), "cudaGraphMemcpyNodeGetParams")
        nbytes = p.extent.x * max(1, p.extent.y) * max(1, p.extent.z)
        found.append((node, p.dstPtr.ptr + p.dstPos.x, p.srcPtr.ptr + p.srcPos.x, nbytes))
    return found


class GraphCopies:
    """The memcpy nodes of one instantiated graph (`keep_graph=True`), by key, and their current parameters."""

    def __init__(self, graph: torch.cuda.CUDAGraph, keys: dict[tuple[int, int], object]):
        """keys: (dst, src) of each placeholder copy captured in graph -> the caller's key for it."""
        self.exec = graph.raw_cuda_graph_exec()
        self.nodes: dict[object, int] = {}
        self.current: dict[object, tuple[int, int, int] | None] = {}
        for node, dst, src, nbytes in memcpy_nodes(graph.raw_cuda_graph()):
            key = keys.get((dst, src))
            if key is not None:
                self.nodes[key] = node
                self.current[key] = (dst, src, nbytes)
        missing = len(keys) - len(self.nodes)
        if missing:
            raise CudaRuntimeError(f"{missing} of {len(keys)} captured copies not found among the graph's memcpy nodes")
        self.version: object = None  # what the caller last set, to skip unchanged steps

    def set(self, params: dict[object, tuple[int, int, int] | None], version: object = None) -> int:
        """Give the next replays new (dst, src, nbytes) for the keys in params, None to skip that copy (the
        node is disabled: an empty node that keeps its dependencies); returns how many nodes changed."""
        if version is not None and version == self.version:
            return 0
        lib = cudart()
        changed = 0
        for key, copy in params.items():
            if self.current[key] == copy:
                continue
            node = ctypes.c_void_p(self.nodes[key])
            if copy is not None:
                dst, src, nbytes = copy
                _check(lib.cudaGraphExecMemcpyNodeSetParams1D(
                    ctypes.c_void_p(self.exec), node, ctypes.c_void_p(dst), ctypes.c_void_p(src),
                    ctypes.c_size_t(nbytes), _HOST_TO_DEVICE), "cudaGraphExecMemcpyNodeSetParams1D")
            if (copy is None) != (self.current[key] is None):
                _check(lib.cudaGraphNodeSetEnabled(ctypes.c_void_p(self.exec), node, int(copy is not None)),
                       "cudaGraphNodeSetEnabled")
            self.current[key] = copy
            changed += 1
        self.version = version
        return changed
