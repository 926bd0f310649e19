"""Exports Stable Diffusion's components as AOTInductor packages (scripts/reference/pt2.py), beside
the TorchScript export of sd_export.py, for the .pt2 benchmark (crates/bench/src/bin/bench_pt2.rs).

    python sd_pt2.py --size {small,sd15} --components DIR [--only NAME ...]

The modules are sd_export.py's (the same configurations, the same seeded random weights: trained
weights cannot be fetched here) and the same wrappers. Writes DIR/pt2/NAME.pt2, NAME.safetensors
(its constants) and NAME.inputs.safetensors (the example inputs it was exported for, `x0`, `x1`,
...), and prints each component's export and compile seconds as JSON lines.
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sd_export  # noqa: E402
from pt2 import export  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", choices=["small", "sd15"], required=True)
    parser.add_argument("--components", type=Path, required=True)
    parser.add_argument("--only", nargs="*", default=["text_encoder", "unet", "vae_decoder"])
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    text_cfg, unet_cfg, vae_cfg, latent, prompt, _ = sd_export.size_spec(args.size)
    text, unet, vae = sd_export.build(text_cfg, unet_cfg, vae_cfg)
    h, w = latent
    g = torch.Generator().manual_seed(1234)
    inputs = {
        "text_encoder": (sd_export.TextEncoder(text), (torch.tensor([prompt], dtype=torch.int64),)),
        "unet": (
            sd_export.Unet(unet),
            (
                torch.randn(2, 4, h, w, generator=g),
                torch.tensor(751, dtype=torch.int64),
                torch.randn(2, sd_export.SEQ, unet_cfg["cross_attention_dim"], generator=g),
            ),
        ),
        "vae_decoder": (sd_export.VaeDecoder(vae), (torch.randn(1, 4, h, w, generator=g),)),
    }
    out = args.components / "pt2"
    out.mkdir(parents=True, exist_ok=True)
    for name in args.only:
        module, example = inputs[name]
        started = time.time()
        export(module, example, out / name)
        seconds = time.time() - started
        save_file({f"x{i}": x.contiguous() for i, x in enumerate(example)}, str(out / f"{name}.inputs.safetensors"))
        print(json.dumps({"component": name, "size": args.size, "export_and_compile_s": round(seconds, 1)}), flush=True)


main()
