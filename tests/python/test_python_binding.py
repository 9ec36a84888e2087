"""The Python binding (src/python/moejit.py) against the library it loads.

    python3 test_python_binding.py cpu   # no GPU: shapes, sizes, prewarm with NVRTC, every check
                                         # the binding makes before a call, errors from the C ABI
    python3 test_python_binding.py gpu   # torch on a CUDA GPU: repack and forward against an fp64
                                         # reference; exits 77 (skipped) without one, saying why
    python3 test_python_binding.py gpu GpuTests.test_name...   # some cases of a group

ctest sets MOEJIT_LIBRARY (the build's libmoejit.so), PYTHONPATH (src/python) and
MOEJIT_TEST_SOURCE_DIR. Each run uses a fresh kernel cache of its own.
"""

import ctypes
import json
import os
import re
import sys
import tempfile
import threading
import unittest

_CACHE = tempfile.TemporaryDirectory(prefix="moejit-python-test-")
# A run of one case in a child process (GpuTests' pointer checks) reuses its parent's cache.
os.environ["MOEJIT_CACHE_DIR"] = os.environ.get("MOEJIT_TEST_PARENT_CACHE") or _CACHE.name
os.environ.pop("MOEJIT_CACHE_MODE", None)

import moejit  # noqa: E402 -- after the cache is chosen

TINY = {"name": "py-tiny", "num_experts": 16, "top_k": 2, "hidden": 512, "intermediate": 256,
        "activation": {"kind": "swiglu"}, "max_tokens": 8}
BIASED = {"name": "py-biased", "num_experts": 8, "top_k": 2, "hidden": 512, "intermediate": 256,
          "activation": {"kind": "gpt_oss", "limit": 7.0, "alpha": 1.702}, "has_bias": True,
          "max_tokens": 8}


def _register_once():
    if not getattr(_register_once, "done", False):
        moejit.register_shapes({"shapes": [TINY, BIASED]}, "python-test")
        _register_once.done = True


# ---- a DLPack producer without numpy ------------------------------------------------------------

class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", moejit.DLTensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p)]


_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_DLTENSOR = b"dltensor"  # lives as long as the module, as a capsule name must
_VERSIONED = b"dltensor_versioned"  # what a DLPack 1.x export is named
_USED = b"used_dltensor"  # what a consumer renames the capsule it took

CPU, CUDA = 1, 2
UINT8, INT32, BF16 = (1, 8), (0, 32), (4, 16)


class FakeTensor:
    """Exports a DLTensor through __dlpack__: host memory of its own, or (device CUDA) an address
    that is never read, for the checks the binding makes before it calls the library."""

    def __init__(self, shape, dtype=UINT8, device=CPU, strides=None, address=None):
        count = 1
        for n in shape:
            count *= n
        self.buffer = (ctypes.c_uint8 * max(1, count * dtype[1] // 8))()
        self.shape = (ctypes.c_int64 * len(shape))(*shape)
        self.strides = (ctypes.c_int64 * len(shape))(*strides) if strides else None
        self.managed = _DLManagedTensor()
        t = self.managed.dl_tensor
        t.data = address if address is not None else ctypes.addressof(self.buffer)
        t.device = moejit.DLDevice(device, 0)
        t.ndim = len(shape)
        t.dtype = moejit.DLDataType(dtype[0], dtype[1], 1)
        t.shape = ctypes.cast(self.shape, ctypes.POINTER(ctypes.c_int64))
        if self.strides is not None:
            t.strides = ctypes.cast(self.strides, ctypes.POINTER(ctypes.c_int64))
        self.device = (device, 0)

    def __dlpack_device__(self):
        return self.device

    capsule_name = _DLTENSOR

    def __dlpack__(self, stream=None):
        return _capsule_new(ctypes.addressof(self.managed), self.capsule_name, None)


def fake_weights(layer, **changes):
    """A layer's weight buffers as CUDA FakeTensors of the layout's sizes (never read), with
    changes: a name to another tensor, or to None to leave it out."""
    weights = {name: FakeTensor([n], device=CUDA, address=0x10000)
               for name, n in layer.weight_bytes.items() if n}
    weights.update(changes)
    return {k: v for k, v in weights.items() if v is not None}


def _driver_present():
    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


def _context_current():
    """Whether a CUDA context is current on this thread: only then does the library read a
    forward's tensors; without one it refuses the call (DriverError) before it looks at them."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    context = ctypes.c_void_p()
    return cuda.cuCtxGetCurrent(ctypes.byref(context)) == 0 and bool(context.value)


# ---- without a GPU ------------------------------------------------------------------------------

class CpuTests(unittest.TestCase):
    def setUp(self):
        _register_once()

    def test_version_is_the_built_library_and_this_abi(self):
        source = os.environ.get("MOEJIT_TEST_SOURCE_DIR")
        self.assertTrue(source, "MOEJIT_TEST_SOURCE_DIR is not set (run via ctest)")
        with open(os.path.join(source, "include", "moejit", "version.hpp")) as f:
            header = f.read()
        parts = [re.search(r"kVersion{}\s*=\s*(\d+)".format(p), header).group(1)
                 for p in ("Major", "Minor", "Patch")]
        self.assertEqual(moejit.version(), ".".join(parts))
        self.assertEqual(moejit.ABI, ".".join(parts[:2]))
        self.assertGreaterEqual(moejit.weight_layout_version(), 1)

    def test_set_check_pointers_returns_the_previous_setting(self):
        first = moejit.set_check_pointers(True)
        try:
            self.assertEqual(first, os.environ.get("MOEJIT_CHECK_POINTERS") == "1")
            self.assertIs(moejit.set_check_pointers(False), True)
            self.assertIs(moejit.set_check_pointers(False), False)
            with self.assertRaises(TypeError) as e:
                moejit.set_check_pointers(1)
            self.assertIn("set_check_pointers: on: expected a bool, found int", str(e.exception))
        finally:
            moejit.set_check_pointers(first)

    def test_registration_errors_name_the_source(self):
        with self.assertRaises(moejit.InvalidDescriptor) as e:
            moejit.register_shapes({"shapes": [TINY]}, "again")
        self.assertIn("again", str(e.exception))
        self.assertIn("python-test", str(e.exception))
        with self.assertRaises(moejit.InvalidDescriptor) as e:
            moejit.register_shapes('{"shapes": [{"name": 5}]}', "engine-config")
        self.assertIn("engine-config", str(e.exception))
        self.assertEqual(e.exception.status, 1)
        # A NaN or an infinity is named by its key, not as invalid JSON the caller never wrote.
        for bad in (float("nan"), float("inf")):
            clamped = dict(TINY, name="py-non-finite",
                           activation={"kind": "clamped_swiglu", "limit": bad})
            with self.assertRaises(moejit.InvalidDescriptor) as e:
                moejit.register_shapes({"shapes": [clamped]}, "engine-config")
            self.assertIn("engine-config: /shapes/0/activation/limit: expected a finite number",
                          str(e.exception))
        with self.assertRaises(moejit.MoejitError) as e:
            moejit.register_shapes_file(os.path.join(_CACHE.name, "missing.json"))
        self.assertIn("missing.json", str(e.exception))
        with self.assertRaises(moejit.InvalidArgument) as e:
            moejit.MoeLayer("py-no-such-shape")
        self.assertIn("py-no-such-shape", str(e.exception))

    def test_layer_sizes_follow_the_shape(self):
        with moejit.MoeLayer("py-tiny") as layer:
            e, h, i = TINY["num_experts"], TINY["hidden"], TINY["intermediate"]
            self.assertEqual(layer.weight_bytes, {
                "w13": e * 2 * i * h // 2, "w13_scales": e * 2 * i * h // 32,
                "w2": e * h * i // 2, "w2_scales": e * h * i // 32, "b13": 0, "b2": 0})
            self.assertEqual(layer.decode_problem, "")
            small, large = layer.workspace_bytes(1), layer.workspace_bytes(8)
            self.assertGreater(small, 0)
            self.assertGreaterEqual(large, small)
            with self.assertRaises(moejit.InvalidArgument) as e:
                layer.workspace_bytes(9)
            self.assertIn("max_tokens", str(e.exception))
        with self.assertRaises(moejit.InvalidArgument):
            layer.workspace_bytes(1)  # closed
        biased = moejit.MoeLayer("py-biased")
        e, h, i = BIASED["num_experts"], BIASED["hidden"], BIASED["intermediate"]
        self.assertEqual(biased.weight_bytes["b13"], e * 2 * i * 2)
        self.assertEqual(biased.weight_bytes["b2"], e * h * 2)
        self.assertIn("bias", biased.decode_problem)

    def test_prewarm_compiles_each_kernel_once_and_reports_it(self):
        seen = []
        result = moejit.prewarm(["py-tiny"], arch="sm_80", jobs=2,
                                progress=lambda *args: seen.append(args))
        self.assertGreater(result.kernels, 0)
        self.assertEqual(result.compiled, result.kernels)
        self.assertEqual(result.cached + result.not_stored + result.failed, 0)
        self.assertEqual(len(seen), result.kernels)
        self.assertEqual([s[3] for s in seen], list(range(1, result.kernels + 1)))
        self.assertTrue(all(s[1] == "compiled" and s[4] == result.kernels for s in seen))
        self.assertEqual(len({s[0] for s in seen}), result.kernels)

        again = moejit.prewarm("py-tiny", arch="sm_80")
        self.assertEqual(again.cached, result.kernels)

        # A callback's exception is raised once the call returns; the kernels are still built.
        def fail(*_):
            raise KeyError("from the callback")
        with self.assertRaises(KeyError):
            moejit.prewarm(["py-tiny"], arch="sm_80", progress=fail)

        # Why sm_75: NVRTC targets it, and py-tiny's marlin_moe and combine kernels need sm_80:
        # those fail with the planner's reason, without a compile; the others are ready.
        seen = []
        with self.assertRaises(moejit.CompileFailed) as e:
            moejit.prewarm(["py-tiny"], arch="sm_75", jobs=2,
                           progress=lambda *args: seen.append(args))
        message = str(e.exception)
        failed = [s[0] for s in seen if s[1] == "failed"]
        self.assertTrue(failed and len(failed) < len(seen), seen)
        self.assertIn("{} of {} kernel(s) failed (the others are ready)".format(
            len(failed), len(seen)), message)
        counts = e.exception.result
        self.assertEqual((counts.kernels, counts.failed, counts.compiled),
                         (len(seen), len(failed), len(seen) - len(failed)))
        for kernel in failed:
            self.assertTrue(kernel.endswith("@sm_75"), kernel)
            self.assertTrue(kernel.startswith(("marlin_moe<", "combine<")), kernel)
            self.assertIn("\n  " + kernel + ":\n    ", message)
        self.assertIn("needs sm_80 or newer", message)

        # An arch no NVRTC targets is the call's error, before any kernel.
        seen = []
        with self.assertRaises(moejit.InvalidArgument) as e:
            moejit.prewarm(["py-tiny"], arch="sm_71", progress=lambda *args: seen.append(args))
        self.assertIn("arch sm_71: sm_71 is not a target of this NVRTC", str(e.exception))
        self.assertEqual(seen, [])

        with self.assertRaises(moejit.InvalidArgument) as e:
            moejit.prewarm([], arch="sm_80")
        self.assertIn("shape_names", str(e.exception))
        with self.assertRaises(moejit.InvalidArgument) as e:
            moejit.prewarm(["py-tiny"], arch="sm80")
        self.assertIn("arch", str(e.exception))
        if not _driver_present():
            with self.assertRaises(moejit.DriverError) as e:
                moejit.prewarm(["py-tiny"])
            self.assertIn("arch: null asks for the current CUDA context's device", str(e.exception))

    def test_buffers_are_checked_before_the_call(self):
        layer = moejit.MoeLayer("py-tiny")
        hidden = FakeTensor([1, 512], BF16)
        ids = FakeTensor([1, 2], INT32)
        topk = FakeTensor([1, 2], (2, 32))
        out = FakeTensor([1, 512], BF16)
        space = FakeTensor([layer.workspace_bytes(1)], device=CUDA, address=0x20000)
        need = layer.weight_bytes

        def refused(part, **changes):
            weights = changes.pop("weights", None) or fake_weights(layer)
            args = dict(hidden=hidden, topk_ids=ids, topk_weights=topk, weights=weights,
                        workspace=space, out=out)
            args.update(changes)
            with self.assertRaises(moejit.InvalidArgument) as e:
                layer.forward(**args)
            self.assertIn(part, str(e.exception))

        refused("weights['w2']: expected a CUDA buffer of {} bytes".format(need["w2"]),
                weights=fake_weights(layer, w2=None))
        refused("weights['w13']: expected a CUDA tensor",
                weights=fake_weights(layer, w13=FakeTensor([need["w13"]])))
        refused("weights['w13_scales']: expected at least {} bytes, found {}".format(
            need["w13_scales"], need["w13_scales"] - 1),
            weights=fake_weights(layer, w13_scales=FakeTensor(
                [need["w13_scales"] - 1], device=CUDA, address=0x10000)))
        refused("weights['w2_scales']: expected a contiguous tensor",
                weights=fake_weights(layer, w2_scales=FakeTensor(
                    [2, need["w2_scales"]], device=CUDA, strides=[1, 2], address=0x10000)))
        refused("unknown buffer(s) ['w4']",
                weights=fake_weights(layer, w4=FakeTensor([1], device=CUDA, address=0x10000)))
        refused("weights['b13']: py-tiny has no biases",
                weights=fake_weights(layer, b13=FakeTensor([8], device=CUDA, address=0x10000)))
        refused("workspace: expected a uint8 CUDA tensor", workspace=None)
        refused("workspace: expected a CUDA tensor", workspace=FakeTensor([16]))
        refused("path: expected one of", path="fast")
        # Bound weights are checked once, when bound, and only serve their own shape.
        with self.assertRaises(moejit.InvalidArgument) as e:
            layer.bind_weights(fake_weights(layer, w2=None))
        self.assertIn("weights['w2']", str(e.exception))
        bound = layer.bind_weights(fake_weights(layer))
        self.assertEqual(bound.struct.w13, 0x10000)
        refused("workspace: expected a CUDA tensor", workspace=FakeTensor([16]), weights=bound)
        with self.assertRaises(moejit.InvalidArgument) as e:
            moejit.MoeLayer("py-biased").forward(hidden, ids, topk, bound, space, out)
        self.assertIn("weights: bound for shape 'py-tiny', not 'py-biased'", str(e.exception))
        with self.assertRaises(TypeError) as e:
            layer.forward(object(), ids, topk, fake_weights(layer), space, out)
        self.assertIn("hidden: expected a tensor with __dlpack__", str(e.exception))
        with self.assertRaises(moejit.InvalidArgument):
            layer.repack_separate(None, None, None, None, None, None,
                                  fake_weights(layer, w2=None))
        with self.assertRaises(TypeError):
            layer.forward(hidden, ids, topk, fake_weights(layer), space, out, stream="s")

    def test_buffers_on_another_device_and_wide_ints_are_refused(self):
        layer = moejit.MoeLayer("py-tiny")

        def on(device, tensor):
            tensor.managed.dl_tensor.device.device_id = device
            return tensor

        hidden = FakeTensor([1, 512], BF16, device=CUDA, address=0x30000)
        ids = FakeTensor([1, 2], INT32, device=CUDA, address=0x40000)
        topk = FakeTensor([1, 2], (2, 32), device=CUDA, address=0x50000)
        out = FakeTensor([1, 512], BF16, device=CUDA, address=0x60000)
        space = FakeTensor([layer.workspace_bytes(1)], device=CUDA, address=0x20000)
        # The buffers reach the library as addresses: the binding compares their devices.
        elsewhere = {n: on(3, FakeTensor([b], device=CUDA, address=0x10000))
                     for n, b in layer.weight_bytes.items() if b}
        for weights in (elsewhere, layer.bind_weights(elsewhere)):
            with self.assertRaises(moejit.InvalidArgument) as e:
                layer.forward(hidden, ids, topk, weights, space, out)
            self.assertIn("weights: on CUDA device 3, but hidden is on device 0: a call's "
                          "tensors and buffers must all be on one device", str(e.exception))
        far = on(5, FakeTensor([layer.workspace_bytes(1)], device=CUDA, address=0x20000))
        with self.assertRaises(moejit.InvalidArgument) as e:
            layer.forward(hidden, ids, topk, fake_weights(layer), far, out)
        self.assertIn("workspace: on CUDA device 5, but hidden is on device 0",
                      str(e.exception))
        # hidden the odd one out: the message names both devices, blaming neither.
        with self.assertRaises(moejit.InvalidArgument) as e:
            layer.forward(on(1, FakeTensor([1, 512], BF16, device=CUDA, address=0x30000)), ids,
                          topk, fake_weights(layer), space, out)
        self.assertIn("workspace: on CUDA device 0, but hidden is on device 1",
                      str(e.exception))
        mixed = fake_weights(layer, w2=on(1, FakeTensor([layer.weight_bytes["w2"]], device=CUDA,
                                                         address=0x10000)))
        with self.assertRaises(moejit.InvalidArgument) as e:
            layer.bind_weights(mixed)
        self.assertIn("weights['w2']: on CUDA device 1, but weights['w13'] is on device 0",
                      str(e.exception))
        # A repack target or counter away from the checkpoint.
        blocks = FakeTensor([1], device=CUDA, address=0x70000)
        with self.assertRaises(moejit.InvalidArgument) as e:
            layer.repack_separate(blocks, blocks, blocks, blocks, blocks, blocks, elsewhere)
        self.assertIn("target: on CUDA device 3, but w1_blocks is on device 0",
                      str(e.exception))
        counter = on(2, FakeTensor([1], INT32, device=CUDA, address=0x80000))
        with self.assertRaises(moejit.InvalidArgument) as e:
            layer.repack_separate(blocks, blocks, blocks, blocks, blocks, blocks,
                                  fake_weights(layer), bad_scale_count=counter)
        self.assertIn("bad_scale_count: on CUDA device 2, but w1_blocks is on device 0",
                      str(e.exception))
        # ctypes keeps an int's low bits: 2**32 + 1 tokens must not read as 1.
        for bad in (2**32 + 1, -2**31 - 1):
            with self.assertRaises(moejit.InvalidArgument) as e:
                layer.workspace_bytes(bad)
            self.assertIn("max_tokens: expected a 32-bit integer", str(e.exception))
        with self.assertRaises(moejit.InvalidArgument) as e:
            layer.repack_separate(blocks, blocks, blocks, blocks, blocks, blocks,
                                  fake_weights(layer), first_expert=2**32)
        self.assertIn("first_expert: expected a 32-bit integer", str(e.exception))
        # int() would cut a float down: 2.5 tokens or experts must not read as 2.
        with self.assertRaises(TypeError) as e:
            layer.workspace_bytes(256.9)
        self.assertIn("max_tokens: expected an int, found float", str(e.exception))
        with self.assertRaises(TypeError) as e:
            layer.repack_separate(blocks, blocks, blocks, blocks, blocks, blocks,
                                  fake_weights(layer), first_expert=2.5)
        self.assertIn("first_expert: expected an int, found float", str(e.exception))

    def test_strings_streams_and_null_buffers_reach_the_library_as_given(self):
        # A NUL would end the C string early: the rest of the text silently dropped.
        later = dict(TINY, name="py-after-nul")
        cases = [
            ("shapes", lambda: moejit.register_shapes(
                '{"shapes": []}\0' + json.dumps({"shapes": [later]}))),
            ("source_name", lambda: moejit.register_shapes({"shapes": [later]}, "a\0b")),
            ("path", lambda: moejit.register_shapes_file("shapes.json\0.bak")),
            ("shape_name", lambda: moejit.MoeLayer("py-tiny\0x")),
            ("shape_names[1]", lambda: moejit.prewarm(["py-tiny", "py-tiny\0"], arch="sm_80")),
            ("arch", lambda: moejit.prewarm(["py-tiny"], arch="sm_80\0junk")),
        ]
        for name, call in cases:
            with self.assertRaises(moejit.InvalidArgument) as e:
                call()
            self.assertIn(name + ": expected text without NUL characters", str(e.exception))
        with self.assertRaises(moejit.InvalidArgument):
            moejit.MoeLayer("py-after-nul")  # never registered
        # An empty arch is the library's to refuse, not "the current device".
        with self.assertRaises(moejit.InvalidArgument) as e:
            moejit.prewarm(["py-tiny"], arch="")
        self.assertIn("arch", str(e.exception))
        # A stream handle ctypes would wrap into another one, or a bool, is refused.
        ids = FakeTensor([1, 2], INT32, device=CUDA, address=0x40000)
        for bad in (-1, 2**64 + 5):
            with self.assertRaises(moejit.InvalidArgument) as e:
                moejit.append_shared(ids, ids, ids, ids, ids, 0, 1.0, stream=bad)
            self.assertIn("stream: expected a CUstream handle (0 to 2**64 - 1), found "
                          + str(bad), str(e.exception))
        with self.assertRaises(TypeError):
            moejit.append_shared(ids, ids, ids, ids, ids, 0, 1.0, stream=True)

        class Foreign:
            cuda_stream = -5

        with self.assertRaises(moejit.InvalidArgument):
            moejit.append_shared(ids, ids, ids, ids, ids, 0, 1.0, stream=Foreign())
        # Null data with a byte offset stays null (the library refuses it by name), never an
        # address made of the offset alone.
        layer = moejit.MoeLayer("py-tiny")
        null = FakeTensor([layer.weight_bytes["w13"]], device=CUDA, address=0)
        null.managed.dl_tensor.byte_offset = 256
        bound = layer.bind_weights(fake_weights(layer, w13=null))
        self.assertFalse(bound.struct.w13)
        self.assertEqual(bound.struct.w2, 0x10000)

    def test_a_layer_is_never_copied_and_closes_once(self):
        import copy
        layer = moejit.MoeLayer("py-tiny")
        for duplicate in (copy.copy, copy.deepcopy):
            with self.assertRaises(TypeError):
                duplicate(layer)
        # Closed from many threads at once, the handle is destroyed once (a double destroy
        # aborted the interpreter); then every call says the layer is closed. A short switch
        # interval lets another thread run inside close() (the double destroy came in ~20 tries).
        interval = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)
        self.addCleanup(sys.setswitchinterval, interval)
        for _ in range(50):
            layer = moejit.MoeLayer("py-tiny")
            start = threading.Barrier(8)

            def close():
                start.wait()
                layer.close()

            threads = [threading.Thread(target=close) for _ in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            with self.assertRaises(moejit.InvalidArgument) as e:
                layer.workspace_bytes(1)
            self.assertIn("is closed", str(e.exception))
        # Binding weights to a closed layer says so then, not at the first forward.
        with self.assertRaises(moejit.InvalidArgument) as e:
            layer.bind_weights(fake_weights(layer))
        self.assertIn("MoeLayer('py-tiny') is closed", str(e.exception))

    def test_what_the_binding_refuses_names_the_argument(self):
        # Checks made in Python, before any library call: each names its argument.
        with self.assertRaises(TypeError) as e:
            moejit.register_shapes_file(None)
        self.assertIn("register_shapes_file: path: expected a str, bytes or os.PathLike, found "
                      "NoneType", str(e.exception))
        with self.assertRaises(TypeError) as e:
            moejit.prewarm(None, arch="sm_80")
        self.assertIn("prewarm: shape_names: expected a shape name or a list of them, found "
                      "NoneType", str(e.exception))
        for scale, found in ((None, "NoneType"), ("2.5", "str"), (b"2", "bytes")):
            with self.assertRaises(TypeError) as e:
                moejit.append_shared(None, None, None, None, None, 0, scale)
            self.assertIn("scale: expected a real number, found " + found, str(e.exception))
        layer = moejit.MoeLayer("py-tiny")
        space = FakeTensor([layer.workspace_bytes(1)], device=CUDA, address=0x20000)
        for path in (["auto"], None, 1):
            with self.assertRaises(moejit.InvalidArgument) as e:
                layer.forward(None, None, None, fake_weights(layer), space, None, path=path)
            self.assertIn("path: expected one of ['auto', 'decode', 'marlin'], found",
                          str(e.exception))
        blocks = FakeTensor([1], device=CUDA, address=0x70000)
        counter = FakeTensor([1], (2, 32), device=CUDA, address=0x80000)
        with self.assertRaises(moejit.InvalidArgument) as e:
            layer.repack_separate(blocks, blocks, blocks, blocks, blocks, blocks,
                                  fake_weights(layer), bad_scale_count=counter)
        self.assertIn("bad_scale_count: expected an int32 tensor [1], found DLPack dtype (code 2, "
                      "bits 32, lanes 1)", str(e.exception))
        # A DLPack export the C ABI can't take: a versioned capsule, or one already consumed.
        for capsule_name in (_VERSIONED, _USED):
            tensor = FakeTensor([1, 512], BF16, device=CUDA, address=0x30000)
            tensor.capsule_name = capsule_name
            with self.assertRaises(moejit.InvalidArgument) as e:
                layer.forward(tensor, None, None, fake_weights(layer), space, None)
            self.assertIn("hidden: a FakeTensor whose __dlpack__() did not give an unused, "
                          "unversioned DLPack capsule (\"dltensor\")", str(e.exception))
        # JSON text as UTF-8 bytes registers as a str would.
        moejit.register_shapes(json.dumps({"shapes": [dict(TINY, name="py-bytes")]}).encode(),
                               "bytes-text")
        self.assertEqual(moejit.MoeLayer("py-bytes").weight_bytes, layer.weight_bytes)

    def test_a_call_in_flight_keeps_a_closed_layers_handle(self):
        # A call holds its arguments until it returns, so the handle it was passed is destroyed
        # after the call, never under it: here the "call" is a reference held the same way.
        destroyed = []
        destroy = moejit._lib.moejit_moe_destroy
        moejit._lib.moejit_moe_destroy = lambda handle: (destroyed.append(handle.value),
                                                         destroy(handle))
        self.addCleanup(setattr, moejit._lib, "moejit_moe_destroy", destroy)
        layer = moejit.MoeLayer("py-tiny")
        in_flight = layer._live()
        layer.close()
        with self.assertRaises(moejit.InvalidArgument) as e:
            layer.workspace_bytes(1)
        self.assertIn("is closed", str(e.exception))
        self.assertEqual(destroyed, [])
        out = ctypes.c_size_t()
        self.assertEqual(moejit._lib.moejit_moe_workspace_bytes(in_flight, 1, ctypes.byref(out)),
                         0)  # the library still serves the handle
        self.assertGreater(out.value, 0)
        address = in_flight.value
        del in_flight
        self.assertEqual(destroyed, [address])
        # Closed with nothing in flight (or collected), the handle goes at once, and once.
        layer = moejit.MoeLayer("py-tiny")
        address = layer._live().value
        layer.close()
        layer.close()
        self.assertEqual(len(destroyed), 2)
        self.assertEqual(destroyed[-1], address)
        layer = moejit.MoeLayer("py-tiny")
        address = layer._live().value
        del layer
        self.assertEqual(destroyed[-1], address)
        self.assertEqual(len(destroyed), 3)

    def test_a_layer_and_its_bound_weights_are_never_pickled(self):
        import copy
        import pickle
        layer = moejit.MoeLayer("py-tiny")
        # A pickled handle would be destroyed by each copy, in another process an address that
        # means nothing there; bound weights would carry this process's device addresses.
        with self.assertRaises(TypeError) as e:
            pickle.dumps(layer)
        self.assertIn("create a MoeLayer in each process", str(e.exception))
        for duplicate in (copy.copy, copy.deepcopy, pickle.dumps):
            with self.assertRaises(TypeError) as e:
                duplicate(layer._live())
            self.assertIn("handle can't be copied or pickled", str(e.exception))
        bound = moejit.BoundWeights("py-tiny", moejit._Weights(), [], 0)
        with self.assertRaises(TypeError) as e:
            pickle.dumps(bound)
        self.assertIn("bind the weights in each process", str(e.exception))
        self.assertIs(copy.copy(bound), bound)  # in this process it never changes
        self.assertIs(copy.deepcopy(bound), bound)

    def test_what_dlpack_refuses_and_a_missing_tensor_are_named(self):
        layer = moejit.MoeLayer("py-tiny")
        ids = FakeTensor([1, 2], INT32)
        topk = FakeTensor([1, 2], (2, 32))
        out = FakeTensor([1, 512], BF16)
        space = FakeTensor([layer.workspace_bytes(1)], device=CUDA, address=0x20000)

        class Refused(FakeTensor):
            def __dlpack__(self, stream=None):
                raise RuntimeError("this layout has no strides")

        for position, name in enumerate(("hidden", "topk_ids", "topk_weights", "out")):
            args = [FakeTensor([1, 512], BF16), ids, topk, out]
            args[position] = Refused([1, 2])
            with self.assertRaises(moejit.InvalidArgument) as e:
                layer.forward(args[0], args[1], args[2], fake_weights(layer), space, args[3])
            self.assertEqual(str(e.exception), "{}: a Refused that DLPack can't export: this "
                             "layout has no strides".format(name))
            self.assertIsInstance(e.exception.__cause__, RuntimeError)
        with self.assertRaises(moejit.InvalidArgument) as e:
            layer.forward(FakeTensor([1, 512], BF16), ids, topk,
                          fake_weights(layer, w13=Refused([1])), space, out)
        self.assertIn("weights['w13']: a Refused that DLPack can't export", str(e.exception))
        # No hidden at all reaches the library (before, a ctypes TypeError that named nothing):
        # with a current context it refuses the null pointer by name, else the missing context.
        if _context_current():
            with self.assertRaises(moejit.InvalidArgument) as e:
                layer.forward(None, ids, topk, fake_weights(layer), space, out)
            self.assertIn("moejit_moe_forward_ex: hidden", str(e.exception))
            self.assertIn("a null DLTensor pointer", str(e.exception))
        else:
            with self.assertRaises(moejit.DriverError):
                layer.forward(None, ids, topk, fake_weights(layer), space, out)

    def test_library_errors_reach_python_with_the_c_names(self):
        layer = moejit.MoeLayer("py-tiny")
        hidden = FakeTensor([1, 512], BF16)
        space = FakeTensor([layer.workspace_bytes(1)], device=CUDA, address=0x20000)
        if _context_current():
            # A current context: the library refuses the host tensor before any launch.
            with self.assertRaises(moejit.InvalidArgument) as e:
                layer.forward(hidden, FakeTensor([1, 2], INT32), FakeTensor([1, 2], (2, 32)),
                              fake_weights(layer), space, FakeTensor([1, 512], BF16))
            self.assertIn("moejit_moe_forward_ex: hidden", str(e.exception))
        else:
            with self.assertRaises(moejit.DriverError) as e:
                layer.forward(hidden, FakeTensor([1, 2], INT32), FakeTensor([1, 2], (2, 32)),
                              fake_weights(layer), space, FakeTensor([1, 512], BF16))
            self.assertEqual(e.exception.status, 7)
            with self.assertRaises(moejit.DriverError):
                moejit.append_shared(None, None, None, None, None, 64, 1.0)
        with self.assertRaises(moejit.InvalidArgument) as e:
            moejit.append_shared(None, None, None, None, None, 64, 1.0, gate="softmax")
        self.assertIn("gate", str(e.exception))


# ---- torch tensors without a GPU ----------------------------------------------------------------

def _torch_or_skip(case):
    try:
        import torch
    except ImportError as e:
        case.skipTest("torch is not importable ({}): the binding's torch fill is untested "
                      "here".format(e))
    return torch


def _dlpack_view(tensor):
    """(data + byte_offset, device, ndim, dtype, shape, strides or None) of torch's own export."""
    capsule = tensor.__dlpack__()
    t = moejit.DLTensor.from_address(moejit._capsule_pointer(capsule, _DLTENSOR))
    shape = [t.shape[i] for i in range(t.ndim)]
    strides = [t.strides[i] for i in range(t.ndim)] if t.strides else None
    return ((t.data or 0) + t.byte_offset, (t.device.device_type, t.device.device_id), t.ndim,
            (t.dtype.code, t.dtype.bits, t.dtype.lanes), shape, strides, capsule)


class TorchFillTests(unittest.TestCase):
    """forward and append_shared describe exact torch tensors in DLTensors of their own (the
    binding's fill), not through __dlpack__: each must say what torch's export says."""

    def test_filled_tensors_say_what_torch_exports(self):
        torch = _torch_or_skip(self)
        base = torch.arange(6 * 40, dtype=torch.float32).reshape(6, 40)
        cases = {
            "bf16 [4, 512]": torch.randn(4, 512).to(torch.bfloat16),
            "int32 [3, 2]": torch.arange(6, dtype=torch.int32).reshape(3, 2),
            "uint8 [1000]": torch.zeros(1000, dtype=torch.uint8),
            "float32 transposed": base.t(),
            "float32 slice with an offset": base[2:, 3:17],
            "int64 expanded row": torch.arange(5).expand(3, 5),
            "float16 0-dim": torch.tensor(1.5, dtype=torch.float16),
            "int8 8-dim": torch.zeros([2, 1, 3, 1, 2, 1, 2, 1], dtype=torch.int8),
            "float64 empty": torch.empty(0, 7, dtype=torch.float64),
        }
        slot = moejit._Slot()
        for what, tensor in cases.items():
            address = slot.fill(tensor)
            self.assertEqual(address, slot.address, what)
            got = moejit.DLTensor.from_address(address)
            data, device, ndim, dtype, shape, strides, _ = _dlpack_view(tensor)
            self.assertEqual(got.data or 0, data, what)
            self.assertEqual(got.byte_offset, 0, what)
            self.assertEqual((got.device.device_type, got.device.device_id), device, what)
            self.assertEqual(got.ndim, ndim, what)
            self.assertEqual((got.dtype.code, got.dtype.bits, got.dtype.lanes), dtype, what)
            self.assertEqual([got.shape[i] for i in range(ndim)], shape, what)
            # A dimension of one element has no meaningful stride (torch's export may rewrite it,
            # and the library ignores it); every other stride must agree, or be compact where the
            # export gives none.
            if strides is None:
                strides, count = [0] * ndim, 1
                for i in reversed(range(ndim)):
                    strides[i], count = count, count * shape[i]
            for i in range(ndim):
                if shape[i] != 1:
                    self.assertEqual(got.strides[i], strides[i], "{}: dim {}".format(what, i))

    def test_what_the_fill_leaves_to_dlpack(self):
        torch = _torch_or_skip(self)
        slot = moejit._Slot()
        leaves = {
            "a tensor that requires grad": torch.zeros(4, requires_grad=True),
            "a subclass": torch.nn.Parameter(torch.zeros(4), requires_grad=False),
            "complex64": torch.zeros(4, dtype=torch.complex64),
            "bool": torch.zeros(4, dtype=torch.bool),
            "nine dims": torch.zeros([1] * 9),
            "the negative bit": torch._neg_view(torch.zeros(4)),
            "not a tensor": FakeTensor([4]),
            "None": None,
        }
        for what, obj in leaves.items():
            self.assertIsNone(slot.fill(obj), what)
        # What DLPack refuses reaches the caller by the argument's name, with torch's message.
        kept = []
        with self.assertRaises(moejit.InvalidArgument) as e:
            moejit._dltensor(slot, leaves["a tensor that requires grad"], "hidden", kept)
        self.assertTrue(str(e.exception).startswith("hidden: a Tensor that DLPack can't export: "),
                        str(e.exception))
        self.assertIn("grad", str(e.exception))
        # What it accepts is borrowed and kept for the call.
        address = moejit._dltensor(slot, leaves["a subclass"], "hidden", kept)
        self.assertEqual(len(kept), 1)
        self.assertEqual(address, kept[0].address)
        self.assertEqual(moejit.DLTensor.from_address(address).data,
                         leaves["a subclass"].data_ptr())

    def test_each_thread_fills_its_own_tensors(self):
        import threading
        seen = []
        worker = threading.Thread(target=lambda: seen.append(moejit._forward_slots.free[0]))
        worker.start()
        worker.join()
        mine = moejit._forward_slots.free[0]
        self.assertEqual(len(mine), 4)
        self.assertEqual(len(seen), 1)
        self.assertTrue(all(a.address != b.address for a in mine for b in seen[0]))

    def test_a_call_made_inside_another_on_its_thread_keeps_each_ones_tensors(self):
        # The binding runs user code between its fills (here decode_block_n's __index__; a stream's
        # __cuda_stream__ or a tensor's __dlpack__ could do the same), and a forward called from
        # there must not refill the slots the outer call has filled. The library's entry point is
        # replaced by a recorder of what each call's DLTensors say when it is made.
        torch = _torch_or_skip(self)
        _register_once()
        layer = moejit.MoeLayer("py-tiny")
        weights = fake_weights(layer)
        space = FakeTensor([layer.workspace_bytes(8)], device=CUDA, address=0x20000)
        seen = []

        def record(handle, hidden, ids, topk, weights, space, size, out, path, block_n, stream):
            seen.append([moejit.DLTensor.from_address(a).shape[0] for a in (hidden, ids, topk,
                                                                              out)])
            return 0

        forward = moejit._lib.moejit_moe_forward_ex
        moejit._lib.moejit_moe_forward_ex = record
        self.addCleanup(setattr, moejit._lib, "moejit_moe_forward_ex", forward)

        def tensors(tokens):
            return (torch.zeros(tokens, 512, dtype=torch.bfloat16),
                    torch.zeros(tokens, 2, dtype=torch.int32), torch.zeros(tokens, 2),
                    torch.zeros(tokens, 512, dtype=torch.bfloat16))

        outer, inner = tensors(3), tensors(5)

        class BlockN:
            def __index__(self):
                hidden, ids, topk, out = inner
                layer.forward(hidden, ids, topk, weights, space, out)
                return 0

        hidden, ids, topk, out = outer
        sets = len(moejit._forward_slots.free)
        layer.forward(hidden, ids, topk, weights, space, out, decode_block_n=BlockN())
        self.assertEqual(seen, [[5] * 4, [3] * 4])  # the inner call returns first
        # Both sets are free again (the inner call's made anew where none was free), kept for the
        # next such call.
        self.assertEqual(len(moejit._forward_slots.free), max(sets, 2))

    def test_torch_host_tensors_are_refused_by_name(self):
        torch = _torch_or_skip(self)
        _register_once()
        layer = moejit.MoeLayer("py-tiny")
        weights = fake_weights(layer)
        hidden = torch.zeros(1, 512, dtype=torch.bfloat16)
        ids = torch.zeros(1, 2, dtype=torch.int32)
        topk = torch.zeros(1, 2)
        out = torch.zeros(1, 512, dtype=torch.bfloat16)
        with self.assertRaises(moejit.InvalidArgument) as e:
            layer.forward(hidden, ids, topk, weights, torch.zeros(1 << 20, dtype=torch.uint8), out)
        self.assertIn("workspace: expected a CUDA tensor", str(e.exception))
        space = FakeTensor([layer.workspace_bytes(1)], device=CUDA, address=0x20000)
        if _context_current():
            with self.assertRaises(moejit.InvalidArgument) as e:
                layer.forward(hidden, ids, topk, weights, space, out)
            self.assertIn("moejit_moe_forward_ex: hidden", str(e.exception))
        else:
            with self.assertRaises(moejit.DriverError) as e:
                layer.forward(hidden, ids, topk, weights, space, out)
            self.assertEqual(e.exception.status, 7)


# ---- on a GPU, with torch -----------------------------------------------------------------------

def gpu_unavailable():
    """Why the GPU group can't run here, or "" when it can."""
    try:
        import torch
    except ImportError as e:
        return "torch is not importable ({})".format(e)
    if not torch.cuda.is_available():
        return "torch sees no CUDA GPU"
    return ""


E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


class GpuTests(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        import torch
        cls.torch = torch
        _register_once()
        torch.cuda.init()
        torch.zeros(1, device="cuda")  # the primary context, current on this thread
        result = moejit.prewarm(["py-tiny", "py-biased"])  # the device's arch, loaded
        assert result.failed == 0, result

    def generator(self):
        """A CUDA generator from a fresh seed, so each run tests fresh inputs. The seed is printed
        with the test's name; MOEJIT_TEST_SEED=<seed> replays it."""
        seed = int(os.environ.get("MOEJIT_TEST_SEED") or
                   int.from_bytes(os.urandom(8), "little") >> 1)
        sys.stderr.write("{}: seed {}\n".format(self.id(), seed))
        return self.torch.Generator(device="cuda").manual_seed(seed)

    def dequant(self, blocks, scales):
        """[n, rows, K/32, 16] uint8 nibbles and [n, rows, K/32] E8M0 -> [n, rows, K] float64."""
        torch = self.torch
        table = torch.tensor(E2M1, dtype=torch.float64, device=blocks.device)
        low = table[(blocks & 0xF).long()]
        high = table[(blocks >> 4).long()]
        values = torch.stack([low, high], dim=-1).reshape(*blocks.shape[:-1], 32)
        values = values * torch.pow(2.0, scales.double() - 127).unsqueeze(-1)
        return values.reshape(blocks.shape[0], blocks.shape[1], -1)

    def routed_tokens(self, gen, tokens, hidden_size, experts, top_k):
        """hidden [T, H] bf16, distinct ids [T, K] int32 and top-k weights [T, K] fp32."""
        torch = self.torch
        hidden = torch.randn(tokens, hidden_size, device="cuda", generator=gen)
        ids = torch.stack([torch.randperm(experts, device="cuda", generator=gen)[:top_k]
                           for _ in range(tokens)]).to(torch.int32)
        topk = torch.rand(tokens, top_k, device="cuda", generator=gen)
        return hidden.to(torch.bfloat16), ids, topk

    def reference(self, hidden, ids, topk, expert):
        """fp64: out[t] = the sum over slots s with an id e >= 0 of topk[t, s] * expert(e, x[t])."""
        torch = self.torch
        x = hidden.double()
        want = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
        for t in range(ids.shape[0]):
            for s in range(ids.shape[1]):
                ex = int(ids[t, s])
                if ex >= 0:
                    want[t] += float(topk[t, s]) * expert(ex, x[t])
        return want

    def forwards_alone(self, gen, layer, bound, token_counts):
        """Per T: routed tokens (hidden, ids, topk), a workspace of their own, and the output
        (NaN-poisoned first) of the forward run alone, on the current stream."""
        torch = self.torch
        e, k, h = TINY["num_experts"], TINY["top_k"], TINY["hidden"]
        jobs = []
        for tokens in token_counts:
            hidden, ids, topk = self.routed_tokens(gen, tokens, h, e, k)
            workspace = torch.empty(layer.workspace_bytes(tokens), dtype=torch.uint8,
                                    device="cuda")
            alone = torch.full((tokens, h), float("nan"), dtype=torch.bfloat16, device="cuda")
            layer.forward(hidden, ids, topk, bound, workspace, alone)
            jobs.append((hidden, ids, topk, workspace, alone))
        return jobs

    def tiny_layer(self, gen):
        """py-tiny's layer, its repacked weights (a dict of CUDA buffers) and the checkpoint they
        came from: random nibbles, scales 2^-7 .. 2^3 (w1, w1_s, w3, w3_s, w2, w2_s)."""
        torch = self.torch
        e, h, i = TINY["num_experts"], TINY["hidden"], TINY["intermediate"]

        def nibbles(rows, cols):
            return torch.randint(0, 256, (e, rows, cols // 32, 16), dtype=torch.uint8,
                                 device="cuda", generator=gen)

        def scales(rows, cols):
            return torch.randint(120, 131, (e, rows, cols // 32), dtype=torch.uint8,
                                 device="cuda", generator=gen)

        checkpoint = (nibbles(i, h), scales(i, h), nibbles(i, h), scales(i, h), nibbles(h, i),
                      scales(h, i))
        layer = moejit.MoeLayer("py-tiny")
        weights = {name: torch.empty(n, dtype=torch.uint8, device="cuda")
                   for name, n in layer.weight_bytes.items() if n}
        bad = torch.zeros(1, dtype=torch.int32, device="cuda")
        layer.repack_separate(*checkpoint, weights, bad_scale_count=bad)
        torch.cuda.synchronize()
        self.assertEqual(int(bad.item()), 0)
        return layer, weights, checkpoint

    def test_repack_and_forward_match_fp64_on_every_path_and_in_a_graph(self):
        torch = self.torch
        gen = self.generator()
        e, k, h = TINY["num_experts"], TINY["top_k"], TINY["hidden"]
        layer, weights, (w1, w1_s, w3, w3_s, w2, w2_s) = self.tiny_layer(gen)
        g, u, d = self.dequant(w1, w1_s), self.dequant(w3, w3_s), self.dequant(w2, w2_s)
        workspace = torch.empty(layer.workspace_bytes(8), dtype=torch.uint8, device="cuda")
        for tokens in (1, 3, 8):
            hidden, ids, topk = self.routed_tokens(gen, tokens, h, e, k)
            ids[0, -1] = -1  # ignored

            def swiglu_expert(ex, x):
                gate, up = g[ex] @ x, u[ex] @ x
                return d[ex] @ (gate * torch.sigmoid(gate) * up)

            want = self.reference(hidden, ids, topk, swiglu_expert)
            outs = {}
            bound = layer.bind_weights(weights)
            for path in ("auto", "marlin", "decode"):
                out = torch.full((tokens, h), float("nan"), dtype=torch.bfloat16, device="cuda")
                layer.forward(hidden, ids, topk, weights, workspace, out, path=path)
                torch.cuda.synchronize()
                got = out.double()
                self.assertTrue(bool(torch.isfinite(got).all()), (path, tokens))
                error = float((got - want).norm() / want.norm())
                # bf16 FC1 outputs and output rounding: ~4e-3 expected; the issues' bound is 1e-2.
                self.assertLess(error, 1e-2, (path, tokens))
                print("T = {} {}: rel L2 {:.2e}".format(tokens, path, error))
                outs[path] = out.clone()

            # Captured in a graph on a side stream, replayed: the eager bits.
            out = torch.full((tokens, h), float("nan"), dtype=torch.bfloat16, device="cuda")
            graph = torch.cuda.CUDAGraph()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                with torch.cuda.graph(graph, stream=stream):
                    layer.forward(hidden, ids, topk, bound, workspace, out)
            torch.cuda.current_stream().wait_stream(stream)
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            self.assertTrue(torch.equal(out, outs["auto"]), tokens)
            if tokens == 3:
                self.check_torch_arguments(layer, weights, bound, hidden, ids, topk, workspace,
                                           outs["auto"])

    def test_torch_memory_passes_the_pointer_checks(self):
        """With MOEJIT_CHECK_POINTERS=1 every buffer is asked of the driver before a launch.
        torch's tensors are cut from its caching allocator's segments, or with expandable
        segments from one reserved range mapped in chunks: the case above must pass as it is,
        in a process of its own (the variable is read when the library starts)."""
        import subprocess
        cases = ["GpuTests.test_repack_and_forward_match_fp64_on_every_path_and_in_a_graph",
                 "GpuTests.test_host_memory_is_refused_under_the_pointer_checks"]
        for conf in ("", "expandable_segments:True"):
            env = dict(os.environ, MOEJIT_CHECK_POINTERS="1", PYTORCH_CUDA_ALLOC_CONF=conf,
                       MOEJIT_TEST_PARENT_CACHE=os.environ["MOEJIT_CACHE_DIR"])
            run = subprocess.run([sys.executable, os.path.abspath(__file__), "gpu"] + cases,
                                 env=env, capture_output=True, text=True, timeout=250)
            self.assertEqual(run.returncode, 0, (conf, run.stdout + run.stderr))
            # Both ran, none skipped: the second shows the switch on in the child.
            self.assertIn("Ran 2 tests", run.stderr, conf)
            self.assertNotIn("skipped=", run.stderr, conf)

    def test_host_memory_is_refused_under_the_pointer_checks(self):
        """Under the pointer checks (MOEJIT_CHECK_POINTERS=1 in the case above's children, else
        turned on here by moejit.set_check_pointers): a workspace in host memory that says it is
        on the GPU is refused by name, before a launch."""
        previous = moejit.set_check_pointers(True)
        try:
            self.assertEqual(previous, os.environ.get("MOEJIT_CHECK_POINTERS") == "1")
            self.check_host_workspace_refused()
        finally:
            moejit.set_check_pointers(previous)

    def check_host_workspace_refused(self):
        torch = self.torch
        gen = self.generator()
        e, k, h = TINY["num_experts"], TINY["top_k"], TINY["hidden"]
        layer, weights, _ = self.tiny_layer(gen)
        hidden, ids, topk = self.routed_tokens(gen, 2, h, e, k)
        size = layer.workspace_bytes(2)
        host = (ctypes.c_uint8 * (size + 256))()
        aligned = (ctypes.addressof(host) + 255) // 256 * 256  # the workspace's alignment
        workspace = FakeTensor([size], device=CUDA, address=aligned)
        out = torch.full((2, h), float("nan"), dtype=torch.bfloat16, device="cuda")
        with self.assertRaises(moejit.InvalidArgument) as refused:
            layer.forward(hidden, ids, topk, weights, workspace, out)
        self.assertIn("workspace: expected memory mapped on device", str(refused.exception))
        self.assertIn("memory CUDA does not know", str(refused.exception))
        torch.cuda.synchronize()
        self.assertTrue(bool(out.isnan().all()))  # nothing launched

    def check_torch_arguments(self, layer, weights, bound, hidden, ids, topk, workspace, want):
        """The binding fills a DLTensor of its own for each torch argument: the library must read
        each as torch lays it out (a view's offset, its strides, its dtype) and refuse by name."""
        torch = self.torch
        tokens, h = hidden.shape
        rows = torch.full((tokens + 2, h), float("nan"), dtype=torch.bfloat16, device="cuda")
        layer.forward(hidden, ids, topk, bound, workspace, rows[1:1 + tokens])
        torch.cuda.synchronize()
        self.assertTrue(torch.equal(rows[1:1 + tokens], want))
        self.assertTrue(bool(rows[0].isnan().all() and rows[-1].isnan().all()))

        def refused(parts, **changes):
            args = dict(hidden=hidden, topk_ids=ids, topk_weights=topk, weights=bound,
                        workspace=workspace,
                        out=torch.empty_like(hidden))
            args.update(changes)
            with self.assertRaises(moejit.InvalidArgument) as e:
                layer.forward(**args)
            for part in parts:
                self.assertIn(part, str(e.exception))

        wide = torch.empty(tokens, 2 * h, dtype=torch.bfloat16, device="cuda")
        refused(["out: expected a contiguous row-major tensor", "strides [{}, 1]".format(2 * h)],
                out=wide[:, :h])
        refused(["topk_ids: expected dtype int32", "found dtype int64"], topk_ids=ids.long())
        refused(["hidden: expected dtype bfloat16", "found dtype float32"], hidden=hidden.float())
        refused(["topk_weights: expected a contiguous row-major tensor", "strides [2, 1]"],
                topk_weights=topk[:, :1])
        refused(["topk_weights: expected shape"], topk_weights=topk[:, :1].contiguous())
        refused(["workspace: expected a contiguous tensor"],
                workspace=workspace.view(2, -1)[:, :workspace.numel() // 4])
        w2 = weights["w2"]
        refused(["weights['w2']: expected at least {} bytes, found {}".format(
            w2.numel(), w2.numel() - 1)], weights=dict(weights, w2=w2[1:]))
        refused(["weights['w2']: expected a contiguous tensor"],
                weights=dict(weights, w2=w2.view(2, -1)[:, ::2]))
        # The dict's buffers, read from torch's accessors, are the bound ones.
        out = torch.full_like(hidden, float("nan"))
        layer.forward(hidden, ids, topk, weights, workspace, out)
        torch.cuda.synchronize()
        self.assertTrue(torch.equal(out, want))

    def test_threads_forward_at_once_each_with_its_own_tensors(self):
        """Forwards from several threads at once, each on its own stream with its own tensors
        and T: the ctypes call releases the GIL, so a DLTensor shared between threads would be
        refilled by one thread while the library reads it for another. Every output must be the
        bits the same forward gives alone."""
        import threading
        torch = self.torch
        gen = self.generator()
        layer, weights, _ = self.tiny_layer(gen)
        bound = layer.bind_weights(weights)
        jobs = self.forwards_alone(gen, layer, bound, (1, 2, 3, 5, 6, 8))
        torch.cuda.synchronize()
        rounds, mismatches, errors = 40, [], []

        def run(job_index):
            hidden, ids, topk, workspace, alone = jobs[job_index]
            stream = torch.cuda.Stream()
            try:
                with torch.cuda.stream(stream):
                    for r in range(rounds):
                        out = torch.full_like(alone, float("nan"))
                        layer.forward(hidden, ids, topk, bound, workspace, out)
                        stream.synchronize()
                        if not torch.equal(out, alone):
                            mismatches.append((job_index, r))
            except Exception as error:  # reported below, with the thread's job
                errors.append((job_index, repr(error)))

        threads = [threading.Thread(target=run, args=(j,)) for j in range(len(jobs))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        self.assertEqual(errors, [])
        self.assertEqual(mismatches, [])
        self.assertTrue(all(bool(torch.isfinite(job[4].float()).all()) for job in jobs))

    def test_a_forward_made_inside_another_gives_each_its_own_result(self):
        """A forward called from user code that an outer forward runs between its fills (here
        decode_block_n's __index__, on the same thread): each writes the bits it gives alone."""
        torch = self.torch
        gen = self.generator()
        layer, weights, _ = self.tiny_layer(gen)
        bound = layer.bind_weights(weights)
        jobs = [job + (torch.full_like(job[4], float("nan")),)
                for job in self.forwards_alone(gen, layer, bound, (3, 5))]
        outer, inner = jobs

        class BlockN:
            def __index__(self):
                layer.forward(inner[0], inner[1], inner[2], bound, inner[3], inner[5])
                return 0

        layer.forward(outer[0], outer[1], outer[2], bound, outer[3], outer[5],
                      decode_block_n=BlockN())
        torch.cuda.synchronize()
        for hidden, ids, topk, workspace, alone, out in jobs:
            self.assertTrue(bool(torch.isfinite(alone.float()).all()))
            self.assertTrue(torch.equal(out, alone), "T = {}".format(hidden.shape[0]))

    def test_tensors_without_strides_are_refused_by_name(self):
        torch = self.torch
        layer = moejit.MoeLayer("py-tiny")
        weights = {name: torch.zeros(n, dtype=torch.uint8, device="cuda")
                   for name, n in layer.weight_bytes.items() if n}
        hidden = torch.zeros(1, TINY["hidden"], dtype=torch.bfloat16, device="cuda")
        ids = torch.zeros(1, TINY["top_k"], dtype=torch.int32, device="cuda")
        topk = torch.zeros(1, TINY["top_k"], device="cuda")
        out = torch.zeros_like(hidden)
        workspace = torch.zeros(layer.workspace_bytes(1), dtype=torch.uint8, device="cuda")
        sparse_w13 = dict(weights, w13=weights["w13"].to_sparse())
        cases = {"hidden": (hidden.to_sparse(), ids, topk, weights, workspace, out),
                 "workspace": (hidden, ids, topk, weights, workspace.to_sparse(), out),
                 "weights['w13']": (hidden, ids, topk, sparse_w13, workspace, out)}
        for name, args in cases.items():
            with self.assertRaises(moejit.InvalidArgument) as e:
                layer.forward(*args)
            self.assertTrue(str(e.exception).startswith(name + ": a Tensor that DLPack can't "
                                                        "export: "), str(e.exception))

    def test_gpt_oss_checkpoint_with_biases_matches_fp64(self):
        torch = self.torch
        gen = self.generator()
        e, k = BIASED["num_experts"], BIASED["top_k"]
        h, i = BIASED["hidden"], BIASED["intermediate"]
        w13 = torch.randint(0, 256, (e, 2 * i, h // 32, 16), dtype=torch.uint8, device="cuda",
                            generator=gen)
        w13_s = torch.randint(120, 131, (e, 2 * i, h // 32), dtype=torch.uint8, device="cuda",
                              generator=gen)
        w2 = torch.randint(0, 256, (e, h, i // 32, 16), dtype=torch.uint8, device="cuda",
                           generator=gen)
        w2_s = torch.randint(120, 131, (e, h, i // 32), dtype=torch.uint8, device="cuda",
                             generator=gen)
        b13 = torch.randn(e, 2 * i, device="cuda", generator=gen).to(torch.bfloat16)
        b2 = torch.randn(e, h, device="cuda", generator=gen).to(torch.bfloat16)
        layer = moejit.MoeLayer("py-biased")
        weights = {name: torch.empty(layer.weight_bytes[name], dtype=torch.uint8, device="cuda")
                   for name in ("w13", "w13_scales", "w2", "w2_scales")}
        layer.repack_gpt_oss(w13, w13_s, w2, w2_s, weights)
        weights.update(b13=b13, b2=b2)

        # Rows 2j / 2j + 1 of w13 (and of b13) are gate j / up j.
        g13, d = self.dequant(w13, w13_s), self.dequant(w2, w2_s)
        tokens = 5
        hidden, ids, topk = self.routed_tokens(gen, tokens, h, e, k)

        def gpt_oss_expert(ex, x):
            fc1 = g13[ex] @ x + b13[ex].double()
            gate, up = fc1[0::2].clamp(max=7.0), fc1[1::2].clamp(-7.0, 7.0)
            return d[ex] @ (gate * torch.sigmoid(1.702 * gate) * (up + 1)) + b2[ex].double()

        want = self.reference(hidden, ids, topk, gpt_oss_expert)
        workspace = torch.empty(layer.workspace_bytes(tokens), dtype=torch.uint8, device="cuda")
        for path in ("auto", "marlin"):
            out = torch.full((tokens, h), float("nan"), dtype=torch.bfloat16, device="cuda")
            layer.forward(hidden, ids, topk, weights, workspace, out, path=path)
            torch.cuda.synchronize()
            got = out.double()
            self.assertTrue(bool(torch.isfinite(got).all()), path)
            error = float((got - want).norm() / want.norm())
            self.assertLess(error, 1e-2, path)
            print("gpt-oss with biases, T = {} {}: rel L2 {:.2e}".format(tokens, path, error))
        with self.assertRaises(moejit.Unsupported) as e:
            layer.forward(hidden, ids, topk, weights, workspace, out, path="decode")
        self.assertIn("bias", str(e.exception))

    def test_append_shared_matches_its_definition(self):
        torch = self.torch
        gen = self.generator()
        tokens, k, shared = 5, 6, 2
        ids = torch.randint(0, 64, (tokens, k), dtype=torch.int32, device="cuda", generator=gen)
        weights = torch.rand(tokens, k, device="cuda", generator=gen)
        logits = torch.randn(tokens, shared, device="cuda", generator=gen).to(torch.bfloat16)
        shared_ids = 64 + torch.arange(shared, dtype=torch.int32, device="cuda")
        shared_ids = shared_ids.expand(tokens, -1)
        for gate, want in (("sigmoid", torch.sigmoid(logits.float()) * 0.5),
                           ("constant", torch.full((tokens, shared), 0.5, device="cuda"))):
            out_ids = torch.full((tokens, k + shared), -7, dtype=torch.int32, device="cuda")
            out_weights = torch.full((tokens, k + shared), float("nan"), device="cuda")
            moejit.append_shared(ids, weights, logits if gate == "sigmoid" else None, out_ids,
                                 out_weights, 64, 0.5, gate=gate)
            torch.cuda.synchronize()
            self.assertTrue(torch.equal(out_ids[:, :k], ids), gate)
            self.assertTrue(torch.equal(out_ids[:, k:], shared_ids), gate)
            self.assertTrue(torch.equal(out_weights[:, :k], weights), gate)
            # fp32 sigmoid of the same bf16 logit: a few ulps between two expf implementations.
            self.assertTrue(torch.allclose(out_weights[:, k:], want, rtol=1e-6, atol=0), gate)


def main(argv):
    groups = {"cpu": (CpuTests, TorchFillTests), "gpu": (GpuTests,)}
    if len(argv) < 2 or argv[1] not in groups:
        print("usage: test_python_binding.py cpu|gpu [Class.test_name...]", file=sys.stderr)
        return 2
    if argv[1] == "gpu":
        why = gpu_unavailable()
        if why:
            print("skipped: the GPU group needs torch on a CUDA GPU: " + why)
            return 77
    if len(argv) > 2:
        suite = unittest.defaultTestLoader.loadTestsFromNames(argv[2:], sys.modules[__name__])
    else:
        suite = unittest.TestSuite(unittest.defaultTestLoader.loadTestsFromTestCase(group)
                                   for group in groups[argv[1]])
    result = unittest.TextTestRunner(verbosity=2).run(suite)
    return 0 if result.wasSuccessful() else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
