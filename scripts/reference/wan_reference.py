"""Runs diffusers' own WanPipeline (text to video) on an export of wan_export.py: the same weights,
token ids and seed as stageload's Rust pipeline (crates/pipelines/src/wan/mod.rs), and writes what it
computed for the comparison.

    python wan_reference.py --components DIR --steps N --guidance G --seed S --out OUT.safetensors
                            --summary SUMMARY.json

The pipeline is diffusers' WanPipeline as published (UMT5EncoderModel, WanTransformer3DModel,
AutoencoderKLWan, UniPCMultistepScheduler with the export's config), built around the export's
weights: the text encoder's from its TorchScript module (the export writes no second copy), the
transformer's and the VAE decoder's from their safetensors, each module built empty
(accelerate's init_empty_weights, as from_pretrained does) and given the tensors in place. No
tokenizer is fetched: a stand-in returns the export's token ids and masks for the prompt and the
empty negative prompt, padded to max_sequence_length, as the umT5 tokenizer would.

OUT holds: prompt_embeds and (guidance above 1) negative_prompt_embeds (bf16 [1, L, d], what the
transformer sees),
initial_latents (f32 [1, 16, T, h, w], prepare_latents' draw from torch.Generator().manual_seed(S)),
final_latents (after the last scheduler step), timesteps (int64), video (f32 [F, H, W, 3], the
pipeline's output_type="np") and frames (uint8 [F, H, W, 3], diffusers' numpy_to_pil of it).
SUMMARY: wall times, the process's peak resident set, versions."""
import argparse
import json
import os
import resource
import sys
import time

sys.dont_write_bytecode = True


def log(*a):
    print("wan_reference:", *a, file=sys.stderr, flush=True)


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--components", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--guidance", type=float, required=True)
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--summary", required=True)
    return ap.parse_args()


def strip(state, prefix):
    if any(not k.startswith(prefix) for k in state):
        raise SystemExit(f"wan_reference: tensor names without the wrapper prefix {prefix!r}")
    return {k[len(prefix):]: v for k, v in state.items()}


def load_into(model, state, what, allowed_missing=()):
    """Gives model the tensors of state in place. The traced module also lists the buffers diffusers
    does not save (non-persistent: the rotary tables, computed from the config): those must equal
    the ones the empty module computed, and are not loaded."""
    import torch

    persistent = set(model.state_dict())
    for name, buffer in model.named_buffers():
        if name in state and name not in persistent:
            if not torch.equal(state.pop(name), buffer):
                raise SystemExit(f"wan_reference: {what}: the export's {name} differs from the one diffusers computes")
    result = model.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in result.missing_keys if not k.startswith(allowed_missing)] if allowed_missing else result.missing_keys
    if missing or result.unexpected_keys:
        raise SystemExit(f"wan_reference: {what}: missing {missing[:5]}, unexpected {result.unexpected_keys[:5]}")


def bf16_umt5(config):
    """The umT5 encoder as wan_export.py builds it: its tensors made in bfloat16."""
    import torch
    from transformers import UMT5Config, UMT5EncoderModel

    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        return UMT5EncoderModel(UMT5Config(**config))
    finally:
        torch.set_default_dtype(previous)


class Tokens:
    """Stands in for the umT5 tokenizer: the export's ids for the prompt ("prompt") and the empty
    negative prompt, with their masks (WanPipeline asks for padding to max_length, truncation,
    attention masks, tensors)."""

    def __init__(self, ids):
        self.ids = ids

    def __call__(self, prompts, padding, max_length, truncation, add_special_tokens, return_attention_mask,
                 return_tensors):
        import torch

        assert padding == "max_length" and return_tensors == "pt" and return_attention_mask
        rows = {"prompt": (self.ids["prompt"], self.ids["prompt_mask"]), "": (self.ids["negative"], self.ids["negative_mask"])}
        picked = [rows[p] for p in prompts]
        if any(len(i) != max_length for i, _ in picked):
            raise SystemExit(f"wan_reference: token ids are not {max_length} long")

        class Out:
            input_ids = torch.tensor([i for i, _ in picked], dtype=torch.int64)
            attention_mask = torch.tensor([m for _, m in picked], dtype=torch.int64)

        return Out


def main(args):
    t_start = time.time()
    import torch
    from accelerate import init_empty_weights
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from diffusers.image_processor import VaeImageProcessor
    from safetensors.torch import load_file
    import numpy as np

    torch.set_grad_enabled(False)
    with open(os.path.join(args.components, "config.json")) as f:
        cfg = json.load(f)
    comps = cfg["components"]
    prefix = cfg["wrapper_prefix"]

    with init_empty_weights():
        text_encoder = bf16_umt5(comps["text_encoder"]["config"])
        transformer = WanTransformer3DModel(**comps["transformer"]["config"])
        vae = AutoencoderKLWan(**comps["vae_decoder"]["config"])
    state = torch.jit.load(os.path.join(args.components, comps["text_encoder"]["file"])).state_dict()
    load_into(text_encoder, strip(dict(state), prefix), "text_encoder")
    del state
    load_into(transformer, strip(load_file(os.path.join(args.components, comps["transformer"]["weights"])), prefix),
              "transformer")
    load_into(vae, strip(load_file(os.path.join(args.components, comps["vae_decoder"]["weights"])), prefix),
              "vae_decoder", allowed_missing=("encoder.", "quant_conv."))
    del vae.encoder, vae.quant_conv  # not exported; the pipeline never calls them
    for m in (text_encoder, transformer, vae):
        m.eval()
    scheduler = UniPCMultistepScheduler(**cfg["scheduler"]["config"])
    pipe = WanPipeline(tokenizer=Tokens(cfg["token_ids"]), text_encoder=text_encoder, transformer=transformer,
                       vae=vae, scheduler=scheduler)
    pipe.set_progress_bar_config(disable=True)
    t_built = time.time()

    seen = {}
    encode = pipe.encode_prompt

    def encode_prompt(*a, **k):
        seen["embeds"] = encode(*a, **k)
        return seen["embeds"]

    prepare = pipe.prepare_latents

    def prepare_latents(*a, **k):
        seen["initial_latents"] = prepare(*a, **k).clone()
        return seen["initial_latents"]

    def on_step_end(pipeline, i, t, kwargs):
        seen["final_latents"] = kwargs["latents"].clone()
        return {}

    pipe.encode_prompt, pipe.prepare_latents = encode_prompt, prepare_latents
    video = pipe(prompt="prompt", negative_prompt="", height=cfg["height"], width=cfg["width"],
                 num_frames=cfg["num_frames"], num_inference_steps=args.steps, guidance_scale=args.guidance,
                 generator=torch.Generator().manual_seed(args.seed), output_type="np",
                 max_sequence_length=cfg["max_sequence_length"], callback_on_step_end=on_step_end).frames
    t_done = time.time()
    frames = np.stack([np.array(im) for im in VaeImageProcessor.numpy_to_pil(video[0])])
    from safetensors.torch import save_file

    prompt_embeds, negative_embeds = seen["embeds"]
    tensors = {} if negative_embeds is None else {"negative_prompt_embeds": negative_embeds.contiguous()}
    save_file({
        **tensors,
        "prompt_embeds": prompt_embeds.contiguous(),
        "initial_latents": seen["initial_latents"].contiguous(),
        "final_latents": seen["final_latents"].contiguous(),
        "timesteps": pipe.scheduler.timesteps.to(torch.int64).contiguous(),
        "video": torch.from_numpy(np.ascontiguousarray(video[0])),
        "frames": torch.from_numpy(np.ascontiguousarray(frames)),
    }, args.out)
    import importlib.metadata as md

    summary = {
        "build_seconds": round(t_built - t_start, 2),
        "pipeline_seconds": round(t_done - t_built, 2),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "versions": {p: md.version(p) for p in ("torch", "diffusers", "transformers", "accelerate")},
        "steps": args.steps, "guidance": args.guidance, "seed": args.seed,
    }
    with open(args.summary, "w") as f:
        json.dump(summary, f, indent=1)
    log(json.dumps(summary))


if __name__ == "__main__":
    main(parse_args())
