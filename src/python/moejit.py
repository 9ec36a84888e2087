"""libmoejit from Python: the C ABI (include/moejit/moejit.h) through ctypes, tensors by DLPack.

No build step: the module loads the shared library and declares its calls. Tensors are any objects
with ``__dlpack__`` (torch.Tensor, CuPy arrays, ...), borrowed for the length of one call (a plain
torch.Tensor is described from its own accessors instead, which is cheaper and says the same); raw
buffers (repacked weights, the workspace) are such tensors too, checked against the sizes the
library asks for before their addresses are passed. Every failed call raises MoejitError (a
subclass per status) with the library's message, which names the argument and what was wrong; an
argument of the wrong Python type (no __dlpack__, a stream it cannot read) is a TypeError.

    import torch, moejit
    moejit.register_shapes_file("/etc/moejit/shapes.json")
    moejit.prewarm(["qwen3-30b-a3b"])            # at model load, before graph capture
    layer = moejit.MoeLayer("qwen3-30b-a3b")
    weights = {name: torch.empty(n, dtype=torch.uint8, device="cuda")
               for name, n in layer.weight_bytes.items() if n}
    layer.repack_separate(w1, w1_s, w3, w3_s, w2, w2_s, weights)
    workspace = torch.empty(layer.workspace_bytes(256), dtype=torch.uint8, device="cuda")
    layer.forward(hidden, topk_ids, topk_weights, weights, workspace, out)

The library is found at $MOEJIT_LIBRARY, else beside an installed copy of this file
(<prefix>/share/moejit/python -> <prefix>/lib*/libmoejit.so.<ABI>), else on the loader's path.
Calls launch on `stream`: a CUstream handle (int), an object with ``cuda_stream``
(torch.cuda.Stream) or ``__cuda_stream__``; None means torch's current stream when torch is
initialized, else the legacy default stream. Tensors must be ready on that stream: the call adds
no synchronization.
"""

import collections.abc
import ctypes
import glob
import json
import operator
import os
from struct import Struct
import sys
import threading

# The library minor this binding is written for: before 1.0 a minor release may change the ABI,
# and the shared library's soname carries it (libmoejit.so.0.4).
ABI = "0.4"

__all__ = [
    "ABI", "MoejitError", "InvalidDescriptor", "InvalidArgument", "Unsupported", "CompileFailed",
    "CacheCorrupt", "CacheError", "DriverError", "CaptureMiss", "IoError", "InternalError",
    "PrewarmResult", "MoeLayer", "BoundWeights", "version", "set_check_pointers",
    "weight_layout_version",
    "register_shapes_file", "register_shapes", "prewarm", "append_shared",
]


# ---- errors -------------------------------------------------------------------------------------

class MoejitError(RuntimeError):
    """A failed libmoejit call: `status` is the moejit_status, the message the library's."""

    status = None

    def __init__(self, message, status=None):
        super().__init__(message)
        if status is not None:
            self.status = status


class InvalidDescriptor(MoejitError):
    status = 1


class InvalidArgument(MoejitError, ValueError):
    status = 2


class Unsupported(MoejitError):
    status = 3


class CompileFailed(MoejitError):
    """Some kernels failed to compile or load; from prewarm, `result` holds its PrewarmResult."""
    status = 4
    result = None


class CacheCorrupt(MoejitError):
    status = 5


class CacheError(MoejitError):
    status = 6


class DriverError(MoejitError):
    status = 7


class CaptureMiss(MoejitError):
    status = 8


class IoError(MoejitError):
    status = 9


class InternalError(MoejitError):
    status = 10


_ERRORS = {cls.status: cls for cls in (InvalidDescriptor, InvalidArgument, Unsupported,
                                       CompileFailed, CacheCorrupt, CacheError, DriverError,
                                       CaptureMiss, IoError, InternalError)}


# ---- C types ------------------------------------------------------------------------------------
# DLPack's DLTensor (dlpack.h 0.6; unchanged in 1.x) and the structs of moejit.h.

_KDL_CPU, _KDL_CUDA = 1, 2


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _WeightLayout(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("struct_size", "w13_bytes", "w13_scale_bytes", "w2_bytes", "w2_scale_bytes",
                 "b13_bytes", "b2_bytes")]


class _Weights(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t)] + [
        (name, ctypes.c_void_p) for name in ("w13", "w13_scales", "w2", "w2_scales", "b13", "b2")]


# A struct that can grow (moejit.h) starts with struct_size, its size: the binding constructs
# each with it as the first positional field (an __init__ that set it cost a forward ~0.2 us).
_WEIGHTS_SIZE = ctypes.sizeof(_Weights)


class PrewarmResult(ctypes.Structure):
    """moejit_prewarm_result: kernel counts by outcome, and the call's wall time."""

    _fields_ = [(name, ctypes.c_size_t) for name in
                ("struct_size", "kernels", "compiled", "not_stored", "cached", "failed")] + [
        ("milliseconds", ctypes.c_double)]

    def __repr__(self):
        return ("PrewarmResult(kernels={}, compiled={}, not_stored={}, cached={}, failed={}, "
                "milliseconds={:.1f})").format(self.kernels, self.compiled, self.not_stored,
                                               self.cached, self.failed, self.milliseconds)


_PROGRESS = ctypes.CFUNCTYPE(None, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_double,
                             ctypes.c_size_t, ctypes.c_size_t, ctypes.c_void_p)

# The weight buffers by their layout field, in moejit_moe_weights' order.
_WEIGHT_FIELDS = (("w13", "w13_bytes"), ("w13_scales", "w13_scale_bytes"), ("w2", "w2_bytes"),
                  ("w2_scales", "w2_scale_bytes"), ("b13", "b13_bytes"), ("b2", "b2_bytes"))
_PATHS = {"auto": 0, "marlin": 1, "decode": 2}
_GATES = {"sigmoid": 0, "constant": 1, "given": 2}


# ---- the library --------------------------------------------------------------------------------

def _candidates():
    explicit = os.environ.get("MOEJIT_LIBRARY")
    if explicit:
        return [explicit]
    here = os.path.dirname(os.path.abspath(__file__))
    prefix = os.path.normpath(os.path.join(here, os.pardir, os.pardir, os.pardir))
    soname = "libmoejit.so." + ABI
    found = sorted(glob.glob(os.path.join(prefix, "lib*", soname)))
    found += sorted(glob.glob(os.path.join(prefix, "lib", "*", soname)))
    return found + [soname]


def _load():
    tried = []
    for candidate in _candidates():
        try:
            lib = ctypes.CDLL(candidate)
            break
        except OSError as e:
            tried.append("{} ({})".format(candidate, e))
    else:
        raise ImportError("moejit: libmoejit not found; tried " + "; ".join(tried) +
                          ". Set MOEJIT_LIBRARY to the path of libmoejit.so." + ABI)

    c_int, c_size_t, c_char_p, c_void_p = ctypes.c_int, ctypes.c_size_t, ctypes.c_char_p, \
        ctypes.c_void_p
    dl = c_void_p  # a DLTensor's address (_Borrowed.address)
    weights = ctypes.POINTER(_Weights)
    signatures = {
        "moejit_last_error": (c_char_p, []),
        "moejit_version": (c_char_p, []),
        "moejit_set_check_pointers": (c_int, [c_int, ctypes.POINTER(c_int)]),
        "moejit_register_shapes_file": (c_int, [c_char_p]),
        "moejit_register_shapes": (c_int, [c_char_p, c_char_p]),
        "moejit_prewarm": (c_int, [ctypes.POINTER(c_char_p), c_size_t, c_char_p, c_int, _PROGRESS,
                                   c_void_p, ctypes.POINTER(PrewarmResult)]),
        "moejit_append_shared": (c_int, [dl, dl, dl, dl, dl, ctypes.c_int64, ctypes.c_float, c_int,
                                         c_void_p]),
        "moejit_moe_create": (c_int, [c_char_p, ctypes.POINTER(c_void_p)]),
        "moejit_moe_destroy": (None, [c_void_p]),
        "moejit_moe_get_weight_layout": (c_int, [c_void_p, ctypes.POINTER(_WeightLayout)]),
        "moejit_moe_weight_layout_version": (c_int, []),
        "moejit_moe_repack_gpt_oss": (c_int, [c_void_p, dl, dl, dl, dl, weights, c_int,
                                              c_void_p, c_void_p]),
        "moejit_moe_repack_separate": (c_int, [c_void_p, dl, dl, dl, dl, dl, dl, weights, c_int,
                                               c_void_p, c_void_p]),
        "moejit_moe_workspace_bytes": (c_int, [c_void_p, c_int, ctypes.POINTER(c_size_t)]),
        "moejit_moe_forward_ex": (c_int, [c_void_p, dl, dl, dl, weights, c_void_p, c_size_t, dl,
                                          c_int, c_int, c_void_p]),
        "moejit_moe_decode_problem": (c_int, [c_void_p, ctypes.POINTER(c_char_p)]),
    }
    for name, (restype, argtypes) in signatures.items():
        function = getattr(lib, name)
        function.restype = restype
        function.argtypes = argtypes

    running = lib.moejit_version().decode()
    if running.split(".")[:2] != ABI.split("."):
        raise ImportError("moejit: this binding is for libmoejit {}.x, but {} is {}: use the "
                          "moejit.py installed with that library".format(ABI, lib._name, running))
    return lib


_lib = _load()

_DLTENSOR = b"dltensor"  # the capsule name of an unversioned DLPack export
_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


def _check(status):
    if status != 0:
        message = _lib.moejit_last_error().decode(errors="replace")
        raise _ERRORS.get(status, MoejitError)(message, status)


def version():
    """The running library's version, "MAJOR.MINOR.PATCH"."""
    return _lib.moejit_version().decode()


def set_check_pointers(on):
    """Turns the library's pointer checks on or off for later calls, from any thread
    (MOEJIT_CHECK_POINTERS sets them at start-up): each op then asks the driver about every buffer
    it is given and refuses memory a kernel can't reach (two driver calls a buffer: a forward
    took 3.9-5.0 us more on an H100). Returns the previous setting."""
    if not isinstance(on, bool):
        raise TypeError("set_check_pointers: on: expected a bool, found " + type(on).__name__)
    previous = ctypes.c_int(0)
    _check(_lib.moejit_set_check_pointers(1 if on else 0, ctypes.byref(previous)))
    return previous.value != 0


def weight_layout_version():
    """The kernel layout repacked weights are in: keep it beside buffers kept across runs."""
    return _lib.moejit_moe_weight_layout_version()


# ---- tensors and streams ------------------------------------------------------------------------

def _not_contiguous(name, strides):
    """The error for a buffer argument (the workspace, a weight) that is not contiguous."""
    return InvalidArgument("{}: expected a contiguous tensor, found strides {}; pass "
                           ".contiguous()".format(name, list(strides)))


def _check_buffer_bytes(name, nbytes, expected_bytes):
    """Refuses a buffer argument shorter than the library asks for."""
    if nbytes < expected_bytes:
        raise InvalidArgument("{}: expected at least {} bytes, found {}".format(
            name, expected_bytes, nbytes))


class _Borrowed:
    """The DLTensor of one object's __dlpack__ capsule, by address; the capsule (and so the
    tensor's memory) stays alive as long as this object. `None` borrows nothing: a null pointer."""

    __slots__ = ("name", "capsule", "address")

    def __init__(self, obj, name):
        self.name = name
        self.capsule = None
        self.address = None
        if obj is None:
            return
        try:
            export = obj.__dlpack__
        except AttributeError:
            raise TypeError("{}: expected a tensor with __dlpack__ (torch.Tensor, a CuPy array, "
                            "...), found {}".format(name, type(obj).__name__)) from None
        # stream=-1: the producer adds no synchronization (the caller orders its streams); a
        # producer without streams (numpy) refuses any stream but None.
        try:
            self.capsule = export(stream=-1)
        except (TypeError, ValueError, RuntimeError, BufferError):
            try:
                self.capsule = export()
            except (TypeError, ValueError, RuntimeError, BufferError) as e:
                # e.g. torch's refusal of a sparse tensor, which does not say which argument
                raise InvalidArgument("{}: a {} that DLPack can't export: {}".format(
                    name, type(obj).__name__, e)) from e
        # A DLManagedTensor starts with its DLTensor.
        try:
            self.address = _capsule_pointer(self.capsule, _DLTENSOR)
        except ValueError as e:
            # A versioned export ("dltensor_versioned"), or one a consumer already took
            # ("used_dltensor"): the C ABI takes a DLTensor, which only an unused
            # unversioned capsule holds.
            raise InvalidArgument("{}: a {} whose __dlpack__() did not give an unused, unversioned "
                                  "DLPack capsule (\"dltensor\"): {}".format(
                                      name, type(obj).__name__, e)) from e

    @property
    def tensor(self):
        return DLTensor.from_address(self.address)

    def device_buffer(self, expected_bytes=0):
        """(address, bytes) of the buffer, once it is a contiguous CUDA tensor of at least
        expected_bytes. Reads the DLTensor once: a forward calls this on its hot path."""
        t = self.tensor
        if t.device.device_type != _KDL_CUDA:
            raise InvalidArgument("{}: expected a CUDA tensor, found DLPack device type {}".format(
                self.name, t.device.device_type))
        ndim, shape, strides = t.ndim, t.shape, t.strides
        count = 1
        for i in reversed(range(ndim)):
            if strides and shape[i] != 1 and strides[i] != count:
                raise _not_contiguous(self.name, (strides[j] for j in range(ndim)))
            count *= shape[i]
        dtype = t.dtype
        nbytes = count * dtype.bits * dtype.lanes // 8
        _check_buffer_bytes(self.name, nbytes, expected_bytes)
        # Null data stays null whatever its byte_offset, so the library refuses it by name.
        return (t.data + t.byte_offset if t.data else 0), nbytes

    def device_address(self, expected_bytes):
        """The buffer's address, once it is a contiguous CUDA tensor of at least expected_bytes."""
        return self.device_buffer(expected_bytes)[0]


# ---- torch tensors, filled in without DLPack ----------------------------------------------------
# Why: a torch tensor's __dlpack__ costs 3-5 us of Python per tensor (torch builds a managed tensor
# and a capsule each time), and a forward takes five, weights aside. For an exact torch.Tensor the
# hot calls refill a DLTensor of their own instead, one per argument and thread, from the tensor's
# accessors (1.6 us here; tools/PERF_LOG.md, sixtieth session); the library checks it as it checks
# DLPack's. Buffers (the workspace, weights) are read the same way and checked here as DLPack's
# are. Anything else goes through DLPack: other producers, subclasses, tensors that require grad
# or carry the negative bit (torch's export refuses those, with its message), dtypes and devices
# the table below does not name, more than _FILL_DIMS dimensions.

_FILL_DIMS = 8
_DLTENSOR_HEAD = Struct("=QiiiBBH")  # DLTensor's data, device, ndim and dtype: 24 bytes
_torch_fill = None  # (torch.Tensor, {torch dtype: (DLPack code, bits, lanes)}) once torch is seen


def _torch_fill_types():
    global _torch_fill
    torch = sys.modules.get("torch")
    if torch is not None and _torch_fill is None:
        _torch_fill = (torch.Tensor, {
            torch.bfloat16: (4, 16, 1), torch.float16: (2, 16, 1), torch.float32: (2, 32, 1),
            torch.float64: (2, 64, 1), torch.uint8: (1, 8, 1), torch.int8: (0, 8, 1),
            torch.int16: (0, 16, 1), torch.int32: (0, 32, 1), torch.int64: (0, 64, 1)})
    return _torch_fill


def _plain_torch(obj):
    """The dtype table where obj is a tensor the binding reads itself (an exact torch.Tensor with
    no grad and no negative bit), else None."""
    fill = _torch_fill or _torch_fill_types()
    if fill is None or type(obj) is not fill[0] or obj.requires_grad or obj.is_neg():
        return None
    return fill[1]


class _Slot:
    """A DLTensor of the binding's own with room for _FILL_DIMS dimensions, refilled per call."""

    __slots__ = ("tensor", "address", "shape", "strides")

    def __init__(self):
        self.shape = (ctypes.c_int64 * _FILL_DIMS)()
        self.strides = (ctypes.c_int64 * _FILL_DIMS)()
        self.tensor = DLTensor()
        self.tensor.shape = ctypes.cast(self.shape, ctypes.POINTER(ctypes.c_int64))
        self.tensor.strides = ctypes.cast(self.strides, ctypes.POINTER(ctypes.c_int64))
        self.address = ctypes.addressof(self.tensor)

    def fill(self, obj):
        """This slot's address, filled from obj where obj is an exact torch.Tensor the fill
        describes (see above), else None."""
        dtypes = _plain_torch(obj)
        if dtypes is None:
            return None
        dtype = dtypes.get(obj.dtype)
        ndim = obj.dim()
        if dtype is None or ndim > _FILL_DIMS:
            return None
        if obj.is_cuda:
            device_type, device_id = _KDL_CUDA, obj.get_device()
        elif obj.is_cpu:
            device_type, device_id = _KDL_CPU, 0
        else:
            return None
        _DLTENSOR_HEAD.pack_into(self.tensor, 0, obj.data_ptr(), device_type, device_id, ndim,
                                 *dtype)
        self.shape[:ndim] = obj.shape
        self.strides[:ndim] = obj.stride()
        return self.address


class _CallSlots(threading.local):
    """One call site's slot sets, per thread, so concurrent calls never share a DLTensor. A call
    pops a set from `free` (or makes one, new(), where none is free) and appends it back when it
    returns. Why not one set a thread: between its fills a call runs user code (a tensor's
    __dlpack__, a stream's __cuda_stream__, an int's __index__), and a call made from there on the
    same thread would refill the outer call's slots with its own tensors. (The pop and append
    cost ~0.03 us a call on the Debian machine.)"""

    def __init__(self, count):
        self.count = count
        self.free = [self.new()]

    def new(self):
        return tuple(_Slot() for _ in range(self.count))


def _dltensor(slot, obj, name, kept):
    """The address of a DLTensor describing obj for the length of the call: slot, refilled, or
    obj's own DLPack export, appended to kept (the caller holds kept until the call returns)."""
    try:
        address = slot.fill(obj)
    except RuntimeError:  # a tensor without strides or storage (sparse, ...): DLPack says why
        address = None
    if address is None:
        borrowed = _Borrowed(obj, name)
        kept.append(borrowed)
        address = borrowed.address
    return address


def _device_buffer(obj, name, expected_bytes=0):
    """(address, bytes, keep-alive, device index) of a buffer argument, once it is a contiguous
    CUDA tensor of at least expected_bytes; a plain torch tensor (_plain_torch) is read through its
    accessors, anything else through DLPack (keep-alive: the borrow, held until the call returns).
    The device index is for _check_device: a buffer reaches the library as an address alone."""
    if _plain_torch(obj) is not None and obj.is_cuda:
        try:
            contiguous, address = obj.is_contiguous(), obj.data_ptr()
        except RuntimeError:  # a tensor without strides or storage (sparse, ...): DLPack says why
            contiguous = None
        if contiguous is not None:
            if not contiguous:
                raise _not_contiguous(name, obj.stride())
            nbytes = obj.nbytes
            _check_buffer_bytes(name, nbytes, expected_bytes)
            return address, nbytes, None, obj.get_device()
    borrowed = _Borrowed(obj, name)
    address, nbytes = borrowed.device_buffer(expected_bytes)
    return address, nbytes, borrowed, borrowed.tensor.device.device_id


def _check_device(name, device, expected, reference):
    """A buffer on another GPU than the call's tensors would be read by kernels that can't reach
    it (an illegal-address fault that breaks the context) or reach it over the interconnect."""
    # Why both devices and no blame: either may be the odd one out (the call's device is the
    # current context's, which the library checks on the tensors alone).
    if device != expected:
        raise InvalidArgument("{}: on CUDA device {}, but {} is on device {}: a call's tensors "
                              "and buffers must all be on one device, the current CUDA "
                              "context's".format(name, device, reference, expected))


def _tensor_device(obj, address):
    """The CUDA device index of a call tensor, from torch or from the DLTensor at address; None
    for a tensor in host memory (the library refuses it, with its own message)."""
    if _plain_torch(obj) is not None:
        device = obj.get_device()  # -1 in host memory
        return device if device >= 0 else None
    if address is None:  # no tensor: the library refuses the null pointer, naming it
        return None
    device = DLTensor.from_address(address).device
    return device.device_id if device.device_type == _KDL_CUDA else None


def _c_string(name, value):
    """value (str or bytes) as the bytes of a C string. Why the NUL check: ctypes ends the string
    at the first NUL, so "a.json\\0x" would open a.json and JSON text after a NUL would be
    dropped, where the caller meant all of it."""
    data = value.encode() if isinstance(value, str) else value
    if not isinstance(data, bytes):
        raise TypeError("{}: expected a str, found {}".format(name, type(value).__name__))
    if b"\0" in data:
        raise InvalidArgument("{}: expected text without NUL characters, found one at offset "
                              "{}".format(name, data.index(b"\0")))
    return data


def _c_int(name, value, bits=32):
    """value as a C int of `bits` bits; ctypes would keep the low bits of a larger one silently
    (first_expert = 2**32 would repack into expert 0). Why operator.index, not int(): int() cuts
    a float down as silently (first_expert = 2.5 would repack into expert 2); index() takes
    Python, numpy and integer torch scalars and refuses the rest."""
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError("{}: expected an int, found {}".format(name, type(value).__name__)) \
            from None
    if not -(1 << (bits - 1)) <= value < (1 << (bits - 1)):
        raise InvalidArgument("{}: expected a {}-bit integer, found {}".format(name, bits, value))
    return value


def _c_float(name, value):
    """value as a C float: a Python, numpy or one-element torch number. Why not float() alone:
    it would read the string "2.5" as a number, and its own error names no argument."""
    if not isinstance(value, (str, bytes, bytearray)):
        try:
            return float(value)
        except (TypeError, ValueError):
            pass
    raise TypeError("{}: expected a real number, found {}".format(name, type(value).__name__))


def _torch_current_stream():
    """torch's current stream on its current device, or None where torch has no CUDA state.
    Why the private calls where torch has them: torch.cuda.current_stream() builds a Stream object
    each call, 4.5-9.6 us of a forward's host time against 0.5-0.9 for the raw handle
    (tools/bench/bench_python.py times both; tools/PERF_LOG.md, fifty-eighth session), which is
    the same stream, as torch's own kernel launchers read it."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    get_device = getattr(torch._C, "_cuda_getDevice", None)
    get_raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if get_device is not None and get_raw is not None:
        return get_raw(get_device()) or None
    return torch.cuda.current_stream().cuda_stream or None


_STREAM_LIMIT = 1 << 64


def _stream_value(handle):
    """A stream handle as a pointer value; ctypes would wrap -1 or 2**64 + 5 silently into
    another handle, which the driver would then be given."""
    if type(handle) is not int:
        if isinstance(handle, bool) or not isinstance(handle, int):
            raise TypeError("stream: expected a CUstream handle (int), found {}".format(
                type(handle).__name__))
        handle = int(handle)
    if not 0 <= handle < _STREAM_LIMIT:
        raise InvalidArgument("stream: expected a CUstream handle (0 to 2**64 - 1), found "
                              "{}".format(handle))
    return handle or None


def _stream_handle(stream):
    if stream is None:
        return _torch_current_stream()
    if type(stream) is int and 0 <= stream < _STREAM_LIMIT:
        return stream or None
    if isinstance(stream, int) and not isinstance(stream, bool):
        return _stream_value(stream)
    if hasattr(stream, "__cuda_stream__"):
        return _stream_value(stream.__cuda_stream__()[1])
    if hasattr(stream, "cuda_stream"):
        return _stream_value(stream.cuda_stream)
    raise TypeError("stream: expected a CUstream handle (int), an object with cuda_stream or "
                    "__cuda_stream__, or None; found {}".format(type(stream).__name__))


# ---- shapes and prewarm -------------------------------------------------------------------------

def register_shapes_file(path):
    """Register every shape of a shape file (all or none); they are then usable by name."""
    try:
        encoded = os.fsencode(path)
    except TypeError:
        raise TypeError("register_shapes_file: path: expected a str, bytes or os.PathLike, found "
                        "{}".format(type(path).__name__)) from None
    _check(_lib.moejit_register_shapes_file(_c_string("path", encoded)))


def _non_finite(value, pointer):
    """(JSON pointer, value) of the first float in `value` that is NaN or infinite, else None."""
    if isinstance(value, float):
        return None if value == value and abs(value) != float("inf") else (pointer, value)
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, (list, tuple)):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        key = str(key).replace("~", "~0").replace("/", "~1")
        found = _non_finite(item, pointer + "/" + key)
        if found is not None:
            return found
    return None


def register_shapes(shapes, source_name=None):
    """Register shapes from JSON text (str, or UTF-8 bytes) or from the same structure as Python
    objects (a dict with "shapes", one shape dict, or a list of them). source_name names them in
    error messages."""
    if isinstance(shapes, (bytes, bytearray)):
        shapes = bytes(shapes)  # the library reads the text as UTF-8
    elif not isinstance(shapes, str):
        where = _non_finite(shapes, "")
        if where is not None:
            # Why here: json.dumps would write the bare word NaN or Infinity, which the library's
            # reader refuses as invalid JSON at a column of text the caller never wrote.
            raise InvalidDescriptor("{}: {}: expected a finite number, found {!r}".format(
                source_name if source_name is not None else "<text>", where[0] or "(root)",
                where[1]), InvalidDescriptor.status)
    text = shapes if isinstance(shapes, (str, bytes)) else json.dumps(shapes)
    _check(_lib.moejit_register_shapes(
        _c_string("shapes", text),
        _c_string("source_name", source_name) if source_name is not None else None))


def prewarm(shape_names, arch=None, jobs=0, progress=None):
    """Compile, or find in the cache, every kernel the registered shapes need for `arch` ("sm_90a";
    None: the current CUDA context's device, whose kernels are then also loaded), `jobs` at a time
    (0: one per hardware thread). progress(kernel, outcome, milliseconds, done, total) is called
    per kernel. Returns a PrewarmResult; raises CompileFailed naming every failed kernel, with the
    PrewarmResult as its `result`."""
    if isinstance(shape_names, (str, bytes)):
        shape_names = [shape_names]
    elif not isinstance(shape_names, collections.abc.Iterable):
        raise TypeError("prewarm: shape_names: expected a shape name or a list of them, found "
                        "{}".format(type(shape_names).__name__))
    names = [_c_string("shape_names[{}]".format(i), n) for i, n in enumerate(shape_names)]
    array = (ctypes.c_char_p * max(len(names), 1))(*names)
    raised = []

    def report(kernel, outcome, milliseconds, done, total, _):
        if raised:
            return
        try:
            progress(kernel.decode(), outcome.decode(), milliseconds, done, total)
        except BaseException as e:  # noqa: B902 -- carried out of the C call, raised below
            raised.append(e)

    callback = _PROGRESS(report) if progress is not None else _PROGRESS()
    result = PrewarmResult(ctypes.sizeof(PrewarmResult))  # struct_size first (moejit.h)
    status = _lib.moejit_prewarm(array, len(names),
                                 _c_string("arch", arch) if arch is not None else None,
                                 _c_int("jobs", jobs),
                                 callback, None, ctypes.byref(result))
    if raised:
        raise raised[0]
    try:
        _check(status)
    except CompileFailed as e:
        e.result = result  # the counts: the kernels that did not fail are ready
        raise
    return result


# ---- ops ----------------------------------------------------------------------------------------

_append_slots = _CallSlots(5)


def append_shared(topk_ids, topk_weights, shared_logits, out_ids, out_weights, shared_base, scale,
                  gate="sigmoid", stream=None):
    """out_ids / out_weights [T, K + S] = the routed top-k, then the shared experts with weight
    sigmoid(shared_logits) * scale (gate "sigmoid"), scale ("constant") or shared_logits
    ("given"). See moejit::append_shared."""
    if gate not in _GATES:
        raise InvalidArgument("gate: expected one of {}, found {!r}".format(sorted(_GATES), gate))
    free = _append_slots.free  # this thread's (see _CallSlots)
    slots, kept = free.pop() if free else _append_slots.new(), []
    try:
        _check(_lib.moejit_append_shared(_dltensor(slots[0], topk_ids, "topk_ids", kept),
                                         _dltensor(slots[1], topk_weights, "topk_weights", kept),
                                         _dltensor(slots[2], shared_logits, "shared_logits", kept),
                                         _dltensor(slots[3], out_ids, "out_ids", kept),
                                         _dltensor(slots[4], out_weights, "out_weights", kept),
                                         _c_int("shared_base", shared_base, 64),
                                         _c_float("scale", scale),
                                         _GATES[gate], _stream_handle(stream)))
    finally:
        free.append(slots)


class BoundWeights:
    """A layer's repacked buffers, checked once against its layout (MoeLayer.bind_weights). Holds
    the tensors, so their memory lives as long as this object."""

    def __init__(self, shape_name, struct, tensors, device):
        self.shape_name = shape_name
        self.struct = struct
        self.device = device  # the buffers' CUDA device index
        self._tensors = tensors

    # Why: a copy in another process (pickle, multiprocessing) would carry this process's device
    # addresses into forwards there. In this process it never changes, so a copy is itself.
    def __reduce_ex__(self, protocol):
        raise TypeError("BoundWeights can't be pickled: it holds this process's device addresses; "
                        "bind the weights in each process (MoeLayer.bind_weights)")

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self


_forward_slots = _CallSlots(4)


class _Handle(ctypes.c_void_p):
    """A moejit_moe handle, destroyed when its last reference goes. Why: a library call holds
    its arguments until it returns, so a MoeLayer closed (or collected) while a call on it runs
    in another thread destroys the handle after that call, never under it; and threads that
    close at once drop one reference each, so the handle is destroyed exactly once. Why a
    c_void_p: ctypes passes it as fast as a plain one (an object with _as_parameter_ cost
    ~0.1 us more a call on the Debian machine)."""

    __slots__ = ()

    def __del__(self):
        # _lib is None at interpreter exit, after the module's globals went.
        if self.value and _lib is not None:
            _lib.moejit_moe_destroy(self)

    # Why: ctypes copies and pickles a c_void_p subclass by value (a plain c_void_p refuses), and
    # two _Handles of one address would each destroy it (in another process, an address that
    # means nothing there).
    def __reduce__(self):
        raise TypeError("a MoeLayer's library handle can't be copied or pickled")


class MoeLayer:
    """One registered shape's MoE layer: repack its checkpoint, size its buffers, run it."""

    def __init__(self, shape_name):
        handle = _Handle()
        _check(_lib.moejit_moe_create(_c_string("shape_name", shape_name), ctypes.byref(handle)))
        self._handle = handle
        self.shape_name = shape_name
        layout = _WeightLayout(ctypes.sizeof(_WeightLayout))
        _check(_lib.moejit_moe_get_weight_layout(self._live(), ctypes.byref(layout)))
        # Bytes of each repacked buffer, by the name forward() and the repacks take them under.
        self.weight_bytes = {name: getattr(layout, field) for name, field in _WEIGHT_FIELDS}
        problem = ctypes.c_char_p()
        _check(_lib.moejit_moe_decode_problem(self._live(), ctypes.byref(problem)))
        # "" when decode_moe serves the shape (T <= 256, sm_90+), else why not.
        self.decode_problem = problem.value.decode()

    def close(self):
        """Release the library's handle: at once, or where a call on this layer is still running
        in another thread, when the last such call returns. Later calls say the layer is
        closed."""
        self._handle = None

    # Why no copies: a layer is one library handle, which a copy would share (or, deep, try to
    # duplicate, which _Handle refuses): share the object.
    def __copy__(self):
        raise TypeError("MoeLayer can't be copied: it owns a library handle; share the object")

    def __deepcopy__(self, memo):
        raise TypeError("MoeLayer can't be copied: it owns a library handle; share the object")

    def __reduce_ex__(self, protocol):
        raise TypeError("MoeLayer can't be pickled: its library handle belongs to this process; "
                        "create a MoeLayer in each process")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _live(self):
        """The handle, for one library call: pass it as the call's argument (not a value read
        from it), so the call holds it."""
        handle = self._handle
        if handle is None:
            raise InvalidArgument("MoeLayer({!r}) is closed".format(self.shape_name))
        return handle

    def bind_weights(self, weights):
        """The repacked buffers (a dict, as forward takes them) checked once, for many forwards."""
        self._live()  # a closed layer says so here, not at the first forward
        struct, kept, device = self._weights(weights, "weights", with_biases=True)
        return BoundWeights(self.shape_name, struct, kept, device)

    def workspace_bytes(self, max_tokens):
        """Device workspace bytes forward() needs for any T <= max_tokens."""
        out = ctypes.c_size_t()
        _check(_lib.moejit_moe_workspace_bytes(self._live(), _c_int("max_tokens", max_tokens),
                                               ctypes.byref(out)))
        return out.value

    def _weights(self, weights, what, with_biases):
        """moejit_moe_weights from a dict of CUDA tensors, each checked against its layout size,
        all on one device; the borrowed tensors are returned too (the caller keeps them until the
        call returns), and that device's index (None for no buffer)."""
        if not hasattr(weights, "get"):
            raise TypeError("{}: expected a dict of tensors named {}, found {}".format(
                what, [n for n, _ in _WEIGHT_FIELDS], type(weights).__name__))
        unknown = sorted(set(weights) - {n for n, _ in _WEIGHT_FIELDS})
        if unknown:
            raise InvalidArgument("{}: unknown buffer(s) {}; expected {}".format(
                what, unknown, [n for n, _ in _WEIGHT_FIELDS]))
        struct = _Weights(_WEIGHTS_SIZE)
        kept = []
        device, first = None, None
        for name, _ in _WEIGHT_FIELDS:
            size = self.weight_bytes[name]
            tensor = weights.get(name)
            if name in ("b13", "b2") and not with_biases:
                continue
            if tensor is None:
                if size:
                    raise InvalidArgument("{}[{!r}]: expected a CUDA buffer of {} bytes for {}, "
                                          "found none".format(what, name, size, self.shape_name))
                continue
            if not size:
                raise InvalidArgument("{}[{!r}]: {} has no biases; pass none".format(
                    what, name, self.shape_name))
            arg = "{}[{!r}]".format(what, name)
            address, _, borrowed, on = _device_buffer(tensor, arg, size)
            if first is None:
                device, first = on, arg
            _check_device(arg, on, device, first)
            setattr(struct, name, address)
            kept.append(borrowed if borrowed is not None else tensor)
        return struct, kept, device

    def repack_gpt_oss(self, w13_blocks, w13_scales, w2_blocks, w2_scales, target, first_expert=0,
                       bad_scale_count=None, stream=None):
        """Repack a gpt-oss checkpoint (w13 gate/up interleaved by row) into target["w13"],
        ["w13_scales"], ["w2"], ["w2_scales"]. bad_scale_count: optional int32 CUDA tensor [1]
        the repack adds the scales it can't dequantize exactly to."""
        inputs = [_Borrowed(t, n) for t, n in ((w13_blocks, "w13_blocks"),
                                                (w13_scales, "w13_scales"),
                                                (w2_blocks, "w2_blocks"), (w2_scales, "w2_scales"))]
        struct, keep_alive, counter, counter_borrow = self._repack_target(inputs, target,
                                                                          bad_scale_count)
        _check(_lib.moejit_moe_repack_gpt_oss(self._live(), *[b.address for b in inputs],
                                              ctypes.byref(struct),
                                              _c_int("first_expert", first_expert),
                                              counter, _stream_handle(stream)))

    def repack_separate(self, w1_blocks, w1_scales, w3_blocks, w3_scales, w2_blocks, w2_scales,
                        target, first_expert=0, bad_scale_count=None, stream=None):
        """Repack a checkpoint with w1 (gate), w3 (up) and w2 apart, one expert or a stack."""
        inputs = [_Borrowed(t, n) for t, n in ((w1_blocks, "w1_blocks"), (w1_scales, "w1_scales"),
                                                (w3_blocks, "w3_blocks"), (w3_scales, "w3_scales"),
                                                (w2_blocks, "w2_blocks"), (w2_scales, "w2_scales"))]
        struct, keep_alive, counter, counter_borrow = self._repack_target(inputs, target,
                                                                          bad_scale_count)
        _check(_lib.moejit_moe_repack_separate(self._live(), *[b.address for b in inputs],
                                               ctypes.byref(struct),
                                               _c_int("first_expert", first_expert),
                                               counter, _stream_handle(stream)))

    def _repack_target(self, inputs, target, bad_scale_count):
        """A repack's target struct and its borrows, and the optional counter's address and
        borrow (the caller holds the borrows until the call returns, as an address is valid only
        while its capsule lives), each on the checkpoint's device."""
        struct, keep_alive, on = self._weights(target, "target", with_biases=False)
        # A missing or host checkpoint is the library's to refuse, with its own message.
        checkpoint = inputs[0].tensor.device if inputs[0].address else None
        cuda = checkpoint is not None and checkpoint.device_type == _KDL_CUDA
        device = checkpoint.device_id if cuda else None
        reference = inputs[0].name
        if device is not None:
            _check_device("target", on, device, reference)
        if bad_scale_count is None:
            return struct, keep_alive, None, None
        borrowed = _Borrowed(bad_scale_count, "bad_scale_count")
        t = borrowed.tensor
        if t.dtype.code != 0 or t.dtype.bits != 32 or t.dtype.lanes != 1:
            raise InvalidArgument("bad_scale_count: expected an int32 tensor [1], found DLPack "
                                  "dtype (code {}, bits {}, lanes {})".format(
                                      t.dtype.code, t.dtype.bits, t.dtype.lanes))
        counter = borrowed.device_address(4)
        if device is not None:
            _check_device("bad_scale_count", t.device.device_id, device, reference)
        return struct, keep_alive, counter, borrowed

    def forward(self, hidden, topk_ids, topk_weights, weights, workspace, out, path="auto",
                decode_block_n=0, stream=None):
        """out [T, H] bf16 = the routed experts' layer of hidden [T, H] bf16 for topk_ids [T, K]
        and topk_weights [T, K] fp32. weights: the repacked buffers by name (with "b13" and "b2"
        for shapes with biases); workspace: a uint8 CUDA tensor of workspace_bytes(T) or more.
        path: "auto", "marlin" or "decode". No allocation, no host sync: capturable in a CUDA
        graph once prewarmed. Checking a dict of weights costs 7-14 us of Python a call on an
        H100 machine's host (tools/PERF_LOG.md, sixtieth session): bind them once (bind_weights)
        where that matters."""
        if not isinstance(path, str) or path not in _PATHS:
            raise InvalidArgument("path: expected one of {}, found {!r}".format(sorted(_PATHS),
                                                                                 path))
        if isinstance(weights, BoundWeights):
            if weights.shape_name != self.shape_name:
                raise InvalidArgument("weights: bound for shape {!r}, not {!r}".format(
                    weights.shape_name, self.shape_name))
            struct, weights_device = weights.struct, weights.device
        else:
            struct, keep_alive, weights_device = self._weights(weights, "weights",
                                                               with_biases=True)
        if workspace is None:
            raise InvalidArgument("workspace: expected a uint8 CUDA tensor of at least "
                                  "workspace_bytes(T) bytes, found None")
        address, size, space, workspace_device = _device_buffer(workspace, "workspace")
        free = _forward_slots.free  # this thread's (see _CallSlots)
        slots, kept = free.pop() if free else _forward_slots.new(), []
        try:
            hidden_address = _dltensor(slots[0], hidden, "hidden", kept)
            # The library checks each tensor's device; the buffers reach it as addresses alone.
            device = _tensor_device(hidden, hidden_address)
            if device is not None:
                _check_device("workspace", workspace_device, device, "hidden")
                if weights_device is not None:
                    _check_device("weights", weights_device, device, "hidden")
            _check(_lib.moejit_moe_forward_ex(
                self._live(), hidden_address, _dltensor(slots[1], topk_ids, "topk_ids", kept),
                _dltensor(slots[2], topk_weights, "topk_weights", kept), ctypes.byref(struct),
                address, size, _dltensor(slots[3], out, "out", kept), _PATHS[path],
                _c_int("decode_block_n", decode_block_n), _stream_handle(stream)))
        finally:
            free.append(slots)
