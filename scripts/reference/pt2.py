"""Exports a module as an AOTInductor package that stageload loads (`ModelSpec::pt2`): the
package with no weights inside, the weights as a safetensors checkpoint, and the target the
package was compiled for recorded in the package itself.

    from pt2 import export
    export(module, (x,), "out/mlp")        # writes out/mlp.pt2 and out/mlp.safetensors

- `torch.export.export` then `torch._inductor.aoti_compile_and_package` with
  `aot_inductor.package_constants_in_so=False`: a package whose compiled library holds the
  weights keeps them resident as file pages nothing can release; without them it is a few MB
  and stageload owns every weight (released and refilled in place).
- The checkpoint holds every constant the package's runner expects, under its FQN: the
  parameters and buffers of `ep.state_dict` and the tensors of `ep.constants` (non-persistent
  buffers: `state_dict()` leaves them out, and a runner without one crashes), and nothing the
  compiled graph does not use (BatchNorm's step counter).
- Every weight is a constant (`always_keep_tensor_constants`): by default Inductor writes small
  tensors (a conv's bias, a BatchNorm's statistics) into the compiled kernels as literals.
- The target: compiled with `-march=x86-64-v3` and 256-bit vectors (AVX2 and FMA; portable to
  every x86-64 CPU of the last decade, not only the compiling one, which `-march=native` would
  tie it to) and recorded in the package's metadata as `stageload.target`, so that a load on a
  CPU without those instructions is a clear error instead of an illegal instruction. (Each
  constant's shape stageload reads from what the package records for its runner.)
"""
from pathlib import Path

import torch
from safetensors.torch import save_file

TARGET = "x86-64-v3"
SIMDLEN = 256


def export(module, args, out, dynamic_shapes=None, target=TARGET):
    """Writes OUT.pt2 and OUT.safetensors for `module` called on `args`, compiled for `target`
    (a `-march` level: x86-64-v2, x86-64-v3, x86-64-v4; `None` for a CUDA module, whose package
    runs where it was compiled); returns the package's path and the constants (FQN -> tensor, on
    the module's device)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    module = module.eval()
    with torch.no_grad():
        ep = torch.export.export(module, tuple(args), dynamic_shapes=dynamic_shapes)
    candidates = {**ep.state_dict, **ep.constants}
    package = out.with_suffix(".pt2")
    metadata = {}
    configs = {
        "aot_inductor.package_constants_in_so": False,
        # Small tensors (a conv's bias, a BatchNorm's statistics) are otherwise inlined into the
        # compiled kernels as literals: weights no checkpoint could change.
        "always_keep_tensor_constants": True,
        "aot_inductor.metadata": metadata,
    }
    if target is not None:
        configs.update({"cpp.march": target, "cpp.simdlen": SIMDLEN})
        metadata["stageload.target"] = target
    torch._inductor.aoti_compile_and_package(ep, package_path=str(package), inductor_configs=configs)
    # The constants: every parameter, buffer and lifted constant the graph uses (with
    # always_keep_tensor_constants each is one), found without loading the package, whose code
    # may not run on this CPU when compiled for another target.
    signature = ep.graph_signature
    # A placeholder is used when the graph's output (or an op with side effects) depends on it:
    # Inductor drops a dead branch (CLIP's pooled output when only the hidden states are
    # returned) and the package then expects none of that branch's constants.
    live, stack = set(), [n for n in ep.graph.nodes if n.op == "output" or (n.op == "call_function" and n.is_impure())]
    while stack:
        node = stack.pop()
        if node not in live:
            live.add(node)
            stack.extend(node.all_input_nodes)
    used = {node.name for node in live if node.op == "placeholder"}
    lifted = {
        **signature.inputs_to_parameters,
        **signature.inputs_to_buffers,
        **signature.inputs_to_lifted_tensor_constants,
    }
    wanted = sorted(fqn for placeholder, fqn in lifted.items() if placeholder in used)
    constants = {name: candidates[name].detach().contiguous() for name in wanted}
    save_file({name: t.cpu() for name, t in constants.items()}, str(out.with_suffix(".safetensors")))
    if target in (TARGET, None):
        expected = sorted(torch._inductor.aoti_load_package(str(package)).get_constant_fqns())
        if expected != wanted:
            raise SystemExit(f"pt2: the package expects the constants {expected}, the graph uses {wanted}")
    return package, constants


def run(package, constants, args):
    """The package's outputs on `args` as Python's own loader runs it, with `constants` as its
    weights (a list, as the runner returns them)."""
    loaded = torch._inductor.aoti_load_package(str(package))
    loaded.load_constants(constants, check_full_update=True)
    with torch.no_grad():
        out = loaded(*args)
    return list(out) if isinstance(out, (list, tuple)) else [out]
