"""On a CUDA machine: an MLP (four 4096x4096 float32 linear layers with GELU, 256 MiB; seeded
random weights) compiled for cuda:0 as an AOTInductor package by the export helper
(scripts/reference/pt2.py: no weights inside the package, the weights a safetensors checkpoint),
and what gpu_check's `--pt2` group compares against: the input, the eager module's output and
the output of Python's own loader (`aoti_load_package` + `load_constants`) on the same package
and weights. A CUDA package runs only where it was compiled, so this runs on the GPU machine.

    python3 pt2_cuda.py OUT    # OUT/mlp.pt2, mlp.safetensors, mlp.io.safetensors (input, eager
                               # output), mlp.python.safetensors (Python's loader's), mlp.json
"""

import json
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts" / "reference"))
from pt2 import export, run

out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
torch.manual_seed(0)
layers = []
for _ in range(4):
    layers += [torch.nn.Linear(4096, 4096), torch.nn.GELU()]
module = torch.nn.Sequential(*layers).to("cuda").eval()
x = torch.randn(8, 4096, device="cuda")
with torch.no_grad():
    eager = module(x)
# Each step's result is written as soon as it exists, so that a crash in a later one (the log says
# which: run with PYTHONFAULTHANDLER=1) leaves what came before for gpu_check.
save_file({"x0": x.cpu(), "eager0": eager.cpu()}, str(out / "mlp.io.safetensors"))
print("pt2_cuda: compiling", flush=True)
started = time.perf_counter()
package, constants = export(module, (x,), out / "mlp", target=None)
compile_seconds = time.perf_counter() - started
record = {
    "torch": torch.__version__,
    "device": torch.cuda.get_device_name(),
    "compile_seconds": compile_seconds,
    "package_bytes": package.stat().st_size,
    "constant_bytes": sum(t.numel() * t.element_size() for t in constants.values()),
}
(out / "mlp.json").write_text(json.dumps(record, indent=2))
print(f"pt2_cuda: compiled in {compile_seconds:.1f} s; running Python's loader", flush=True)
y = run(package, constants, (x,))[0]
save_file({"y0": y.cpu()}, str(out / "mlp.python.safetensors"))
record["python_loader_max_diff_to_eager"] = (y - eager).abs().max().item()
(out / "mlp.json").write_text(json.dumps(record, indent=2))
print(json.dumps(record), flush=True)
