"""Compiles Shap-E's image encoder and prior as AOTInductor packages (scripts/reference/pt2.py),
beside the TorchScript export of shap_e_export.py, for `examples/shap_e.rs --format pt2`.

    python shap_e_pt2.py --components DIR

The modules are shap_e_export.py's (the configuration DIR/config.json names, the same seeded
random weights, the same wrappers), exported with torch.export and compiled for the CPU. Writes
DIR/pt2/NAME.pt2 and NAME.safetensors (its constants) for image_encoder and prior, and prints
each one's export and compile seconds and its largest difference from the eager module as JSON
lines. The renderer stays TorchScript: its ray batch holds a data-dependent assert and its
marching cubes a data-dependent unique, which torch.export refuses. Inductor fuses and reorders
float operations, so a package's outputs differ from eager ones in the last bits; that
difference is printed, not hidden. Redoes nothing when DIR/pt2/done names the same export."""
import argparse
import json
import sys
import time
from pathlib import Path

sys.dont_write_bytecode = True
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--components", type=Path, required=True)
    args = parser.parse_args()
    config = json.loads((args.components / "config.json").read_text())
    out = args.components / "pt2"
    stamp = out / "done"
    if stamp.exists() and stamp.read_text() == config.get("script", ""):
        print(f"shap_e_pt2: {out} up to date")
        return
    # Imported only when there is work: importing torch takes seconds, and the set-up runs this
    # script on every test command.
    import torch
    import shap_e_export
    from pt2 import export, run

    torch.set_grad_enabled(False)
    spec = shap_e_export.size_spec(config["size"])
    g = torch.Generator().manual_seed(1234)
    e, d, h = spec[1]["num_embeddings"], spec[1]["embedding_dim"], spec[1]["embedding_proj_dim"]
    inputs = {
        "image_encoder": (shap_e_export.ImageEncoder, (torch.randn(1, 3, 224, 224, generator=g),)),
        "prior": (shap_e_export.Prior, (torch.randn(2, e, d, generator=g), torch.tensor(17.3),
                                        torch.randn(2, 256, h, generator=g))),
    }
    out.mkdir(parents=True, exist_ok=True)
    for name, (wrapper, example) in inputs.items():
        model = wrapper(shap_e_export.build(name, spec)).eval()
        started = time.time()
        package, constants = export(model, example, out / name)
        seconds = time.time() - started
        want = model(*example)
        got = run(package, constants, example)[0]
        diff = (got.double() - want.double()).abs().max().item()
        print(json.dumps({"component": name, "size": config["size"], "export_and_compile_s": round(seconds, 1),
                          "max_abs_diff_from_eager": diff}), flush=True)
        del model, constants
    stamp.write_text(config.get("script", ""))


main()
