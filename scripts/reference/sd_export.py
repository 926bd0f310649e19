"""Exports the three components of Stable Diffusion (CLIP text encoder, UNet denoiser, VAE decoder)
as TorchScript modules, with seeded random weights (trained weights cannot be fetched here), for
the staged-pipeline tests and for scripts/reference/sd_reference.py.

    python sd_export.py --size {small,sd15} --out DIR [--device cuda]

--device traces there (default the CPU): a trace records the device of the tensors it makes
(diffusers' UNet moves the timestep to the sample's device and builds its embedding there), so a
CPU trace runs on the CPU only and a CUDA trace on CUDA only. The weights are the same either way
(built on the CPU, then moved).

Writes into DIR (atomically: DIR.tmp-<pid>, renamed at the end):
  text_encoder.pt     input_ids int64 [1, 77]                       -> last_hidden_state [1, 77, hidden]
  unet.pt             sample f32 [2, 4, h, w], timestep 0-d int64,
                      encoder_hidden_states f32 [2, 77, cross_dim]  -> noise prediction [2, 4, h, w]
  vae_decoder.pt      latents f32 [1, 4, h, w] (already divided by the scaling factor)
                                                                    -> image [1, 3, H, W], about [-1, 1]
  NAME.safetensors    every parameter and buffer of the traced module, under the traced module's names
  config.json         the component configs, token ids, scheduler config, shapes, versions, checks

Every traced module is checked against its eager module (bit for bit, on the trace inputs and on a
second input, both in memory and after torch.jit.save/load); any difference fails the export.
If DIR/config.json already names the same size, format and versions, nothing is done ("up to date")."""
import argparse
import importlib.metadata
import json
import os
import shutil
import sys
import time
import warnings

FORMAT = 1
# The wrappers hold the eager module as `self.model`, so every traced name starts with this.
PREFIX = "model."
SEQ = 77


def log(*a):
    print("sd_export:", *a, file=sys.stderr, flush=True)


def versions():
    """The installed distributions' versions (importlib.metadata: no import, so the up-to-date check
    answers in a fraction of a second; torch's local tag such as +cu130 is not part of it)."""
    return {p: importlib.metadata.version(p) for p in ("torch", "diffusers", "transformers", "safetensors")}


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=["small", "sd15"], required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    args.out = os.path.abspath(args.out.rstrip("/"))
    return args


def up_to_date(args):
    cfg_path = os.path.join(args.out, "config.json")
    if not os.path.exists(cfg_path):
        return False
    try:
        with open(cfg_path) as f:
            old = json.load(f)
    except (OSError, ValueError):
        old = {}
    same = (old.get("size"), old.get("format"), old.get("versions"), old.get("device", "cpu"))
    if same == (args.size, FORMAT, versions(), args.device):
        return True
    log(f"{args.out} holds an export of another size, format or version; redoing it")
    return False


if __name__ == "__main__":
    ARGS = parse_args()
    if up_to_date(ARGS):
        print(f"sd_export: {ARGS.out} up to date")
        sys.exit(0)

import torch  # noqa: E402  (after the up-to-date check: importing torch takes seconds)
from torch import nn  # noqa: E402

# The tracer warns at every shape-dependent Python branch (attention shapes, upsampling sizes): the
# traced modules are specialised to the traced shapes (batch 2 and the latent size for the unet).
warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")


SCHEDULER = dict(
    num_train_timesteps=1000,
    beta_start=0.00085,
    beta_end=0.012,
    beta_schedule="scaled_linear",
    clip_sample=False,
    set_alpha_to_one=False,
    steps_offset=1,
    prediction_type="epsilon",
    timestep_spacing="leading",
)


def token_ids(bos, eos, pad, words):
    prompt = [bos] + list(words) + [eos]
    empty = [bos, eos]
    return prompt + [pad] * (SEQ - len(prompt)), empty + [pad] * (SEQ - len(empty))


def size_spec(size):
    if size == "sd15":
        text = dict(
            vocab_size=49408, hidden_size=768, intermediate_size=3072, projection_dim=768,
            num_hidden_layers=12, num_attention_heads=12, max_position_embeddings=SEQ,
            hidden_act="quick_gelu", layer_norm_eps=1e-5,
            bos_token_id=49406, eos_token_id=49407, pad_token_id=49407,
        )
        unet = dict(
            sample_size=64, in_channels=4, out_channels=4, center_input_sample=False,
            flip_sin_to_cos=True, freq_shift=0,
            down_block_types=["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
            up_block_types=["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"],
            block_out_channels=[320, 640, 1280, 1280], layers_per_block=2, downsample_padding=1,
            mid_block_scale_factor=1, act_fn="silu", norm_num_groups=32, norm_eps=1e-5,
            cross_attention_dim=768, attention_head_dim=8,
        )
        vae = dict(
            in_channels=3, out_channels=3,
            down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
            block_out_channels=[128, 256, 512, 512], layers_per_block=2, act_fn="silu",
            latent_channels=4, norm_num_groups=32, sample_size=512, scaling_factor=0.18215,
        )
        latent = [32, 32]
        # CLIP-style ids (bos, a dozen word ids, eos, eos padding); not a real tokenisation.
        prompt, empty = token_ids(49406, 49407, 49407,
                                  [320, 1125, 539, 550, 18376, 6765, 320, 4558, 525, 518, 3293, 1208])
    elif size == "small":
        text = dict(
            vocab_size=1000, hidden_size=32, intermediate_size=64, projection_dim=32,
            num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=SEQ,
            hidden_act="quick_gelu", layer_norm_eps=1e-5,
            bos_token_id=998, eos_token_id=999, pad_token_id=999,
        )
        unet = dict(
            sample_size=8, in_channels=4, out_channels=4, center_input_sample=False,
            flip_sin_to_cos=True, freq_shift=0,
            down_block_types=["CrossAttnDownBlock2D", "DownBlock2D"],
            up_block_types=["UpBlock2D", "CrossAttnUpBlock2D"],
            block_out_channels=[32, 64], layers_per_block=1, downsample_padding=1,
            mid_block_scale_factor=1, act_fn="silu", norm_num_groups=32, norm_eps=1e-5,
            cross_attention_dim=32, attention_head_dim=8,
        )
        vae = dict(
            in_channels=3, out_channels=3,
            down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2,
            block_out_channels=[32, 64], layers_per_block=1, act_fn="silu",
            latent_channels=4, norm_num_groups=32, sample_size=16, scaling_factor=0.18215,
        )
        latent = [8, 8]
        prompt, empty = token_ids(998, 999, 999, [12, 345, 67, 890, 23, 456, 78, 901, 34, 567, 89, 120])
    else:
        raise SystemExit(f"unknown size {size!r}")
    return text, unet, vae, latent, prompt, empty


class TextEncoder(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids).last_hidden_state


class Unet(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, sample, timestep, encoder_hidden_states):
        return self.model(sample, timestep, encoder_hidden_states=encoder_hidden_states, return_dict=False)[0]


class VaeDecoder(nn.Module):
    """What AutoencoderKL.decode runs (no tiling, no slicing): post_quant_conv, then decoder."""

    def __init__(self, vae):
        super().__init__()
        self.model = nn.Module()
        self.model.post_quant_conv = vae.post_quant_conv
        self.model.decoder = vae.decoder

    def forward(self, z):
        return self.model.decoder(self.model.post_quant_conv(z))


def build(text_cfg, unet_cfg, vae_cfg, attn="sdpa"):
    """Eager modules, each built after torch.manual_seed(0). sd_reference.py rebuilds them the same way."""
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()

    torch.manual_seed(0)
    cfg = CLIPTextConfig(**text_cfg)
    cfg._attn_implementation = attn
    text = CLIPTextModel(cfg).eval()
    torch.manual_seed(0)
    unet = UNet2DConditionModel(**unet_cfg).eval()
    torch.manual_seed(0)
    vae = AutoencoderKL(**vae_cfg).eval()
    return text, unet, vae


def max_diff(a, b):
    if a.shape != b.shape or a.dtype != b.dtype:
        raise SystemExit(f"sd_export: traced output {a.dtype}{tuple(a.shape)} != eager {b.dtype}{tuple(b.shape)}")
    return (a.double() - b.double()).abs().max().item()


def export(name, wrapper, eager_fn, cases, tmp, extra_check=None):
    """Traces wrapper on cases[0], saves it, checks traced (in memory and reloaded) against eager_fn
    on every case bit for bit, and writes NAME.safetensors from the traced module."""
    from safetensors.torch import save_file

    t0 = time.time()
    with torch.no_grad():
        traced = torch.jit.trace(wrapper, cases[0], check_trace=False)
    trace_s = time.time() - t0
    path = os.path.join(tmp, f"{name}.pt")
    torch.jit.save(traced, path)
    reloaded = torch.jit.load(path)
    checks = []
    eager_outs = []
    with torch.no_grad():
        for i, case in enumerate(cases):
            want = eager_fn(*case)
            eager_outs.append(want)
            if not torch.isfinite(want).all():
                raise SystemExit(f"sd_export: {name}: eager output on case {i} is not finite")
            d_mem = max_diff(traced(*case), want)
            d_file = max_diff(reloaded(*case), want)
            checks.append({"case": i, "max_abs_diff": d_mem, "max_abs_diff_reloaded": d_file,
                           "eager_abs_max": want.abs().max().item(), "eager_std": want.float().std().item()})
            log(f"{name}: case {i}: traced vs eager max |diff| {d_mem} (reloaded {d_file})")
            if d_mem != 0.0 or d_file != 0.0:
                raise SystemExit(f"sd_export: {name}: traced module differs from eager on case {i}: "
                                 f"max |diff| {d_mem} in memory, {d_file} reloaded")
    if extra_check is not None:
        extra_check(eager_outs)
    tensors = {}
    for n, p in reloaded.named_parameters():
        tensors[n] = p.detach().cpu().contiguous()
    buffers = []
    for n, b in reloaded.named_buffers():
        if n in tensors:
            raise SystemExit(f"sd_export: {name}: {n} is both a parameter and a buffer")
        tensors[n] = b.detach().cpu().contiguous()
        buffers.append({"name": n, "dtype": str(b.dtype).replace("torch.", ""), "shape": list(b.shape)})
    # The traced module's names must be the eager wrapper's names (the reference maps them back).
    eager_names = {n for n, _ in wrapper.named_parameters()} | {n for n, _ in wrapper.named_buffers()}
    if set(tensors) != eager_names:
        raise SystemExit(f"sd_export: {name}: traced names differ from the wrapper's: "
                         f"{sorted(set(tensors) ^ eager_names)[:10]}")
    st = os.path.join(tmp, f"{name}.safetensors")
    save_file(tensors, st)
    os.chmod(st, 0o644)  # safetensors writes 0600; the .pt files get the umask's mode
    params = sum(p.numel() for _, p in reloaded.named_parameters())
    log(f"{name}: {params} parameters, buffers {buffers}, traced in {trace_s:.1f} s")
    info = {
        "file": f"{name}.pt",
        "weights": f"{name}.safetensors",
        "parameters": params,
        "parameter_tensors": sum(1 for _ in reloaded.named_parameters()),
        "buffers": buffers,
        "trace_inputs": [{"dtype": str(x.dtype).replace("torch.", ""), "shape": list(x.shape)} for x in cases[0]],
        "output_shape": list(eager_outs[0].shape),
        "checks": checks,
        "trace_seconds": round(trace_s, 2),
    }
    return info, eager_outs


def main(args):
    out = args.out
    vers = versions()
    torch.set_grad_enabled(False)
    t_start = time.time()
    text_cfg, unet_cfg, vae_cfg, latent, prompt_ids, empty_ids = size_spec(args.size)
    text, unet, vae = build(text_cfg, unet_cfg, vae_cfg)
    device = torch.device(args.device)
    text, unet, vae = text.to(device), unet.to(device), vae.to(device)
    log(f"built {args.size} modules on {device} in {time.time() - t_start:.1f} s")
    h, w = latent
    scale = 2 ** (len(vae_cfg["block_out_channels"]) - 1)
    g = torch.Generator().manual_seed(1234)

    tmp = f"{out}.tmp-{os.getpid()}"
    os.makedirs(tmp)
    try:
        comps = {}
        ids = torch.tensor([prompt_ids], dtype=torch.int64, device=device)
        ids_empty = torch.tensor([empty_ids], dtype=torch.int64, device=device)
        comps["text_encoder"], _ = export(
            "text_encoder", TextEncoder(text), lambda i: text(input_ids=i).last_hidden_state,
            [(ids,), (ids_empty,)], tmp)
        log(f"text_encoder done at {time.time() - t_start:.1f} s")

        cross = unet_cfg["cross_attention_dim"]
        s1, e1, s2, e2 = (torch.randn(*shape, generator=g).to(device)
                          for shape in [(2, 4, h, w), (2, SEQ, cross), (2, 4, h, w), (2, SEQ, cross)])
        # Timesteps as the pipeline passes them: 0-d int64 tensors (elements of scheduler.timesteps).
        t1, t2 = torch.tensor(751, dtype=torch.int64), torch.tensor(1, dtype=torch.int64)

        def timestep_matters(outs):
            d = (outs[2] - outs[0]).abs().max().item()
            log(f"unet: same sample, timestep 751 vs 1: outputs differ by {d}")
            if d == 0.0:
                raise SystemExit("sd_export: unet: the timestep has no effect on the traced module's output")

        comps["unet"], _ = export(
            "unet", Unet(unet),
            lambda s, t, e: unet(s, t, encoder_hidden_states=e, return_dict=False)[0],
            [(s1, t1, e1), (s2, t2, e2), (s1, t2, e1)], tmp, extra_check=timestep_matters)
        comps["unet"]["timestep"] = "0-d int64 tensor (as StableDiffusionPipeline passes an element of scheduler.timesteps)"
        log(f"unet done at {time.time() - t_start:.1f} s")

        z1, z2 = (torch.randn(1, 4, h, w, generator=g).to(device) for _ in range(2))
        dec = VaeDecoder(vae)
        with torch.no_grad():  # the wrapper is exactly AutoencoderKL.decode
            d = max_diff(dec(z1), vae.decode(z1, return_dict=False)[0])
        if d != 0.0:
            raise SystemExit(f"sd_export: VaeDecoder wrapper differs from AutoencoderKL.decode by {d}")
        comps["vae_decoder"], _ = export(
            "vae_decoder", dec, lambda z: vae.decode(z, return_dict=False)[0], [(z1,), (z2,)], tmp)
        log(f"vae_decoder done at {time.time() - t_start:.1f} s")

        comps["text_encoder"].update(cls="transformers.CLIPTextModel", config=text_cfg,
                                     attn_implementation=text.config._attn_implementation)
        comps["unet"].update(cls="diffusers.UNet2DConditionModel", config=unet_cfg)
        comps["vae_decoder"].update(cls="diffusers.AutoencoderKL", config=vae_cfg,
                                    note="holds post_quant_conv and decoder only (names as in AutoencoderKL "
                                         "after the prefix); the encoder and quant_conv are not exported")
        config = {
            "format": FORMAT,
            "size": args.size,
            "versions": vers,
            "torch_build": torch.__version__,
            "device": str(device),
            "seed": "torch.manual_seed(0) before building each component",
            "wrapper_prefix": PREFIX,
            "seq_len": SEQ,
            "latent_size": latent,
            "latent_channels": 4,
            "vae_scale_factor": scale,
            "image_size": [h * scale, w * scale],
            "vae_scaling_factor": vae_cfg["scaling_factor"],
            "scheduler": {"cls": "diffusers.DDIMScheduler", "config": SCHEDULER},
            "token_ids": {"prompt": prompt_ids, "empty": empty_ids},
            "components": comps,
            "export_seconds": None,
        }
        config["export_seconds"] = round(time.time() - t_start, 1)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config, f, indent=1)
        old = None
        if os.path.exists(out):
            old = f"{out}.old-{os.getpid()}"
            os.rename(out, old)
        os.rename(tmp, out)
        if old:
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    sizes = {n: os.path.getsize(os.path.join(out, n)) for n in sorted(os.listdir(out))}
    log(f"wrote {out} in {time.time() - t_start:.1f} s: {sizes}")
    print(f"sd_export: wrote {out}")


if __name__ == "__main__":
    main(ARGS)
