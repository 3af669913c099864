"""The GPU check's attention probe (run by tests/gpu_check.sh; on CPU by a test, small).

At the largest decode view A times (the rows and cached tokens of its biggest row that
indexes in 32 bits), it reports the kernel PyTorch picks by itself and the one the project's
policy (SDPA_BACKENDS) gives, checks the policy's output against the flash backend's, and
captures the step into a CUDA graph and replays it.

    python tests/gpu_probe.py [--device cuda] [--batch 128] [--keys 4097]
"""
import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import dataclasses  # noqa: E402
from nn40.config import CPU_PRESET, MODELS  # noqa: E402
from nn40.device import VIEW_ELEMENTS_MAX, device_name, kv_view_elements, sdpa_policy  # noqa: E402
from nn40.host import one_line  # noqa: E402
from nn40.model import DTYPES  # noqa: E402
from nn40.timing import OpLog, cuda_graph  # noqa: E402


def largest_view(cfg, batches, contexts):
    """A's biggest decode row whose per-layer K/V view stays within VIEW_ELEMENTS_MAX."""
    rows = [(b, c + 1) for b in batches for c in contexts
            if kv_view_elements(cfg, b, c + 1) <= VIEW_ELEMENTS_MAX]
    return max(rows, key=lambda r: r[0] * r[1])


def probe(device, cfg, batch, keys):
    """-> what PyTorch runs at this decode shape, under its own choice and under the policy."""
    g = torch.Generator(device="cpu").manual_seed(0)
    dtype, heads, group = DTYPES[cfg.dtype], cfg.n_kv_heads, cfg.heads // cfg.n_kv_heads
    q = torch.randn(batch, heads, group, cfg.head_dim, generator=g).to(device, dtype)
    k, v = (torch.randn(batch, heads, keys, cfg.head_dim, generator=g).to(device, dtype)
            for _ in range(2))
    out = {"device": device_name(device), "batch": batch, "keys": keys, "dtype": cfg.dtype}
    with OpLog() as log:
        F.scaled_dot_product_attention(q, k, v)
    out["default_kernels"] = log.attention()
    with sdpa_policy():
        with OpLog() as log:
            y = F.scaled_dot_product_attention(q, k, v)
        out["policy_kernels"] = log.attention()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    try:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            ref = F.scaled_dot_product_attention(q, k, v)
        out["max_abs_vs_flash"] = float((y.float() - ref.float()).abs().max())
    except RuntimeError as e:  # (no flash kernel for this device or type)
        out["max_abs_vs_flash"] = one_line(e)
    if device.type == "cuda":
        with sdpa_policy():
            step = (lambda: F.scaled_dot_product_attention(q, k, v))
            try:
                replay = cuda_graph(step)
                t0 = time.perf_counter()
                replay()
                torch.cuda.synchronize(device)
                out["graph_replay_ms"] = (time.perf_counter() - t0) * 1e3
            except RuntimeError as e:
                out["graph_replay_ms"] = one_line(e)
    return out


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch", type=int)
    p.add_argument("--keys", type=int)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    cfg = MODELS["post"]  # (on CUDA A times the post's model in float16)
    if device.type == "cpu":
        cfg = dataclasses.replace(CPU_PRESET, dtype="float32")
    batch, keys = largest_view(cfg, (1, 8, 32, 128, 256), (128, 1024, 4096))
    with torch.inference_mode():
        result = probe(device, cfg, args.batch or batch, args.keys or keys)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
