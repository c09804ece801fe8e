"""The architecture's rules, checked on the code itself (docs/architecture.md):

* the package import graph is acyclic, function-level imports included;
* `torchtrain/config/` imports nothing from the rest of torchtrain; nothing imports upward (`NEVER`);
  no model family imports another;
* one decision, one place: no module but the resolved layout compares data-parallel strategy names;
* the generic parallelism applier gives a model that supplies only a TP plan every strategy, AC and
  compile (the toy plugin; its multi-process parity is in test_parallel_features.py);
* the planner models the FSDP reshard policy the trainer applies (a pipeline job keeps every unit's
  parameters gathered from forward to backward; without pipelining all but the last unit reshard).
"""

from __future__ import annotations

import ast
import os
import re

import pytest
import torch
import torch.distributed as dist
from conftest import REPO

PACKAGE = os.path.join(REPO, "torchtrain")
STRATEGY_NAMES = {"zero1", "zero2", "zero3", "ddp"}


def _modules() -> dict[str, str]:
    """Dotted module name -> path, for every module of the package (packages by their __init__)."""
    out = {}
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                dotted = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
                out[dotted.removesuffix(".__init__")] = path
    return out


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """Nodes inside `if TYPE_CHECKING:` blocks (never executed)."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for n in ast.walk(node)}
    return skip


def _imported(module: str, path: str, modules: dict[str, str], type_only: bool = False) -> set[str]:
    """Package modules that importing/running `module` imports, at any nesting level.

    `import a.b.c` / `from a.b import c` run `a.b.c` (or `a.b` when c is a name) and, first, every
    package above it; a package that contains `module` is already being imported, so it is no edge.
    """
    tree = ast.parse(open(path).read())
    skip = set() if type_only else _type_checking_nodes(tree)
    is_package = path.endswith("__init__.py")
    targets: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            targets |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".") if is_package else module.split(".")[:-1]
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            subs = {f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules}
            targets |= subs
            if len(subs) < len(node.names):
                targets.add(base)
    edges = set()
    for target in targets:
        if target not in modules:
            continue
        parts = target.split(".")
        for i in range(2, len(parts) + 1):
            dep = ".".join(parts[:i])
            if dep in modules and dep != module and not (module + ".").startswith(dep + "."):
                edges.add(dep)
    return edges


def _graph(type_only: bool = False) -> dict[str, set[str]]:
    """Module -> the package modules importing it runs; with `type_only`, the imports made only for type
    annotations (`if TYPE_CHECKING:`) count too."""
    modules = _modules()
    return {m: _imported(m, p, modules, type_only) for m, p in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_import_graph_is_acyclic():
    """No circle, not even one closed only by an import for type annotations: each module can be read (and
    moved) after the ones it names."""
    graph = _graph(type_only=True)
    assert len(graph) > 50 and graph["torchtrain.train"], "the walker found the package"
    assert _cycles(graph) == []


def test_the_checker_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]


def test_config_imports_nothing_else_from_torchtrain():
    graph = _graph()
    for module, deps in graph.items():
        if module.startswith("torchtrain.config"):
            outside = {d for d in deps if not d.startswith("torchtrain.config")}
            assert not outside, f"{module} imports {sorted(outside)}"


def test_no_model_family_imports_another():
    """A family builds on models/common (and the package's shared modules), never on another family."""
    graph = _graph()
    families = {m.split(".")[2] for m in graph if m.startswith("torchtrain.models.") and m.count(".") >= 3
                and m.split(".")[2] != "common"}
    assert {"llama3", "qwen3", "qwen3_moe", "deepseek_v3"} <= families
    for module, deps in graph.items():
        if module.startswith("torchtrain.models.") and module.count(".") >= 2 and module.split(".")[2] in families:
            own = module.split(".")[2]
            others = {d for d in deps if d.startswith("torchtrain.models.") and d.split(".")[2] in families - {own}}
            assert not others, f"{module} imports {sorted(others)}"


COMMANDS = {"train", "plan", "dryrun", "generate", "score", "launcher", "launch_check", "accelerate"}
# package -> the packages it must never import (nothing imports upward): the commands (and accelerate, the
# user-loop API over config/, distributed/, utils/ and the checkpoint scan of components/) sit on top, then
# the tools, inference (using a trained model) and the planner (none imports another), then the fake world
# (the dry run and the planner's trace run the trainer's step in it), then the trainer and the post-training
# objectives it is handed through its seam (trainer/objective.py: the objectives build on the step, the loop
# builds them), then components and data, then models, distributed, config and utils.
NEVER = {
    "accelerate": COMMANDS - {"accelerate"} | {"tools", "inference", "planner", "posttrain", "trainer", "simulation",
                                                "data", "models"},
    "tools": COMMANDS | {"planner", "inference"},
    "inference": COMMANDS | {"tools", "planner", "simulation"},
    "planner": COMMANDS | {"tools", "inference"},
    "simulation": COMMANDS | {"tools", "inference", "planner"},
    "trainer": COMMANDS | {"tools", "inference", "planner", "simulation"},
    "posttrain": COMMANDS | {"tools", "inference", "planner", "simulation"},
    "components": COMMANDS | {"tools", "inference", "planner", "posttrain", "trainer", "simulation"},
    "data": COMMANDS | {"tools", "inference", "planner", "posttrain", "trainer", "simulation", "components"},
    "models": COMMANDS | {"tools", "inference", "planner", "posttrain", "trainer", "simulation", "components",
                          "distributed"},
    "distributed": COMMANDS | {"tools", "inference", "planner", "posttrain", "trainer", "simulation", "components"},
    "utils": COMMANDS | {"tools", "inference", "planner", "posttrain", "trainer", "simulation", "components", "data",
              "models", "distributed", "config"},
}


def test_nothing_imports_upward():
    for module, deps in _graph().items():
        parts = module.split(".")
        if len(parts) < 2 or parts[1] not in NEVER:
            continue
        upward = {d for d in deps if len(d.split(".")) > 1 and d.split(".")[1] in NEVER[parts[1]]}
        assert not upward, f"{module} imports {sorted(upward)}"


def _compares_strategy_names(tree: ast.AST) -> list[int]:
    """Line numbers of comparisons (==, !=, in, not in) against a strategy name literal."""
    lines = []

    def names(node: ast.AST) -> set[str]:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return {node.value}
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return set().union(*(names(e) for e in node.elts)) if node.elts else set()
        return set()

    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(names(o) & STRATEGY_NAMES for o in operands):
                lines.append(node.lineno)
    return lines


def test_only_the_layout_compares_strategy_names():
    offenders = []
    for module, path in _modules().items():
        if module == "torchtrain.distributed.layout":
            continue
        for line in _compares_strategy_names(ast.parse(open(path).read())):
            offenders.append(f"{os.path.relpath(path, REPO)}:{line}")
    assert offenders == [], "compare layout.strategy properties instead: " + ", ".join(offenders)
    sample = ast.parse('if strategy in ("zero1", "ddp"): pass\nok = x == "zero3"\nfine = y == "zero7"')
    assert _compares_strategy_names(sample) == [1, 2]


# ----------------------------------------------------------------------------- the applier
@pytest.fixture
def fake_world():
    """A fake process group (no communication): meshes and wrappers are built as on a real cluster."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def start(world: int) -> None:
        dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())

    yield start
    if dist.is_initialized():
        dist.destroy_process_group()


def _resolved_job(argv: list[str], world: int):
    from torchtrain.config import parse_args
    from torchtrain.trainer.preflight import preflight

    job = preflight(parse_args(argv), world, "cpu")
    job.layout.dims.build_mesh("cpu")
    return job


def _meta_parts(job) -> list[torch.nn.Module]:
    from torchtrain.distributed.parallelize import apply_parallelism, stage_parts

    with torch.device("meta"):
        whole = job.model_spec.model_cls(job.model_args)
    return [apply_parallelism(part, job.model_spec, job.layout) for _, part in stage_parts(whole, job.layout)]


TOY = ["--job.custom_imports", "toy_mlp", "--model.name", "toy_mlp", "--model.flavor", "small",
       "--training.dataset", "synthetic", "--training.seq_len", "32", "--training.local_batch_size", "2"]


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "zero3"])
def test_a_model_with_only_a_tp_plan_gets_every_strategy_ac_and_compile(strategy, fake_world, monkeypatch):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torch.distributed.fsdp import FSDPModule

    monkeypatch.syspath_prepend(os.path.join(REPO, "tests", "plugins"))
    fake_world(2)
    job = _resolved_job(TOY + ["--parallelism.data_parallel_strategy", strategy, "--activation_checkpoint.mode", "full",
                        "--compile.enable", "true"], 2)
    (model,) = _meta_parts(job)
    blocks = list(model.blocks)
    assert all(isinstance(b, CheckpointWrapper) for b in blocks)
    assert all(getattr(b, "_compiled_call_impl", None) is not None for b in blocks)
    if job.layout.strategy.sharded:
        assert isinstance(model, FSDPModule) and all(isinstance(b, FSDPModule) for b in blocks)
    else:
        assert not isinstance(model, FSDPModule) and hasattr(model, "register_comm_hook")  # replicate (DDP)
    assert job.layout.zero1 == (strategy == "zero1")
    assert job.layout.autocast_dtype is None  # fp32 here; bf16/fp16 on ddp/zero1 would autocast


def _units_kept_after_forward(part: torch.nn.Module) -> list[bool]:
    """Per FSDP unit (not the root), whether it keeps its gathered parameters after forward."""
    from torch.distributed.fsdp import FSDPModule

    kept, seen = [], set()
    for module in part.modules():
        if isinstance(module, FSDPModule) and module is not part:
            state = module._get_fsdp_state()  # one state per unit (a unit may group several modules)
            if id(state) not in seen:
                seen.add(id(state))
                kept.append(state._fsdp_param_group.post_forward_mesh_info is None)
    return kept


@pytest.mark.parametrize("pp, expected_row", [(2, "every unit of the stage"), (1, "last unit + prefetched block")])
def test_planner_models_the_reshard_policy_the_trainer_applies(pp, expected_row, fake_world):
    from torchtrain.planner.analytic import estimate_memory
    from torchtrain.planner.core import load_job
    from torchtrain.planner.from_job import inputs_from_config

    argv = ["--model.n_layers", "4", "--training.local_batch_size", "2", "--training.seq_len", "16",
            "--parallelism.pipeline_parallel_degree", str(pp)]
    job = load_job(argv)
    p = inputs_from_config(job.cfg, job.args, 4, "cpu", None, {})
    rows = [r.name for r in estimate_memory(p, 0).rows if r.name.startswith("gathered params")]
    assert len(rows) == 1 and expected_row in rows[0]
    fake_world(4)
    job = _resolved_job(argv, 4)
    assert job.layout.reshard_after_forward == p.reshard
    kept = _units_kept_after_forward(_meta_parts(job)[0])
    if expected_row.startswith("every unit"):
        assert kept and all(kept)
    else:
        assert kept[-1] and not any(kept[:-1])


def test_the_architecture_page_names_every_module():
    """docs/architecture.md's Layout tree names every module of the package (`name.py`): a module added without
    its line there is a module a reader of the map cannot find."""
    with open(os.path.join(REPO, "docs", "architecture.md"), encoding="utf-8") as f:
        tree = re.search(r"## Layout\n\n```text\n(.*?)```", f.read(), re.S).group(1)
    named = set(re.findall(r"\w+\.py", tree))
    missing = sorted(os.path.relpath(os.path.join(folder, name), REPO)
                     for folder, dirs, files in os.walk(PACKAGE) if "__pycache__" not in folder
                     for name in files if name.endswith(".py") and name != "__init__.py" and name not in named)
    assert not missing, f"docs/architecture.md's Layout tree does not name: {missing}"


def test_no_package_file_is_over_400_lines():
    """Small single-purpose modules: a file that outgrows 400 lines holds more than one role (split it)."""
    long = {os.path.relpath(p, REPO): n for p in _modules().values()
            if (n := sum(1 for _ in open(p))) > 400}
    assert long == {}


# What a caller may ask of a model is declared (models/base.py: BaseModelArgs, BaseModel; models/registry.py:
# ModelSpec), never found by probing. Probing is checked on the names the package gives models, their parts and
# their arguments; the Accelerate-style API (accelerate/) takes any module of the user's, and the data-parallel
# wrappers torch installs are told apart by what they offer (`WRAPPER_CAPABILITIES`), not by the model.
MODEL_NAMES = re.compile(r"^(model|models|model_parts|part|parts|whole|model_args|args|job\.args|module|block|m)$")
WRAPPER_CAPABILITIES = {"set_requires_gradient_sync", "register_comm_hook"}


def _probes(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = ast.unparse(node.func)
        if func in ("getattr", "hasattr") and len(node.args) >= 2 and MODEL_NAMES.match(ast.unparse(node.args[0])):
            name = node.args[1].value if isinstance(node.args[1], ast.Constant) else None
            if name not in WRAPPER_CAPABILITIES:
                found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif func.endswith("signature"):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_nothing_probes_a_model():
    """No getattr / hasattr / inspect.signature on a model, its parts or its arguments, the engine's own families
    and blocks included: the model declares it. Only the transformers backend (models/transformers/: transformers'
    classes and configs differ by model type in what they have) and the user-module API of accelerate/ may ask."""
    probes = {}
    for module, path in _modules().items():
        if module.startswith(("torchtrain.models.transformers", "torchtrain.accelerate")):
            continue
        found = _probes(ast.parse(open(path).read()))
        if found:
            probes[os.path.relpath(path, REPO)] = found
    assert probes == {}


def test_the_probe_checker_finds_probes():
    tree = ast.parse("getattr(model, 'num_experts', 0)\nhasattr(part, 'register_comm_hook')\n"
                     "inspect.signature(model.forward)\ngetattr(torch, 'float8')")
    assert [p.split(":")[0] for p in _probes(tree)] == ["1", "3"]


def test_the_loop_and_the_step_name_no_objective():
    """Post-training reaches the trainer through one seam (trainer/objective.py): the loop, the step and its factory
    name no objective."""
    for name in ("trainer.py", "step.py", "step_factory.py"):
        text = open(os.path.join(PACKAGE, "trainer", name)).read().lower()
        named = [w for w in ("dpo", "grpo", "preference", "reference") if w in text]
        assert not named, f"trainer/{name} names {named}"


def test_every_model_declares_what_its_forward_takes():
    """`BaseModel.forward_inputs` / `takes_cache` (what the step and the sampler read instead of the signature) say
    exactly what each model class's forward takes besides the tokens."""
    import inspect

    from torchtrain.models.base import BaseModel
    from torchtrain.models.registry import model_names

    model_names()  # (the built-in families, loaded)
    classes, todo = [], list(BaseModel.__subclasses__())
    while todo:
        cls = todo.pop()
        classes.append(cls)
        todo += cls.__subclasses__()
    assert len(classes) >= 6
    for cls in classes:
        taken = [p for p in inspect.signature(cls.forward).parameters if p not in ("self", "tokens")]
        assert (sorted(cls.forward_inputs), cls.takes_cache) == (sorted(p for p in taken if p != "cache"),
                                                                 "cache" in taken), cls
