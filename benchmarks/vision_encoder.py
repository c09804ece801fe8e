"""Throughput of the vision encoder on the CPU: images per second through its forward and backward.

    python benchmarks/vision_encoder.py [--tower debug|768|1024|1152] [--depth 2] [--size 224]
                                        [--images 8] [--repeat 5] [--threads 0] [--json FILE]

One process builds the `-VL` flavors' tower (`models/qwen3_5/__init__.py`; `--depth` keeps its first blocks
so a CPU run stays short) and times forward + backward of a batch of `--images` square pictures of
`--size` pixels, packed as the trainer packs them (one sequence, per-image attention), after one warm-up.
It reports patches/s, images/s and the encoder's achieved GFLOP/s (6 x matmul parameters x patches +
attention, as the planner counts it), median of `--repeat` timings. The same code runs on CUDA when a GPU
is there (`--device cuda`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

TOWERS = {"debug": "debugmodel_vl", "768": "0.8B-VL", "1024": "2B-VL", "1152": "9B-VL"}


def encoder_flops(args, patches_per_image: int, images: int) -> float:
    """Training FLOPs of the encoder (forward + backward = 3 x forward) on `images` pictures."""
    d, f, n = args.vision_dim, args.vision_hidden_dim, patches_per_image
    merged = d * args.vision_merge_size ** 2
    block = 2 * n * (4 * d * d + 2 * d * f) + 4 * n * n * d  # matmuls + scores and weighted sum
    merger = 2 * (n // args.vision_merge_size ** 2) * (merged * merged + merged * args.dim)
    return 3.0 * images * (2 * n * args.patch_dim * d + args.vision_depth * block + merger)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tower", choices=sorted(TOWERS), default="768")
    ap.add_argument("--depth", type=int, default=2, help="blocks kept (0: all of the tower's)")
    ap.add_argument("--size", type=int, default=224, help="picture side in pixels")
    ap.add_argument("--images", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="intra-op threads (0: torch's default)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json")
    ns = ap.parse_args(argv)
    if ns.threads:
        torch.set_num_threads(ns.threads)
    from torchtrain.models.common.multimodal import packed_images
    from torchtrain.models.common.vision import VisionEncoder
    from torchtrain.models.qwen3_5 import QWEN3_5_VL_FLAVORS

    args = QWEN3_5_VL_FLAVORS[TOWERS[ns.tower]]
    if ns.depth:
        args = args.replace(vision_depth=min(ns.depth, args.vision_depth))
    device = torch.device(ns.device)
    torch.manual_seed(0)
    encoder = VisionEncoder(args, args.dim).to(device)
    side = ns.size // args.vision_patch_size // args.vision_merge_size * args.vision_merge_size
    patches = side * side
    grid = torch.tensor([[[1, side, side]] * ns.images])
    pixels = torch.randn(1, patches * ns.images, args.patch_dim)
    packed, grids = packed_images(pixels.to(device), grid.to(device))

    def step() -> float:
        start = time.perf_counter()
        encoder(packed, grids).square().mean().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    step()
    seconds = statistics.median(step() for _ in range(ns.repeat))
    flops = encoder_flops(args, patches, ns.images)
    result = {"tower": ns.tower, "depth": args.vision_depth, "size": ns.size, "patches_per_image": patches,
              "images": ns.images, "threads": torch.get_num_threads(), "torch": torch.__version__,
              "seconds": seconds, "images_per_s": ns.images / seconds, "patches_per_s": patches * ns.images / seconds,
              "gflops_per_s": flops / seconds / 1e9}
    print(f"tower ViT-{ns.tower} x{args.vision_depth} blocks | {ns.images} images of {ns.size}px ({patches} patches) | "
          f"{result['images_per_s']:.1f} images/s, {result['patches_per_s']:,.0f} patches/s, "
          f"{result['gflops_per_s']:.1f} GFLOP/s (fwd+bwd, {result['threads']} threads, torch {torch.__version__})")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
