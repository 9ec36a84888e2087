"""Host cost of one MoE layer call through the Python binding, beside the layer's GPU time.

    MOEJIT_LIBRARY=build/libmoejit.so PYTHONPATH=src/python \
        python3 tools/bench/bench_python.py [--shape qwen3-30b-a3b] [--tokens 1] [--calls 2000]
            [--warmup 3000]

Needs torch on a CUDA GPU. Registers tools/shapes/reference.json, prewarms the shape, fills its
repacked weights with random bytes (the timing does not depend on the values), runs --warmup
forwards (a process's first ~2000 forwards ran ~25 us slower than later ones, tools/PERF_LOG.md,
fifty-eighth session), then prints medians over --calls calls of: the host time of
`layer.forward` with a dict of weights and with bound weights (calls issued back to back, the
stream drained after each batch of 50), one torch `__dlpack__` beside the binding's own
description of the same tensor, the binding's lookup of torch's current stream beside torch's
public one, and the layer's GPU time per call (CUDA events around a graph of 50 calls).
"""

import argparse
import json
import os
import statistics
import sys
import time


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen3-30b-a3b")
    parser.add_argument("--tokens", type=int, default=1)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=3000)
    args = parser.parse_args()

    import torch
    if not torch.cuda.is_available():
        print("bench_python: torch sees no CUDA GPU", file=sys.stderr)
        return 2
    import moejit

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    shapes = os.path.join(root, "tools", "shapes", "reference.json")
    with open(shapes) as f:
        shape = next((s for s in json.load(f)["shapes"] if s["name"] == args.shape), None)
    if shape is None:
        print("bench_python: no shape {!r} in {}".format(args.shape, shapes), file=sys.stderr)
        return 2
    moejit.register_shapes_file(shapes)
    torch.zeros(1, device="cuda")
    built = moejit.prewarm([args.shape])
    print("prewarm {}: {}".format(args.shape, built))

    layer = moejit.MoeLayer(args.shape)
    weights = {name: torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
               for name, n in layer.weight_bytes.items() if n}
    for name in ("b13", "b2"):
        if name in weights:
            weights[name] = torch.zeros(layer.weight_bytes[name] // 2, dtype=torch.bfloat16,
                                        device="cuda")
    bound = layer.bind_weights(weights)
    t = args.tokens
    h, k, e = shape["hidden"], shape["top_k"], shape["num_experts"]
    hidden = torch.randn(t, h, device="cuda").to(torch.bfloat16)
    ids = torch.stack([torch.randperm(e, device="cuda")[:k] for _ in range(t)]).to(torch.int32)
    topk = torch.rand(t, k, device="cuda")
    out = torch.empty(t, h, dtype=torch.bfloat16, device="cuda")
    workspace = torch.empty(layer.workspace_bytes(t), dtype=torch.uint8, device="cuda")

    def host_us(call, batch=50):
        samples = []
        for _ in range(max(1, args.calls // batch)):
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(batch):
                call()
            samples.append((time.perf_counter() - start) / batch * 1e6)
        return statistics.median(samples)

    def forward_dict():
        layer.forward(hidden, ids, topk, weights, workspace, out)

    def forward_bound():
        layer.forward(hidden, ids, topk, bound, workspace, out)

    # The layer's own GPU time: 50 forwards captured in one graph, replayed between events, so no
    # host gap between calls is counted (eager calls back to back are host-bound at small T).
    forward_bound()
    torch.cuda.synchronize()
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        with torch.cuda.graph(graph, stream=side):
            for _ in range(50):
                forward_bound()
    torch.cuda.current_stream().wait_stream(side)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    gpu = []
    for _ in range(20):
        begin.record()
        graph.replay()
        end.record()
        end.synchronize()
        gpu.append(begin.elapsed_time(end) * 1e3 / 50)

    for _ in range(args.warmup):
        forward_bound()
    torch.cuda.synchronize()

    print("shape {}, T = {}, {} calls after {} warm-up forwards, libmoejit {}, binding {}".format(
        args.shape, t, args.calls, args.warmup, moejit.version(), moejit.__file__))
    print("  host us a call, forward with a dict of weights : {:8.2f}".format(
        host_us(forward_dict)))
    print("  host us a call, forward with bound weights     : {:8.2f}".format(
        host_us(forward_bound)))
    print("  host us, one torch __dlpack__(stream=-1)       : {:8.2f}".format(
        host_us(lambda: hidden.__dlpack__(stream=-1))))
    if hasattr(moejit, "_Slot"):  # a binding that describes torch tensors itself
        slot = moejit._Slot()
        print("  host us, the binding's own DLTensor of it      : {:8.2f}".format(
            host_us(lambda: slot.fill(hidden))))
    print("  host us, the binding's current-stream lookup   : {:8.2f}".format(
        host_us(lambda: moejit._stream_handle(None))))
    print("  host us, torch.cuda.current_stream() handle    : {:8.2f}".format(
        host_us(lambda: torch.cuda.current_stream().cuda_stream)))
    print("  GPU us a call (graph replay of 50 calls)       : {:8.2f}".format(
        statistics.median(gpu)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
