"""The vision encoder of a vision-language job: its images, FLOPs, stored activations and time on one rank.

What the encoder is comes from the model (`ModelContract.vision`, `models/vision_contract.py`); what it is
fed from the plan's inputs: `images_per_sample` images of `image_size` (H, W) pixels per sequence. The
processor's resize rule (`data/image/pixels.py::ImageSpec.resized`: both sides multiples of patch x merge, h w
within the job's `[images]` min_pixels .. max_pixels) gives each image's grid of t x h x w patches
(t = 1: a still image is one frame), N = t h w patches and N / m^2 decoder tokens, which take their place
in seq_len like text.

The encoder runs on the pipeline stage that holds the embedding (`Stage.holds("vision_encoder")`), once per
micro-batch over all its sequences' images packed, on every context-parallel rank (each encodes its
sequences' images whole: `models/common/multimodal.py`) and on every TP rank over the same replicated
patches, its block matmuls column/row-parallel (`vision_encoder_plan`). Per micro-batch, n images, N their
patches, d the width, f the MLP width, H heads, b compute bytes, s the LayerNorm statistics' bytes (float32
on CUDA, else b), P a patch's values, tp the TP degree:

**Stored activations** per patch are the encoder's declaration (`models/vision_contract.py`: a block's, the rest's,
what a checkpointed block keeps), with s float32 on CUDA.

Activation checkpointing applies to the encoder's blocks as to the decoder's (the trainer wraps both; a
selective "cheap" option falls back to "op" there): `full` keeps a block's input (b d), selective "op"
what the encoder declares a block keeps under the op-level policy, every N-th block as a share; one block is
recomputed at a time.

**Time**: each GEMM from its shape (`compute_time.linear_seconds`: the patch embedding has no input
gradient), attention per frame of F = h w patches (4 F^2 d / tp forward FLOPs, bidirectional, backward 2.5
x), memory-bound work per patch and block (the encoder's declaration: `VisionShape.memory_bytes_per_patch`)
and around it (pixel cast, position taps, merger).
The TP collectives (`VisionShape.block_collectives`, `merger_collectives`) are all exposed; the blocks'
forward ones run again when checkpointing recomputes them.
"""

from __future__ import annotations

from dataclasses import dataclass

from torchtrain.components.hardware import GPUSpec
from torchtrain.config import ConfigError
from torchtrain.distributed.activation_checkpoint import OP_LEVEL_OPTIONS
from torchtrain.models.block_memory import norm_bytes
from torchtrain.planner import comm_time, compute_time
from torchtrain.planner.inputs import PlanInputs
from torchtrain.planner.pipeline import ENCODER, Stage


def holds_encoder(p: PlanInputs, stage: Stage) -> bool:
    """Whether `stage` runs the model's vision encoder."""
    return p.model.vision is not None and stage.holds(ENCODER)


def check(p: PlanInputs) -> None:
    """ConfigError for images planned for a model without an encoder, or an impossible image size."""
    if p.images_per_sample < 0:
        raise ConfigError(f"--images-per-sample must be >= 0, got {p.images_per_sample}")
    if p.images_per_sample and p.model.vision is None:
        raise ConfigError(f"--images-per-sample {p.images_per_sample:g}: model {p.model_name} {p.flavor} has no "
                          f"vision encoder (a vision-language flavor has one, e.g. qwen3_5 9B-VL)")
    if p.images_per_sample and min(p.image_size) < 1:
        raise ConfigError(f"--image-size {p.image_size[0]}x{p.image_size[1]}: both sides must be >= 1 pixel")


def image_grid(p: PlanInputs) -> tuple[int, int, int] | None:
    """The (t, h, w) patch grid of one image as the processor resizes it; None without images."""
    enc = p.model.vision
    if enc is None or not p.images_per_sample:
        return None
    from torchtrain.data.image.pixels import ImageSpec

    spec = ImageSpec(enc.patch_size, enc.temporal_patch_size, enc.merge_size, *p.image_pixels, 0, 0, 0)
    return spec.grid_of(*p.image_size)


def images_per_microbatch(p: PlanInputs) -> float:
    """Images one forward pass on a rank encodes: its sequences' (every CP rank encodes them whole)."""
    return p.images_per_sample * (p.pp_microbatch_size if p.pp > 1 else p.local_batch_size)


def image_tokens(p: PlanInputs) -> int:
    """Decoder tokens of one image (0 without images)."""
    grid = image_grid(p)
    return p.model.vision.tokens(grid) if grid else 0


def flops_per_token(p: PlanInputs) -> float:
    """The encoder's training FLOPs per decoder token of the step (its images' FLOPs / seq_len)."""
    grid = image_grid(p)
    return p.images_per_sample * p.model.vision.flops(grid) / p.seq_len if grid else 0.0


def _checkpointed_share(p: PlanInputs) -> float:
    """Share of the encoder's blocks whose whole forward checkpointing recomputes."""
    if p.ac_mode == "full":
        return 1.0
    if p.ac_mode == "selective" and p.ac_option not in OP_LEVEL_OPTIONS:
        depth = p.model.vision.depth
        return (depth // int(p.ac_option)) / depth
    return 0.0


def recompute_flops_per_token(p: PlanInputs) -> float:
    """Encoder matmul and attention FLOPs per token that checkpointing repeats (its blocks' forward)."""
    grid = image_grid(p)
    if grid is None or p.ac_mode == "none":
        return 0.0
    enc, (t, h, w) = p.model.vision, grid
    n = t * h * w
    matmul = 2 * n * sum(m.in_features * m.out_features for m in enc.block.matmuls())
    block = matmul + 4 * t * (h * w) ** 2 * enc.dim
    share = _checkpointed_share(p)
    per_image = enc.depth * (share * block + (p.sac_matmul_share * matmul if p.ac_mode == "selective" and not share
                                              else 0.0))
    return p.images_per_sample * per_image / p.seq_len


# ------------------------------------------------------------------------------ memory
def _stat_bytes(p: PlanInputs) -> int:
    return 4 if p.device_type == "cuda" or p.param_bytes == 4 else p.param_bytes


def block_bytes_per_patch(p: PlanInputs, frames: float) -> float:
    """Bytes one encoder block stores per patch without checkpointing (module doc); `frames` packed."""
    return p.model.vision.block_bytes_per_patch(p.param_bytes, _stat_bytes(p), p.tp, frames > 1)


def rest_bytes_per_patch(p: PlanInputs) -> float:
    """Bytes the encoder stores per patch outside its blocks (module doc)."""
    return p.model.vision.rest_bytes_per_patch(p.param_bytes, _stat_bytes(p), p.tp)


def checkpointed_bytes_per_patch(p: PlanInputs) -> float:
    """Bytes a checkpointed encoder block keeps per patch: its input (`full`, every N-th), or with
    selective "op" (and "cheap", which falls back to it) also its matmul and attention outputs."""
    enc = p.model.vision
    if p.ac_mode == "full" or p.ac_option not in OP_LEVEL_OPTIONS:
        return p.param_bytes * enc.dim
    return enc.op_kept_bytes_per_patch(p.param_bytes, p.tp)


def activation_bytes(p: PlanInputs) -> tuple[float, float]:
    """(bytes one micro-batch's images leave stored on the encoder's stage, the transient of one
    recomputed block: 0 without checkpointing)."""
    grid = image_grid(p)
    if grid is None:
        return 0.0, 0.0
    enc, images = p.model.vision, images_per_microbatch(p)
    n = images * grid[0] * grid[1] * grid[2]
    full = block_bytes_per_patch(p, images * grid[0]) * n
    if p.ac_mode == "none":
        return enc.depth * full + rest_bytes_per_patch(p) * n, 0.0
    share = 1.0 if p.ac_mode == "selective" and p.ac_option in OP_LEVEL_OPTIONS else _checkpointed_share(p)
    kept = checkpointed_bytes_per_patch(p) * n
    return enc.depth * (share * kept + (1 - share) * full) + rest_bytes_per_patch(p) * n, full


# ------------------------------------------------------------------------------ time
@dataclass
class EncoderTime(compute_time.BlockTime):
    """Seconds the encoder takes on one rank for one micro-batch's images (a block's terms, `total` the
    compute), and its tensor-parallel collectives."""

    tp_s: float = 0.0
    """Its tensor-parallel collectives (exposed)."""

    @property
    def forward(self) -> float:
        return self.gemm_fwd + self.attn_fwd + self.mem_fwd


def _block_memory_bytes(p: PlanInputs, dev: GPUSpec) -> float:
    """Forward bytes per patch of one block's memory-bound kernels (module doc)."""
    b = p.param_bytes
    return p.model.vision.memory_bytes_per_patch(b, p.tp, p.compile, norm_bytes(b, p.compile, dev.fused_rms_norm))


def _local(mm, tp: int) -> tuple[float, float]:
    """(in, out) features of a matmul on one TP rank."""
    if mm.kind == "column":
        return mm.in_features, mm.out_features / tp
    return (mm.in_features / tp, mm.out_features) if mm.kind == "row" else (mm.in_features, mm.out_features)


def encoder_time(p: PlanInputs, dev: GPUSpec) -> EncoderTime:
    """One micro-batch's images through the encoder on one rank (module doc); zeros without images."""
    out, grid = EncoderTime(), image_grid(p)
    if grid is None:
        return out
    enc, tp, b, dtype = p.model.vision, p.tp, p.param_bytes, p.param_dtype
    images = images_per_microbatch(p)
    t, h, w = grid
    n = images * t * h * w
    tokens = n / enc.merge_size ** 2
    block_fwd = 0.0
    for mm in enc.block.matmuls():
        fwd, dgrad, wgrad = compute_time.linear_seconds(dev, n, *_local(mm, tp), dtype)
        block_fwd += fwd
        out.gemm_bwd += enc.depth * (dgrad + wgrad)
    out.gemm_fwd = enc.depth * block_fwd
    for mm in enc.rest.matmuls():  # the patch embedding per patch (its input, the pixels, needs no gradient);
        embed = mm.name == "patch_embed"  # the merger per decoder token
        fwd, dgrad, wgrad = compute_time.linear_seconds(dev, n if embed else tokens, *_local(mm, tp), dtype)
        out.gemm_fwd += fwd
        out.gemm_bwd += wgrad + (0.0 if embed else dgrad)
    frame = h * w
    flops = 4 * frame ** 2 * enc.dim / tp * images * t
    attn_fwd, attn_bwd = compute_time._mixer_seconds(dev, flops, compute_time.ATTN_BWD_OVER_FWD * flops,
                                                     dev.matmul_tflops(dtype),
                                                     frame / (frame + compute_time.ATTN_RAMP_TOKENS))
    out.attn_fwd, out.attn_bwd = enc.depth * attn_fwd, enc.depth * attn_bwd
    mem_block = compute_time.memory_seconds(dev, _block_memory_bytes(p, dev) * n)
    norm = norm_bytes(b, p.compile, dev.fused_rms_norm)
    rest = ((4 + b) * enc.patch_dim + 10 * b * enc.dim + norm * enc.dim + 2 * b * enc.dim / tp) * n
    out.mem_fwd = enc.depth * mem_block + compute_time.memory_seconds(dev, rest)
    out.mem_bwd = 2 * out.mem_fwd
    if p.ac_mode != "none":
        share = _checkpointed_share(p)
        whole = block_fwd + attn_fwd + mem_block
        out.recompute = enc.depth * (share * whole + (0.0 if share else mem_block + p.sac_matmul_share * block_fwd))
    if tp > 1:
        ln = comm_time.link(dev, tp)

        def seconds(cs, rows: float, repeats: float) -> float:
            return sum(c.count * comm_time.ring(tp, c.nbytes(rows, 0, b), ln) * (2 if c.kind == "all_reduce" else 1)
                       * (1.0 if c.backward else repeats) for c in cs)

        out.tp_s = enc.depth * seconds(enc.block_collectives(tp), n, comm_time.forward_repeats(p)) + \
            seconds(enc.merger_collectives(tp), tokens, 1.0)
    return out


# ------------------------------------------------------------------------------ the report
def describe(p: PlanInputs) -> list[str]:
    """Report lines of the job's images and encoder ([] for a text-only model)."""
    enc = p.model.vision
    if enc is None:
        return []
    tower = (f"vision encoder {enc.depth} blocks x {enc.dim} ({enc.num_params / 1e6:,.1f} M parameters, "
             f"with the embedding on the first pipeline stage)")
    grid = image_grid(p)
    if grid is None:
        return [f"  images   none planned ({tower}; --images-per-sample N --image-size HxW)"]
    t, h, w = grid
    tokens = enc.tokens(grid)
    per_sample = p.images_per_sample * (tokens + 2)
    return [f"  images   {p.images_per_sample:g} per sample of {p.image_size[0]}x{p.image_size[1]} pixels, resized to "
            f"{h * enc.patch_size}x{w * enc.patch_size}: {t * h * w:,} patches, {tokens:,} tokens each; "
            f"{per_sample:,.0f} of the {p.seq_len:,} tokens of a sample ({per_sample / p.seq_len:.0%})",
            f"           {tower}: {_flop(enc.flops(grid))} per image (training)"]


def _flop(x: float) -> str:
    for div, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M")):
        if x >= div:
            return f"{x / div:,.2f} {prefix}FLOP"
    return f"{x:,.0f} FLOP"


def notes(p: PlanInputs) -> list[str]:
    """What a plan with images should say about them."""
    grid = image_grid(p)
    if grid is None:
        return []
    out = []
    per_sample = p.images_per_sample * (p.model.vision.tokens(grid) + 2)
    if per_sample > p.seq_len:
        out.append(f"the images take {per_sample:,.0f} tokens of a sample, more than training.seq_len {p.seq_len}: "
                   f"the data cannot fit them (smaller images, fewer per sample, or a longer seq_len)")
    if p.lora is not None:
        out.append("LoRA with images: the vision encoder is costed as fully trained (its adapters are not modelled)")
    return out
