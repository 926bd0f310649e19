"""Reference run of Shap-E image-to-3D by diffusers' own ShapEImg2ImgPipeline, on the components
scripts/reference/shap_e_export.py wrote (eager modules rebuilt from DIR/config.json, weights from
DIR/*.safetensors), for stageload's Shap-E tests and demo.

    python shap_e_reference.py --components DIR --pixels IN.safetensors
                               --steps N --guidance G --frame-size S --seed SEED --out OUT.safetensors
                               [--no-mesh] [--no-views] [--summary FILE] [--ply FILE]

IN holds pixel_values f32 [1, 3, 224, 224], given to the pipeline as a tensor (it then skips its
image processor: stageload's port of it is checked against transformers by tests/clip_image.rs).
The pipeline runs with generator = torch.Generator().manual_seed(SEED) and output_type="latent";
the latents are then decoded as the pipeline's "np" and "mesh" paths decode them (for each latent:
shap_e_renderer.decode_to_image(latent[None], device, size=S), then decode_to_mesh(latent[None],
device)), so one denoising run serves both outputs.
OUT gets:
  image_embeds    [1, 256, H] the conditional half of _encode_image's output
  initial_latents [1, E*D] prepare_latents' output (randn * init_noise_sigma)
  timesteps       [2N-1 or N+...] f32, the scheduler's timesteps
  final_latents   [1, E, D] the pipeline's output
  views           [20, S, S, 3] f32 decode_to_image's output (the np output before PIL)
  rays            [1, 20*S*S, 2, 3] the pan cameras' rays
  verts [V, 3] f32, faces [F, 3] int64, colors [V, 3] f32 (R, G, B): decode_to_mesh's mesh
(diffusers raises "torch.cat(): expected a non-empty list of Tensors" on a surface with no faces;
the reference then writes none of the mesh tensors and says "empty" in its summary; any other
error fails the reference). A JSON summary (timings, peak RSS) goes to stdout; logs to stderr."""
import argparse
import json
import os
import resource
import sys
import time

import torch

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def log(*a):
    print("shap_e_reference:", *a, file=sys.stderr, flush=True)


def load_weights(module, path, prefix, allow_missing=()):
    """DIR/NAME.safetensors (traced names) into an eager module: the wrapper prefix stripped,
    every state-dict key given a value (allow_missing: keys the export leaves out), non-persistent
    buffers checked equal to the module's own."""
    from safetensors.torch import load_file

    raw = load_file(path)
    tensors = {}
    for k, v in raw.items():
        if not k.startswith(prefix):
            raise SystemExit(f"shap_e_reference: {path}: {k} lacks the wrapper prefix {prefix!r}")
        tensors[k[len(prefix):]] = v
    keys = set(module.state_dict().keys())
    missing = sorted(keys - set(tensors) - set(allow_missing))
    if missing:
        raise SystemExit(f"shap_e_reference: {path}: no value for {missing[:10]}")
    module.load_state_dict({k: v for k, v in tensors.items() if k in keys}, strict=False)
    buffers = dict(module.named_buffers())
    for k, v in tensors.items():
        if k not in keys:
            if k not in buffers or not torch.equal(buffers[k], v):
                raise SystemExit(f"shap_e_reference: {path}: {k} is not a tensor of the eager module")


def build_pipeline(dir_, config):
    import shap_e_export
    from diffusers import HeunDiscreteScheduler, ShapEImg2ImgPipeline
    from transformers import CLIPImageProcessor

    spec = shap_e_export.size_spec(config["size"])
    modules = {}
    for name in shap_e_export.COMPONENTS:
        module = shap_e_export.build(name, spec)
        comp = config["components"][name]
        allow = [f"mlp.mlp.{i}.weight" for i in range(shap_e_export.LAYERS)] if name == "renderer" else []
        load_weights(module, os.path.join(dir_, comp["weights"]), config["wrapper_prefix"], allow)
        modules[name] = module
    with open(os.path.join(dir_, config["scheduler"])) as f:
        scheduler = HeunDiscreteScheduler.from_config(json.load(f)["scheduler_config"])
    processor = CLIPImageProcessor.from_json_file(os.path.join(dir_, config["preprocessor"]))
    return ShapEImg2ImgPipeline(prior=modules["prior"], image_encoder=modules["image_encoder"],
                                image_processor=processor, scheduler=scheduler,
                                shap_e_renderer=modules["renderer"])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--components", required=True)
    ap.add_argument("--pixels", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--guidance", type=float, required=True)
    ap.add_argument("--frame-size", type=int, required=True)
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--no-mesh", action="store_true")
    ap.add_argument("--no-views", action="store_true")
    ap.add_argument("--summary", help="also write the JSON summary to this file")
    ap.add_argument("--ply", help="also write the mesh with diffusers.utils.export_to_ply to this file")
    args = ap.parse_args()
    from diffusers.pipelines.shap_e.camera import create_pan_cameras
    from safetensors.torch import save_file

    torch.set_grad_enabled(False)
    t0 = time.time()
    with open(os.path.join(args.components, "config.json")) as f:
        config = json.load(f)
    pipe = build_pipeline(args.components, config)
    pipe.set_progress_bar_config(disable=True)
    timings = {"build": round(time.time() - t0, 2)}
    from safetensors.torch import load_file

    image = load_file(args.pixels)["pixel_values"]
    out = {}
    embeds = pipe._encode_image(image, "cpu", 1, args.guidance > 1.0)
    out["image_embeds"] = embeds[-1:].contiguous()
    captured = {}
    prepare = pipe.prepare_latents

    def prepare_latents(*a, **k):
        captured["latents"] = prepare(*a, **k)
        return captured["latents"]

    pipe.prepare_latents = prepare_latents
    t = time.time()
    latents = pipe(image, num_inference_steps=args.steps, guidance_scale=args.guidance, frame_size=args.frame_size,
                   generator=torch.Generator().manual_seed(args.seed), output_type="latent").images
    timings["encode_and_denoise"] = round(time.time() - t, 2)
    out["initial_latents"] = captured["latents"].contiguous()
    out["timesteps"] = pipe.scheduler.timesteps.contiguous()
    out["final_latents"] = latents.contiguous()
    summary = {"mesh": "not run" if args.no_mesh else None}
    renderer = pipe.shap_e_renderer
    if not args.no_views:
        t = time.time()
        views = torch.stack([renderer.decode_to_image(lat[None, :], "cpu", size=args.frame_size) for lat in latents])
        timings["views"] = round(time.time() - t, 2)
        out["views"] = views[0].contiguous()
        out["rays"] = create_pan_cameras(args.frame_size).camera_rays.contiguous()
    if not args.no_mesh:
        t = time.time()
        try:
            mesh = renderer.decode_to_mesh(latents[0][None, :], "cpu")
        except ValueError as error:  # diffusers' texture loop runs zero times on a surface without faces
            if "expected a non-empty list of Tensors" not in str(error):
                raise
            summary["mesh"] = "empty"
        else:
            out["verts"] = mesh.verts.contiguous()
            out["faces"] = mesh.faces.contiguous()
            out["colors"] = torch.stack([mesh.vertex_channels[c] for c in "RGB"], dim=-1).contiguous()
            summary["mesh"] = {"vertices": mesh.verts.shape[0], "faces": mesh.faces.shape[0]}
            if args.ply:
                from diffusers.utils import export_to_ply

                export_to_ply(mesh, args.ply)
        timings["mesh"] = round(time.time() - t, 2)
    save_file(out, args.out)
    timings["total"] = round(time.time() - t0, 2)
    summary.update(timings=timings, peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                   timesteps=[float(x) for x in pipe.scheduler.timesteps])
    log(f"steps {args.steps}, guidance {args.guidance}, frame {args.frame_size}, seed {args.seed}: {timings}, "
        f"mesh {summary['mesh']}")
    print(json.dumps(summary))
    if args.summary:
        with open(args.summary, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
