"""Exports the three neural parts of diffusers' WanPipeline (Wan2.1 text-to-video 1.3B) as TorchScript
modules with seeded random weights (trained weights cannot be fetched here), for stageload's staged
Wan pipeline (crates/pipelines/src/wan/mod.rs) and for scripts/reference/wan_reference.py, which runs
diffusers' own pipeline on the same weights.

    python wan_export.py --size {small,published} --out DIR

Writes into DIR (atomically: DIR.tmp-<pid>, renamed at the end):
  text_encoder.pt   input_ids int64 [1, L], attention_mask int64 [1, L]
                      -> UMT5EncoderModel's last_hidden_state bf16 [1, L, d_model]
                    No safetensors beside it: its weights live in the module file only (the published
                    encoder is 11.4 GB; the pipeline encodes once, so a release never needs a refill,
                    and a second copy would double the export's disk). The reference reads them back
                    from the module (torch.jit.load(...).state_dict()).
  transformer.pt    hidden_states bf16 [1, 16, T, h, w], timestep int64 [1], encoder_hidden_states
                    bf16 [1, L, d_model] -> the flow prediction bf16 [1, 16, T, h, w] (one call per
                    CFG branch, as WanPipeline calls it)
  vae_decoder.pt    latents f32 [1, 16, T, h, w] -> video f32 [1, 3, F, H, W] in [-1, 1]: what WanPipeline
                    runs after the loop (latents / (1 / latents_std) + latents_mean, then
                    AutoencoderKLWan.decode: post_quant_conv and the decoder one latent frame at a time
                    with its causal cache, as diffusers chunks it; the trace unrolls that loop)
  NAME.safetensors  (transformer, vae_decoder) every parameter and buffer under the traced module's names
  config.json       the component configs, shapes, dtypes, token ids, scheduler config, versions, checks

L (max_sequence_length), F (frames) and H x W are fixed by the size: a trace is specialised to its
shapes. Dtypes are the published pipeline's (the Wan2.1-T2V-1.3B-Diffusers model card loads the VAE in
float32 and the pipeline with torch_dtype=bfloat16): the text encoder bf16 (as published), the
transformer bf16 except the modules diffusers keeps in float32 on such a load
(WanTransformer3DModel._keep_in_fp32_modules, applied here with from_pretrained's own rule and
checked against a real save_pretrained/from_pretrained round trip at the small size), the VAE float32.

Weights: torch.manual_seed(0) before building each component (the text encoder built directly in
bf16: built in float32 the published one would need 22.7 GB). Every traced module is checked against
its eager module bit for bit on its trace inputs and on other inputs, in memory and after
torch.jit.load (the reload in a second pass, after the eager module is freed, so that the published
encoder is never in memory twice); any difference fails the export. The published size exports one
component per process. If DIR/config.json already names the same size, format, versions and script,
nothing is done."""
import argparse
import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import time
import warnings

FORMAT = 1
PREFIX = "model."
COMPONENTS = ("text_encoder", "transformer", "vae_decoder")
SEED = 1234  # the check inputs' generator

# The published scheduler (Wan-AI/Wan2.1-T2V-1.3B-Diffusers scheduler/scheduler_config.json): UniPC over
# flow sigmas with the 480p shift.
SCHEDULER = dict(
    num_train_timesteps=1000, beta_start=0.0001, beta_end=0.02, beta_schedule="linear", trained_betas=None,
    solver_order=2, prediction_type="flow_prediction", thresholding=False, dynamic_thresholding_ratio=0.995,
    sample_max_value=1.0, predict_x0=True, solver_type="bh2", lower_order_final=True, disable_corrector=[],
    solver_p=None, use_karras_sigmas=False, use_exponential_sigmas=False, use_beta_sigmas=False,
    use_flow_sigmas=True, flow_shift=3.0, timestep_spacing="linspace", steps_offset=0, final_sigmas_type="zero",
    rescale_betas_zero_snr=False,
)

sys.dont_write_bytecode = True


def log(*a):
    print("wan_export:", *a, file=sys.stderr, flush=True)


def versions():
    return {p: importlib.metadata.version(p) for p in ("torch", "diffusers", "transformers", "safetensors", "numpy")}


def script_hash():
    with open(os.path.abspath(__file__), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:16]


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=["small", "published"], required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--component", choices=COMPONENTS, help="(internal) export only this one into --out")
    args = ap.parse_args()
    args.out = os.path.abspath(args.out.rstrip("/"))
    return args


def up_to_date(args):
    try:
        with open(os.path.join(args.out, "config.json")) as f:
            old = json.load(f)
    except (OSError, ValueError):
        return False
    if (old.get("size"), old.get("format"), old.get("versions"), old.get("script")) == (
            args.size, FORMAT, versions(), script_hash()):
        return True
    log(f"{args.out} holds an export of another size, format, version or script; redoing it")
    return False


if __name__ == "__main__":
    ARGS = parse_args()
    if ARGS.component is None and up_to_date(ARGS):
        print(f"wan_export: {ARGS.out} up to date")
        sys.exit(0)

import torch  # noqa: E402  (after the up-to-date check: importing torch takes seconds)
from torch import nn  # noqa: E402

warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=UserWarning, module="torch.jit")


def size_spec(size):
    """(text config, transformer config, vae config, video): the published ones (Wan-AI/
    Wan2.1-T2V-1.3B-Diffusers' config.json files; the VAE's are AutoencoderKLWan's defaults) or a
    small configuration of the same block types. video: the sequence length, frames and frame size
    the traces are specialised to."""
    if size == "published":
        text = dict(vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
                    relative_attention_num_buckets=32, relative_attention_max_distance=128, dropout_rate=0.1,
                    layer_norm_epsilon=1e-6, initializer_factor=1.0, feed_forward_proj="gated-gelu",
                    is_encoder_decoder=True, tie_word_embeddings=False, pad_token_id=0, eos_token_id=1,
                    decoder_start_token_id=0)
        transformer = dict(patch_size=[1, 2, 2], num_attention_heads=12, attention_head_dim=128, in_channels=16,
                           out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30,
                           cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, image_dim=None,
                           added_kv_proj_dim=None, rope_max_seq_len=1024)
        vae = dict(base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                   temperal_downsample=[False, True, True], dropout=0.0)
        # The run's shapes (not the model's): the pipeline's defaults (512 tokens, 81 frames of 480 x 832)
        # would take hours on a 2-core CPU, where bf16 matrix products run at about 10 GFLOP/s here.
        video = dict(max_sequence_length=64, num_frames=5, height=64, width=64)
    else:
        text = dict(vocab_size=1000, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                    relative_attention_num_buckets=32, relative_attention_max_distance=128, dropout_rate=0.1,
                    layer_norm_epsilon=1e-6, initializer_factor=1.0, feed_forward_proj="gated-gelu",
                    is_encoder_decoder=True, tie_word_embeddings=False, pad_token_id=0, eos_token_id=1,
                    decoder_start_token_id=0)
        transformer = dict(patch_size=[1, 2, 2], num_attention_heads=2, attention_head_dim=12, in_channels=16,
                           out_channels=16, text_dim=32, freq_dim=256, ffn_dim=32, num_layers=2,
                           cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, image_dim=None,
                           added_kv_proj_dim=None, rope_max_seq_len=32)
        vae = dict(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, attn_scales=[],
                   temperal_downsample=[False, True, True], dropout=0.0)
        video = dict(max_sequence_length=16, num_frames=9, height=32, width=32)
    return text, transformer, vae, video


def token_ids(text_cfg, length):
    """The prompt's and the empty negative prompt's ids as the umT5 tokenizer pads them to L
    (padding="max_length": the words, then </s> = 1, then <pad> = 0) and their attention masks.
    The words are fixed ids spread over the vocabulary (no tokenizer is fetched here)."""
    vocab = text_cfg["vocab_size"]
    words = [(7919 * (i + 1)) % (vocab - 2) + 2 for i in range(min(6, length - 1))]
    prompt = words + [1]
    empty = [1]
    pad = lambda ids: ids + [0] * (length - len(ids))  # noqa: E731
    mask = lambda ids: [1] * len(ids) + [0] * (length - len(ids))  # noqa: E731
    return {"prompt": pad(prompt), "prompt_mask": mask(prompt), "negative": pad(empty), "negative_mask": mask(empty)}


def keeps_fp32(model, name):
    """diffusers' from_pretrained rule (models/model_loading_utils.py, load_model_dict_into_meta):
    a floating tensor whose dotted name has one of _keep_in_fp32_modules as a part stays float32."""
    return any(m in name.split(".") for m in (model._keep_in_fp32_modules or []))


def to_published_dtypes(model, dtype):
    """What from_pretrained(torch_dtype=dtype) leaves: every floating tensor of the state dict in
    dtype except those keeps_fp32 names; tensors outside the state dict (non-persistent buffers)
    untouched."""
    state = set(model.state_dict())
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if name in state and t.is_floating_point() and not keeps_fp32(model, name):
                t.data = t.data.to(dtype)
    return model


def build(component, spec):
    """The eager module, built after torch.manual_seed(0) (wan_reference.py reads the weights back
    from the export)."""
    text_cfg, transformer_cfg, vae_cfg, _ = spec
    torch.manual_seed(0)
    if component == "text_encoder":
        from transformers import UMT5Config, UMT5EncoderModel
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            model = UMT5EncoderModel(UMT5Config(**text_cfg))
        finally:
            torch.set_default_dtype(previous)
        return model.eval()
    if component == "transformer":
        from diffusers import WanTransformer3DModel

        return to_published_dtypes(WanTransformer3DModel(**transformer_cfg).eval(), torch.bfloat16)
    from diffusers import AutoencoderKLWan

    return AutoencoderKLWan(**vae_cfg).eval()


def check_dtype_rule(model, tmp):
    """At the small size: the transformer's dtypes equal a real save_pretrained/from_pretrained round
    trip with torch_dtype=bfloat16, tensor by tensor, values included."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    fresh = WanTransformer3DModel(**dict(model.config)).eval()
    folder = os.path.join(tmp, "dtype-check")
    fresh.save_pretrained(folder)
    loaded = WanTransformer3DModel.from_pretrained(folder, torch_dtype=torch.bfloat16).eval()
    shutil.rmtree(folder)
    ours = dict(list(model.named_parameters()) + list(model.named_buffers()))
    theirs = dict(list(loaded.named_parameters()) + list(loaded.named_buffers()))
    if set(ours) != set(theirs):
        raise SystemExit(f"wan_export: dtype rule: names differ: {sorted(set(ours) ^ set(theirs))[:10]}")
    for name, t in ours.items():
        if t.dtype != theirs[name].dtype or not torch.equal(t, theirs[name]):
            raise SystemExit(f"wan_export: dtype rule: {name} is {t.dtype}, from_pretrained gives {theirs[name].dtype}"
                             " (or other values)")
    kept = sorted({t.dtype for t in ours.values()}, key=str)
    log(f"transformer: dtypes as from_pretrained(torch_dtype=bfloat16) gives them ({len(ours)} tensors, {kept})")


class TextEncoder(nn.Module):
    """What WanPipeline._get_t5_prompt_embeds runs on ids and mask (the trimming to the mask's
    length and the zero padding after it are done by the caller)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        return self.model(input_ids, attention_mask).last_hidden_state


class Transformer(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, hidden_states, timestep, encoder_hidden_states):
        return self.model(hidden_states=hidden_states, timestep=timestep, encoder_hidden_states=encoder_hidden_states,
                          return_dict=False)[0]


def unscale(vae, latents):
    """WanPipeline's step between the loop and the VAE, op for op."""
    latents = latents.to(latents.device, dtype=vae.dtype)
    mean = torch.tensor(vae.config.latents_mean).view(1, vae.config.z_dim, 1, 1, 1).to(latents.device, latents.dtype)
    std = 1.0 / torch.tensor(vae.config.latents_std).view(1, vae.config.z_dim, 1, 1, 1).to(latents.device,
                                                                                           latents.dtype)
    return latents / std + mean


class VaeDecoder(nn.Module):
    """unscale, then AutoencoderKLWan.decode (its encoder and quant_conv are dropped: not exported)."""

    def __init__(self, vae):
        super().__init__()
        self.model = vae
        del self.model.encoder, self.model.quant_conv

    def forward(self, latents):
        return self.model.decode(unscale(self.model, latents), return_dict=False)[0]


def max_diff(what, a, b):
    if a.shape != b.shape or a.dtype != b.dtype:
        raise SystemExit(f"wan_export: {what}: traced {a.dtype}{tuple(a.shape)} != eager {b.dtype}{tuple(b.shape)}")
    return (a.double() - b.double()).abs().max().item()


def cases_for(component, spec, g):
    """The trace inputs first, then other inputs (and, for the transformer, one where only the
    timestep differs: it must matter)."""
    text_cfg, transformer_cfg, vae_cfg, video = spec
    L = video["max_sequence_length"]
    T = (video["num_frames"] - 1) // 4 + 1
    h, w = video["height"] // 8, video["width"] // 8
    if component == "text_encoder":
        ids = token_ids(text_cfg, L)
        as_t = lambda x: torch.tensor([x], dtype=torch.int64)  # noqa: E731
        other = torch.randint(2, text_cfg["vocab_size"], (1, L), generator=g)
        cases = [(as_t(ids["prompt"]), as_t(ids["prompt_mask"])), (as_t(ids["negative"]), as_t(ids["negative_mask"])),
                 (other, torch.ones(1, L, dtype=torch.int64))]
        # Published: the two prompts the pipeline encodes (a forward of the 5.7 B encoder takes about a
        # minute here, and each case runs three times).
        return cases if text_cfg["d_model"] < 1024 else cases[:2]
    if component == "transformer":
        x = [torch.randn(1, 16, T, h, w, generator=g).to(torch.bfloat16) for _ in range(2)]
        e = [torch.randn(1, L, text_cfg["d_model"], generator=g).to(torch.bfloat16) for _ in range(2)]
        t = [torch.tensor([t], dtype=torch.int64) for t in (999, 500)]
        return [(x[0], t[0], e[0]), (x[1], t[1], e[1]), (x[0], t[1], e[0])]
    return [(torch.randn(1, 16, T, h, w, generator=g),) for _ in range(2)]


def write_weights(name, traced, wrapper, tmp):
    from safetensors.torch import save_file

    tensors = {n: p.detach().cpu().contiguous() for n, p in traced.named_parameters()}
    buffers = []
    for n, b in traced.named_buffers():
        tensors[n] = b.detach().cpu().contiguous()
        buffers.append({"name": n, "dtype": str(b.dtype).replace("torch.", ""), "shape": list(b.shape)})
    eager = {n for n, _ in wrapper.named_parameters()} | {n for n, _ in wrapper.named_buffers()}
    if set(tensors) != eager:
        raise SystemExit(f"wan_export: {name}: traced names differ from the wrapper's: {sorted(set(tensors) ^ eager)[:10]}")
    entry = {"file": f"{name}.pt", "parameters": sum(p.numel() for _, p in traced.named_parameters()),
             "bytes": sum(t.numel() * t.element_size() for t in tensors.values()), "buffers": buffers,
             "dtypes": sorted({str(t.dtype).replace("torch.", "") for t in tensors.values()})}
    if name != "text_encoder":
        save_file(tensors, os.path.join(tmp, f"{name}.safetensors"))
        os.chmod(os.path.join(tmp, f"{name}.safetensors"), 0o644)
        entry["weights"] = f"{name}.safetensors"
    return entry


def weight_bytes(component, spec):
    """The component's weights as exported (in its published dtypes), counted on an empty (meta) build."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=True):
        model = build(component, spec)
    return sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))


def check_resources(component, spec, folder):
    """Refuses to start a component this machine cannot export: its build's peak memory (the
    transformer is built in float32 before its cast) and its files' disk, against MemAvailable and
    the free space of folder, both read now."""
    weights = weight_bytes(component, spec)
    built = 2 * weights if component == "transformer" else weights  # f32 before the cast to bf16
    memory = built + weights // 4 + (1 << 30)  # + the largest activations and the runtime, generously
    disk = weights if component == "text_encoder" else 2 * weights  # the module, and its safetensors
    with open("/proc/meminfo") as f:
        available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    free = shutil.disk_usage(folder).free
    gib = lambda n: f"{n / 2**30:.1f} GiB"  # noqa: E731
    log(f"{component}: weights {gib(weights)}; needs about {gib(memory)} of memory ({gib(available)} available) "
        f"and {gib(disk)} of disk ({gib(free)} free in {folder})")
    if available < memory or free < disk + (1 << 30):
        raise SystemExit(f"wan_export: {component}: not enough memory or disk to export it here: needs about "
                         f"{gib(memory)} of memory and {gib(disk)} of disk (+1 GiB spare); {gib(available)} available, "
                         f"{gib(free)} free. Free some, or export --size small")


def export_component(component, spec, tmp):
    """Builds, traces, checks and writes one component into tmp; returns its config entry."""
    text_cfg, transformer_cfg, vae_cfg, _ = spec
    check_resources(component, spec, tmp)
    t0 = time.time()
    model = build(component, spec)
    log(f"{component}: built in {time.time() - t0:.1f} s")
    if component == "transformer" and ARGS.size == "small":
        check_dtype_rule(model, tmp)
    wrapper = {"text_encoder": TextEncoder, "transformer": Transformer, "vae_decoder": VaeDecoder}[component](model)
    cases = cases_for(component, spec, torch.Generator().manual_seed(SEED))
    if component == "vae_decoder":
        want = model.decode(unscale(model, cases[0][0]), return_dict=False)[0]
        if not torch.equal(wrapper(*cases[0]), want):
            raise SystemExit("wan_export: the VaeDecoder wrapper differs from unscale + AutoencoderKLWan.decode")
    path = os.path.join(tmp, f"{component}.pt")
    with torch.no_grad():
        traced = torch.jit.trace(wrapper, cases[0], check_trace=False)
        traced.save(path)
        wants, checks = [], []
        for i, case in enumerate(cases):
            want = wrapper(*case)
            if not torch.isfinite(want.float()).all():
                raise SystemExit(f"wan_export: {component}: the eager output on case {i} is not finite")
            d = max_diff(component, traced(*case), want)
            log(f"{component}: case {i}: traced vs eager max |diff| {d}")
            if d != 0.0:
                raise SystemExit(f"wan_export: {component}: traced module differs from eager on case {i} by {d}")
            wants.append(want)
            checks.append({"case": i, "max_abs_diff": d, "eager_abs_max": want.float().abs().max().item()})
        if component == "transformer" and torch.equal(wants[0], wants[2]):
            raise SystemExit("wan_export: transformer: the timestep has no effect on the output")
        entry = write_weights(component, traced, wrapper, tmp)
        entry["trace_inputs"] = [{"dtype": str(x.dtype).replace("torch.", ""), "shape": list(x.shape)} for x in cases[0]]
        entry["output"] = {"dtype": str(wants[0].dtype).replace("torch.", ""), "shape": list(wants[0].shape)}
        del model, wrapper, traced  # the reload check holds one copy of the weights, never two
        reloaded = torch.jit.load(path)
        for i, case in enumerate(cases):
            d = max_diff(component, reloaded(*case), wants[i])
            log(f"{component}: case {i}: reloaded vs eager max |diff| {d}")
            if d != 0.0:
                raise SystemExit(f"wan_export: {component}: the reloaded module differs from eager on case {i} by {d}")
            checks[i]["max_abs_diff_reloaded"] = d
    entry["cls"] = {"text_encoder": "transformers.UMT5EncoderModel", "transformer": "diffusers.WanTransformer3DModel",
                    "vae_decoder": "diffusers.AutoencoderKLWan"}[component]
    entry["config"] = {"text_encoder": text_cfg, "transformer": transformer_cfg, "vae_decoder": vae_cfg}[component]
    entry["checks"] = checks
    entry["export_seconds"] = round(time.time() - t0, 1)
    log(f"{component}: {entry['parameters']} parameters, exported in {entry['export_seconds']} s")
    return entry


def main(args):
    spec = size_spec(args.size)
    torch.set_grad_enabled(False)
    if args.component:
        os.makedirs(args.out, exist_ok=True)
        entry = export_component(args.component, spec, args.out)
        with open(os.path.join(args.out, f"{args.component}.json"), "w") as f:
            json.dump(entry, f, indent=1)
        return
    t_start = time.time()
    tmp = f"{args.out}.tmp-{os.getpid()}"
    os.makedirs(tmp)
    try:
        comps = {}
        for component in COMPONENTS:
            if args.size == "published":  # one component per process
                subprocess.run([sys.executable, __file__, "--size", args.size, "--out", tmp,
                                "--component", component], check=True)
                with open(os.path.join(tmp, f"{component}.json")) as f:
                    comps[component] = json.load(f)
                os.remove(os.path.join(tmp, f"{component}.json"))
            else:
                comps[component] = export_component(component, spec, tmp)
        text_cfg, transformer_cfg, vae_cfg, video = spec
        config = {
            "format": FORMAT,
            "size": args.size,
            "versions": versions(),
            "script": script_hash(),
            "torch_build": torch.__version__,
            "seed": "torch.manual_seed(0) before building each component",
            "wrapper_prefix": PREFIX,
            "max_sequence_length": video["max_sequence_length"],
            "num_frames": video["num_frames"],
            "height": video["height"],
            "width": video["width"],
            "latent_channels": 16,
            "latent_frames": (video["num_frames"] - 1) // 4 + 1,
            "vae_scale_factor_temporal": 4,
            "vae_scale_factor_spatial": 8,
            "vocab_size": text_cfg["vocab_size"],
            "text_dim": text_cfg["d_model"],
            "token_ids": token_ids(text_cfg, video["max_sequence_length"]),
            "scheduler": {"cls": "diffusers.UniPCMultistepScheduler", "config": SCHEDULER},
            "components": comps,
            "export_seconds": round(time.time() - t_start, 1),
        }
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config, f, indent=1)
        old = None
        if os.path.exists(args.out):
            old = f"{args.out}.old-{os.getpid()}"
            os.rename(args.out, old)
        os.rename(tmp, args.out)
        if old:
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    sizes = {n: os.path.getsize(os.path.join(args.out, n)) for n in sorted(os.listdir(args.out))}
    log(f"wrote {args.out} in {time.time() - t_start:.1f} s: {sizes}")
    print(f"wan_export: wrote {args.out}")


if __name__ == "__main__":
    main(ARGS)
