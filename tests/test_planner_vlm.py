"""The planner on a vision-language job (Qwen3.5 with its vision encoder): the encoder the model declares
(`ModelContract.vision`) against the real encoder -- parameters, FLOPs counted by torch's FLOP counter,
tensor-parallel collectives seen under a fake process group, activations saved for backward -- and the
images' costs in a plan: on the first pipeline stage, growing with the images, counted in the MFU."""

from __future__ import annotations

import contextlib
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from torchtrain.config import ConfigError
from torchtrain.data.image.pixels import ImageSpec
from torchtrain.distributed.activation_checkpoint import wrap_block
from torchtrain.models.common.vision import VisionEncoder
from torchtrain.models.contract import declare
from torchtrain.models.registry import get_model_spec
from torchtrain.plan import main as plan_main
from torchtrain.planner import shapes, vision
from torchtrain.planner.analytic import estimate_memory
from torchtrain.planner.core import load_job, resolve_gpu
from torchtrain.planner.from_job import inputs_from_config
from torchtrain.planner.inputs import PlanInputs
from torchtrain.planner.pipeline import pipeline_of
from torchtrain.planner.step_time import estimate_step

SPEC = get_model_spec("qwen3_5")
VL_FLAVORS = [name for name in SPEC.flavors if name.endswith(("_vl", "-VL"))]


def _inputs(flavor: str = "9B-VL", world: int = 8, seq: int = 4096, batch: int = 1, **flags):
    job = load_job(["--model.name", "qwen3_5", "--model.flavor", flavor, "--training.seq_len", str(seq),
                    "--training.local_batch_size", str(batch)])
    device_type, gpu = resolve_gpu("h100")
    return inputs_from_config(job.cfg, job.args, world, device_type, gpu, flags)


def _debug_args(**changes):
    return SPEC.flavors["debugmodel_vl"].replace(**changes)


def _planned(args, dtype: str, device_type: str = "cpu", **fields) -> PlanInputs:
    return PlanInputs("qwen3_5", args, 1, param_dtype=dtype, device_type=device_type, image_pixels=(1, 1 << 30),
                      **fields)


# ------------------------------------------------------------------------------ the declared encoder
@pytest.mark.parametrize("flavor", VL_FLAVORS)
def test_declared_encoder_matches_the_built_model(flavor):
    args = SPEC.flavors[flavor]
    with torch.device("meta"):
        encoder = VisionEncoder(args, args.dim)
    enc = declare(args).vision
    assert enc.num_params == sum(p.numel() for p in encoder.parameters()) == args.vision_params()

    def declared(block, prefix: str) -> dict[str, int]:
        return {f"{prefix}{m}.{'weight' if k == 0 else 'bias'}": r * c for m, mod in block.modules.items()
                for k, (r, c) in enumerate(mod.params)}

    # every tensor of the first block and of the rest, by name and size, and nothing else
    real = {name: p.numel() for name, p in encoder.named_parameters()
            if not name.startswith("layers.") or name.startswith("layers.0.")}
    assert {**declared(enc.block, "layers.0."), **declared(enc.rest, "")} == real
    assert declare(SPEC.flavors[flavor.removesuffix("_vl").removesuffix("-VL")]).vision is None
    # the planner's FSDP units: the decoder's and the encoder's, all of the model's parameters
    a = declare(args)
    units = shapes.unit_shapes(a, pipeline_of(_planned(args, "float32")).stages[0], tp=1, ep=1)
    assert sum(n.startswith("vision block") for n, _ in units) == args.vision_depth
    assert shapes.numel([s for _, unit in units for s in unit]) == args.num_params() == a.num_params


def _forward_and_training_flops(args, grid: torch.Tensor) -> tuple[int, int]:
    torch.manual_seed(0)
    encoder = VisionEncoder(args, args.dim)
    pixels = torch.randn(int(grid.prod(-1).sum()), args.patch_dim)
    with sdpa_kernel(SDPBackend.MATH):  # attention as matmuls the counter sees (the fused kernels it does not)
        with FlopCounterMode(display=False) as forward:
            encoder(pixels, grid)
        with FlopCounterMode(display=False) as training:
            encoder(pixels, grid).sum().backward()
    return forward.get_total_flops(), training.get_total_flops()


@pytest.mark.parametrize("changes,grid", [({}, (8, 12)), ({"vision_depth": 3, "vision_merge_size": 1}, (6, 10))])
def test_encoder_flops_equal_torchs_flop_counter(changes, grid):
    args = _debug_args(**changes)
    enc = declare(args).vision
    images = 3
    forward, training = _forward_and_training_flops(args, torch.tensor([[1, *grid]] * images))
    one = enc.forward_flops((1, *grid))
    assert forward == images * one  # every matmul and attention product, exactly
    # training: 3 x forward (the 6N convention) less the patch embedding's input gradient, never run
    patches = images * grid[0] * grid[1]
    assert training == images * enc.flops((1, *grid)) - 2 * patches * enc.patch_dim * enc.dim


@contextlib.contextmanager
def _fake_world(size: int):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=size, store=FakeStore())
    try:
        yield torch.distributed.device_mesh.init_device_mesh("cpu", (size,))
    finally:
        dist.destroy_process_group()


class _AllReduces(TorchDispatchMode):
    """(elements, in backward) of every all-reduce dispatched."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[int, bool]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops._c10d_functional.all_reduce.default:
            self.seen.append((args[0].numel(), torch._C._current_graph_task_id() != -1))
        return func(*args, **(kwargs or {}))


def test_declared_tp_collectives_match_the_parallel_encoder():
    """Under TP 2 (a fake process group), the encoder's all-reduces, forward and backward, per block (two
    encoders, one block apart) and for the rest (the merger), count and elements, against the declaration;
    its TP-local parameters too."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    from torchtrain.models.common.tp import vision_encoder_plan

    tp, grid = 2, torch.tensor([[1, 8, 8], [1, 4, 8]])
    n = int(grid.prod(-1).sum())
    seen = {}
    with _fake_world(tp) as mesh:
        for depth in (1, 2):
            args = _debug_args(vision_depth=depth, vision_dim=32)  # merger: 128 wide in, the decoder's 256 out
            encoder = VisionEncoder(args, args.dim)
            parallelize_module(encoder, mesh, vision_encoder_plan(list(encoder.layers)))
            with _AllReduces() as comm:
                encoder(torch.randn(n, args.patch_dim), grid).sum().backward()
            seen[depth] = Counter(comm.seen)
            local = [tuple(p.to_local().shape) if isinstance(p, DTensor) else tuple(p.shape)
                     for p in encoder.layers["0"].parameters()]
    enc = declare(args).vision
    assert sorted(r * c for r, c in enc.block.params(tp, 1)[0]) == sorted(torch.Size(s).numel() for s in local)

    tokens = n // enc.merge_size ** 2
    block, rest = seen[2] - seen[1], seen[1] - (seen[2] - seen[1])
    assert block == _total(enc.block_collectives(tp), n) and sum(block.values()) == 6  # 2 forward, 4 backward
    assert rest == _total(enc.merger_collectives(tp), tokens) and sum(rest.values()) == 2


def _total(collectives, rows: int) -> Counter:
    out: Counter = Counter()
    for c in collectives:
        assert c.kind == "all_reduce" and c.mesh == "tp"
        out[(c.per_token * rows, c.backward)] += c.count
    return out


# ------------------------------------------------------------------------------ activations
def _saved_bytes(module, *inputs) -> float:
    """Bytes of the tensors `module` saves for backward (its parameters not counted)."""
    own = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(*inputs)
    return sum(n for ptr, n in seen.items() if ptr not in own)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("grids", [[[1, 16, 16]], [[1, 16, 16], [1, 8, 16]]])
def test_activation_formula_matches_the_saved_tensors(dtype, grids):
    """Without checkpointing, per patch: a block's bytes exactly (two blocks less one), the rest's too."""
    grid = torch.tensor(grids)
    n = int(grid.prod(-1).sum())
    pixels = torch.randn(n, 384)
    saved = {}
    for depth in (1, 2):
        args = _debug_args(vision_depth=depth, vision_dim=128, vision_hidden_dim=256)
        encoder = VisionEncoder(args, args.dim).to(getattr(torch, dtype))
        saved[depth] = _saved_bytes(encoder, pixels, grid) / n
    p = _planned(args, dtype)
    assert vision.block_bytes_per_patch(p, len(grids)) == saved[2] - saved[1]
    assert vision.rest_bytes_per_patch(p) == saved[1] - (saved[2] - saved[1])


@pytest.mark.parametrize("mode,option", [("full", "op"), ("selective", "op"), ("selective", "cheap")])
def test_checkpointed_encoder_blocks_keep_what_the_formula_says(mode, option):
    """A block wrapped as the trainer wraps the encoder's ("cheap" falls back to "op" there) holds after its
    forward the declared bytes per patch, its input included: measured by the tensor-memory tracker as the
    bytes alive beyond its output and the shared RoPE table (the input, made before tracking, added)."""
    from torchtrain.components.observability.tensor_memory import TensorMemoryTracker
    from torchtrain.models.common.vision import frame_lengths, vision_rope_rows

    args = _debug_args(vision_dim=128, vision_hidden_dim=256)
    grid = torch.tensor([[1, 16, 16], [1, 8, 16]])
    n = int(grid.prod(-1).sum())
    block = VisionEncoder(args, args.dim).layers["0"].to(torch.bfloat16)
    block = wrap_block(block, mode, "op" if option == "cheap" else option, 0)
    rope, lengths = vision_rope_rows(grid, 2, 32, 1e4), frame_lengths(grid)
    x = torch.randn(n, args.vision_dim, dtype=torch.bfloat16, requires_grad=True)
    tracker = TensorMemoryTracker()
    tracker.register_model(block)
    with tracker:
        out = block(x, rope, lengths)
        kept = tracker.current_breakdown()["activations"] - out.untyped_storage().nbytes() - \
            rope.untyped_storage().nbytes() + x.untyped_storage().nbytes()
    assert kept == vision.checkpointed_bytes_per_patch(_planned(args, "bfloat16", ac_mode=mode, ac_option=option)) * n


# ------------------------------------------------------------------------------ plans
def test_the_resize_rule_is_the_processors():
    p = _inputs(images_per_sample=1, image_size=(1000, 700))
    enc = p.model.vision
    spec = ImageSpec(enc.patch_size, enc.temporal_patch_size, enc.merge_size, *p.image_pixels, 0, 0, 0)
    assert vision.image_grid(p) == spec.grid_of(1000, 700) == (1, 62, 44)  # sides rounded to 32 pixels
    assert vision.image_tokens(p) == 62 * 44 // 4
    small = p.replace(image_pixels=(1024, 128 * 128))  # above max_pixels: scaled down, multiples of 32
    t, h, w = vision.image_grid(small)
    assert h * w * 16 ** 2 <= 128 * 128 and h % 2 == w % 2 == 0


def test_pipeline_puts_the_encoder_on_the_first_stage():
    p = _inputs(world=16, batch=8, pp=4, images_per_sample=2, image_size=(896, 672))
    prof = pipeline_of(p)
    holds = [any(vision.holds_encoder(p, s) for s in prof.stages[r]) for r in range(p.pp)]
    assert holds == [True, False, False, False]
    units = {r: [n for n, _ in shapes.unit_shapes(p.model, prof.stages[r], 1)] for r in range(p.pp)}
    assert "vision encoder" in units[0] and not any("vision" in n for r in (1, 2, 3) for n in units[r])
    text = p.replace(images_per_sample=0)
    with_images, without = estimate_memory(p, 0), estimate_memory(text, 0)

    def activations(est) -> float:
        return next(r.bytes for r in est.moments["start of backward"] if r.name.startswith("activations ("))

    # each micro-batch in flight on rank 0 keeps its images' activations
    assert activations(with_images) - activations(without) == pytest.approx(
        prof.in_flight[0] * vision.activation_bytes(p)[0])
    for r in (1, 2, 3):  # the other stages do not see the images
        assert estimate_memory(p, r).peak == estimate_memory(text, r).peak
    step, base = estimate_step(p), estimate_step(text)
    assert step.compute_breakdown_s["vision encoder"] > 0 and "vision encoder" not in base.compute_breakdown_s
    assert step.step_s > base.step_s


def test_more_and_larger_images_cost_more_time_and_memory():
    def cost(images: float, side: int, tp: int = 1):
        p = _inputs(world=8, tp=tp, images_per_sample=images, image_size=(side, side), ac_mode="selective")
        return estimate_step(p).step_s, estimate_memory(p, 0).peak, estimate_step(p).flops_per_token

    for tp in (1, 2):
        by_count = [cost(n, 448, tp) for n in (0, 1, 2, 4)]
        by_size = [cost(1, side, tp) for side in (224, 448, 896, 1344)]
        for series in (by_count, by_size):
            for k in range(3):  # step time, peak memory, FLOPs per token: each strictly up
                assert all(a[k] < b[k] for a, b in zip(series, series[1:]))


def test_the_mfu_counts_the_encoder_and_text_only_plans_ignore_images():
    p = _inputs(images_per_sample=2, image_size=(448, 448))
    step, text = estimate_step(p), estimate_step(p.replace(images_per_sample=0))
    enc = p.model.vision
    assert step.encoder_flops_per_token == 2 * enc.flops(vision.image_grid(p)) / p.seq_len
    assert step.flops_per_token == text.flops_per_token + step.encoder_flops_per_token
    assert text.encoder_flops_per_token == 0 and text.flops_per_token == p.args.flops_per_token(p.seq_len)
    with pytest.raises(ConfigError, match="no vision encoder"):
        _inputs("9B", images_per_sample=1)


def test_the_command_prints_the_encoders_share(capsys):
    assert plan_main(["--model.name", "qwen3_5", "--model.flavor", "2B-VL", "--training.seq_len", "4096",
                      "--world-size", "8", "--gpu", "h100", "--no-trace", "--images-per-sample", "2",
                      "--image-size", "640x480", "--parallelism.data_parallel_shard_degree", "8"]) == 0
    out = capsys.readouterr().out
    assert "2 per sample of 640x480 pixels" in out and "of which the vision encoder" in out
    assert "vision encoder" in out.split("compute on the critical path")[1].splitlines()[0]


def test_a_vision_language_job_under_tensor_parallelism_traces_its_text_batches(capsys):
    """The traced step feeds text-only batches: under TP 2 the embedded text still reaches the blocks in sequence
    shards (the image scatter's output layout, which a batch without images passes too)."""
    import json
    import os

    from conftest import REPO

    assert plan_main(["--config", os.path.join(REPO, "train_configs", "vlm_shapes_debug.toml"), "--world-size", "2",
                      "--gpu", "h100", "--parallelism.tensor_parallel_degree", "2", "--json"]) == 0
    ranks = json.loads(capsys.readouterr().out)["memory"]["ranks"]
    assert ranks and all(r["traced"] and not r["traced"]["skipped"] and r["traced"]["peak_bytes"] > 0 for r in ranks)
