"""Exports the neural parts of diffusers' ShapEImg2ImgPipeline (OpenAI's Shap-E, image to 3D) as
TorchScript modules with seeded random weights (trained weights cannot be fetched here), for
stageload's staged Shap-E pipeline (crates/pipelines/src/shap_e/mod.rs) and for
scripts/reference/shap_e_reference.py, which runs diffusers' own pipeline on the same weights.

    python shap_e_export.py --size {small,published} --out DIR

Writes into DIR (atomically: DIR.tmp-<pid>, renamed at the end):
  image_encoder.pt  pixel_values f32 [1, 3, 224, 224]
                      -> CLIPVisionModel's last_hidden_state[:, 1:] [1, 256, hidden] (the pipeline's image_embeds)
  prior.pt          hidden_states f32 [2, E, D] (CFG batch: uncond, cond), timestep 0-d f32,
                    proj_embedding f32 [2, 256, hidden] -> predicted_image_embedding [2, E, 2D]
  renderer.pt       ShapERenderer with five traced methods (torch.jit.trace_module, one set of tensors):
                      forward(latent [1, E, D]) -> the 4 projected MLP weights (params_proj, squeezed)
                      render_rays(rays [1, 4096, 2, 3], w0..w3) -> channels [1, 4096, 3]: decode_to_image's
                          coarse (64 stratified samples) then fine (128 importance samples) pass over one
                          ray batch. It draws from torch's GLOBAL generator (rand_like, rand, rand), which
                          the caller seeds with manual_seed(0) before every batch, as diffusers'
                          StratifiedRaySampler.sample does.
                      sdf(positions [1, n, 3], w0..w3) -> signed_distance [1, n, 1] (MLP, fine, stf)
                      texture(positions [1, n, 3], w0..w3) -> linear-RGB channels [1, n, 3] (MLP, fine, stf,
                          then _convert_srgb_to_linear)
                      marching_cubes(field [G+2, G+2, G+2]) -> verts f32 [V, 3], faces int64 [F, 3] (MeshDecoder)
                    The 4 MLP layers params_proj makes take their weights as inputs: the module keeps no
                    copy of them (diffusers copies the projections into mlp.0-3.weight before rendering;
                    a linear layer fed the same values computes the same result).
  NAME.safetensors  every parameter and buffer of NAME.pt under the traced module's names
  scheduler.json    HeunDiscreteScheduler's config and its log_sigmas table (shap_e_scheduler.py)
  preprocessor_config.json  CLIPImageProcessor's config (the published one)
  config.json       the component configs, shapes, versions, checks, the recipe constants

Weights: torch.manual_seed(0) before building each component. The renderer's marching-cubes tables
(buffers diffusers leaves all zero at init; the published checkpoint carries OpenAI's) are built
here (mc_tables below). So that the random renderer gives a small closed surface rather than
millions of faces, the signed-distance output's bias is set to +0.3 and the field made positive
all over the box (the surface is then the box's boundary, coloured by the MLP); so that the
rendered views are not blank, the two density outputs' biases are raised by 2 (the box is then a
cloud whose opacity grows with the ray's path through it). How the field is kept positive differs
by size (RENDERER_WEIGHTS):
  published  params_proj's tensors scaled by 0.01: the four layers it makes have weights near 0.
  small      the signed-distance output's weights (mlp.mlp.6.weight[0]) set to 0, params_proj left
             as initialised. Scaled by 0.01 as the published size is, the four layers' weights
             have a standard deviation of 0.0088, a gain of at most 0.09 a layer (93 inputs, then
             16), under 1e-5 over the four: the position's part vanishes in the biases' rounding
             and every vertex got the same colour to the last bit (measured), so the colour
             comparison with diffusers could not see a vertex given another's colour. As
             initialised, the colours vary over the surface (per channel standard deviations of
             0.07-0.3 across the vertices on a random latent).

Every traced method is checked against diffusers' eager code, bit for bit, on its trace inputs and
on other inputs, in memory and after torch.jit.save/load; the whole render and mesh recipes built
from the traced methods (what the Rust side runs) are checked against the renderer's own
decode_to_image and decode_to_mesh. Any difference fails the export.
The published size exports one component per process (tracing all three in one process peaked at
11.4 GB here). If DIR/config.json already names the same size, format, versions and scripts, nothing is done."""
import argparse
import builtins
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
COMPONENTS = ("image_encoder", "prior", "renderer")
LAYERS = 4  # the MLP layers whose weights params_proj makes
RAY_BATCH = 4096  # decode_to_image's ray_batch_size
QUERY_BATCH = 4096  # decode_to_mesh's query_batch_size
N_COARSE, N_FINE = 64, 128  # decode_to_image's defaults
GRID = 128  # decode_to_mesh's grid_size
SDF_BIAS, DENSITY_RAISE = 0.3, 2.0
# How the random renderer's field is kept positive over the box, per size (see the module doc):
# params_proj's scale, and whether the signed-distance output's weights are set to 0.
RENDERER_WEIGHTS = {"published": dict(proj_scale=0.01, flat_sdf=False), "small": dict(proj_scale=1.0, flat_sdf=True)}

sys.dont_write_bytecode = True


def log(*a):
    print("shap_e_export:", *a, file=sys.stderr, flush=True)


def versions():
    return {p: importlib.metadata.version(p) for p in ("torch", "diffusers", "transformers", "safetensors", "numpy")}


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=["small", "published"], required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--component", choices=COMPONENTS, help="(internal) export only this one into --out")
    args = ap.parse_args()
    args.out = os.path.abspath(args.out.rstrip("/"))
    return args


def script_hash():
    """The export's scripts (this one and the scheduler's): a changed script redoes the export."""
    import hashlib

    here = os.path.dirname(os.path.abspath(__file__))
    digest = hashlib.sha256()
    for name in ("shap_e_export.py", "shap_e_scheduler.py"):
        with open(os.path.join(here, name), "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()[:16]


def up_to_date(args):
    try:
        with open(os.path.join(args.out, "config.json")) as f:
            old = json.load(f)
    except (OSError, ValueError):
        return False
    if (old.get("size"), old.get("format"), old.get("versions"), old.get("script")) == (
            args.size, FORMAT, versions(), script_hash()):
        return True
    log(f"{args.out} holds an export of another size, format or version; redoing it")
    return False


if __name__ == "__main__":
    ARGS = parse_args()
    if ARGS.component is None and up_to_date(ARGS):
        print(f"shap_e_export: {ARGS.out} up to date")
        sys.exit(0)

import torch  # noqa: E402  (after the up-to-date check: importing torch takes seconds)
from torch import nn  # noqa: E402

warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=UserWarning, module="torch.jit")

# The published image processor (openai/shap-e-img2img, image_processor/preprocessor_config.json).
PREPROCESSOR = dict(
    crop_size=224, do_center_crop=True, do_normalize=True, do_resize=True,
    image_mean=[0.48145466, 0.4578275, 0.40821073], image_std=[0.26862954, 0.26130258, 0.27577711],
    resample=3, size=224,
)


def size_spec(size):
    """(clip vision config, prior config, renderer config, the renderer's weight adjustments): the
    published ones (openai/shap-e-img2img's config.json files) or a small configuration of the same
    block types, and RENDERER_WEIGHTS[size]."""
    if size == "published":
        clip = dict(hidden_size=1024, intermediate_size=4096, projection_dim=768, num_hidden_layers=24,
                    num_attention_heads=16, num_channels=3, image_size=224, patch_size=14,
                    hidden_act="quick_gelu", layer_norm_eps=1e-5)
        prior = dict(num_attention_heads=8, attention_head_dim=128, num_layers=24, embedding_dim=1024,
                     num_embeddings=1024, additional_embeddings=0, time_embed_act_fn="gelu",
                     norm_in_type="layer", embedding_proj_norm_type="layer", encoder_hid_proj_type=None,
                     added_emb_type=None, time_embed_dim=4096, embedding_proj_dim=1024, clip_embed_dim=2048)
        hidden = 256
    else:
        clip = dict(hidden_size=32, intermediate_size=64, projection_dim=32, num_hidden_layers=2,
                    num_attention_heads=4, num_channels=3, image_size=224, patch_size=14,
                    hidden_act="quick_gelu", layer_norm_eps=1e-5)
        prior = dict(num_attention_heads=2, attention_head_dim=32, num_layers=2, embedding_dim=32,
                     num_embeddings=64, additional_embeddings=0, time_embed_act_fn="gelu",
                     norm_in_type="layer", embedding_proj_norm_type="layer", encoder_hid_proj_type=None,
                     added_emb_type=None, time_embed_dim=256, embedding_proj_dim=32, clip_embed_dim=64)
        hidden = 16
    # params_proj's four matrices have `hidden` rows each: together the prior's num_embeddings vectors.
    assert 4 * hidden == prior["num_embeddings"]
    renderer = dict(
        param_names=[f"nerstf.mlp.{i}.weight" for i in range(LAYERS)],
        param_shapes=[[hidden, 93]] + [[hidden, hidden]] * 3,
        d_latent=prior["embedding_dim"], d_hidden=hidden, n_output=12, n_hidden_layers=6, act_fn="swish",
        insert_direction_at=4, background=[255.0, 255.0, 255.0],
    )
    return clip, prior, renderer, RENDERER_WEIGHTS[size]


def mc_tables():
    """Marching-cubes tables in MeshDecoder's layout, built here from the cube's geometry: for each
    of the 256 corner states (bit c set: corner c = (c&1, c>>1&1, c>>2&1) has field > 0, inside),
    up to 5 triangles over the 12 cube edges (cases int64 [256, 5, 3]: local edge indices;
    masks bool [256, 5]: which triangles exist). Edge numbering is MeshDecoder's: the x edges, then
    the y edges, then the z edges, each group in the order of its lower corner. On every face the
    contour joins the face's crossed edges; a face whose inside corners are diagonal cuts each inside
    corner off alone (both cubes sharing a face decide alike, so the surface is closed). Segments are
    oriented so that each triangle's normal (v1 - v0) x (v2 - v0) points out of the inside region.
    Each cube's segments close into loops, fanned into triangles."""
    edges = [(a, a | bit) for bit in (1, 2, 4) for a in range(8) if not a & bit]
    index = {e: i for i, e in enumerate(edges)}

    def pos(c):
        return (c & 1, c >> 1 & 1, c >> 2 & 1)

    def mid(e):
        a, b = pos(e[0]), pos(e[1])
        return tuple((x + y) / 2 for x, y in zip(a, b))

    def sub(a, b):
        return tuple(x - y for x, y in zip(a, b))

    def cross(a, b):
        return (a[1] * b[2] - a[2] * b[1], a[2] * b[0] - a[0] * b[2], a[0] * b[1] - a[1] * b[0])

    def dot(a, b):
        return sum(x * y for x, y in zip(a, b))

    # The six faces: (axis, side), their four corners in cyclic order, their outward normal.
    faces = []
    for axis in range(3):
        u, v = [a for a in range(3) if a != axis]
        for side in (0, 1):
            ring = []
            for du, dv in ((0, 0), (1, 0), (1, 1), (0, 1)):
                p = [0, 0, 0]
                p[axis], p[u], p[v] = side, du, dv
                ring.append(p[0] + 2 * p[1] + 4 * p[2])
            normal = [0, 0, 0]
            normal[axis] = 1 if side else -1
            faces.append((ring, tuple(normal)))

    cases = torch.zeros(256, 5, 3, dtype=torch.long)
    masks = torch.zeros(256, 5, dtype=torch.bool)
    for state in range(256):
        inside = [bool(state >> c & 1) for c in range(8)]
        nxt = {}
        for ring, normal in faces:
            face_edges = [tuple(sorted((ring[k], ring[(k + 1) % 4]))) for k in range(4)]
            crossed = [e for e in face_edges if inside[e[0]] != inside[e[1]]]
            if len(crossed) == 2:
                pairs = [tuple(crossed)]
            elif len(crossed) == 4:  # diagonal inside corners: cut each off alone
                pairs = [tuple(e for e in face_edges if c in e) for c in ring if inside[c]]
            else:
                pairs = []
            for e1, e2 in pairs:
                start, end = mid(e1), mid(e2)
                corner = e1[0] if inside[e1[0]] else e1[1]
                d = sub(pos(corner), start)
                if dot(cross(sub(end, start), d), normal) > 0:
                    e1, e2 = e2, e1
                if e1 in nxt:
                    raise SystemExit(f"mc_tables: state {state}: edge {e1} starts two segments")
                nxt[e1] = e2
        tris = []
        while nxt:
            first = min(nxt)
            loop = [first]
            while nxt[loop[-1]] != first:
                loop.append(nxt[loop[-1]])
            for e in loop:
                del nxt[e]
            tris += [(loop[0], loop[i], loop[i + 1]) for i in range(1, len(loop) - 1)]
        if len(tris) > 5:
            raise SystemExit(f"mc_tables: state {state} needs {len(tris)} triangles; MeshDecoder holds 5")
        for j, tri in enumerate(tris):
            cases[state, j] = torch.tensor([index[e] for e in tri])
            masks[state, j] = True
    return cases, masks


def build(component, spec):
    """The eager module, built after torch.manual_seed(0) (shap_e_reference.py rebuilds them alike)."""
    clip_cfg, prior_cfg, renderer_cfg, adjust = spec
    torch.manual_seed(0)
    if component == "image_encoder":
        from transformers import CLIPVisionConfig, CLIPVisionModel
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        cfg = CLIPVisionConfig(**clip_cfg)
        cfg._attn_implementation = "sdpa"
        return CLIPVisionModel(cfg).eval()
    if component == "prior":
        from diffusers import PriorTransformer

        return PriorTransformer(**prior_cfg).eval()
    from diffusers.pipelines.shap_e.renderer import ShapERenderer

    cfg = dict(renderer_cfg)
    cfg["param_shapes"] = tuple(tuple(s) for s in cfg["param_shapes"])
    cfg["param_names"] = tuple(cfg["param_names"])
    cfg["background"] = tuple(cfg["background"])
    renderer = ShapERenderer(**cfg).eval()
    cases, masks = mc_tables()
    with torch.no_grad():
        renderer.mesh_decoder.cases.copy_(cases)
        renderer.mesh_decoder.masks.copy_(masks)
        if adjust["proj_scale"] != 1.0:
            for p in renderer.params_proj.parameters():
                p.mul_(adjust["proj_scale"])
        if adjust["flat_sdf"]:
            renderer.mlp.mlp[-1].weight[0] = 0.0
        renderer.mlp.mlp[-1].bias[0] = SDF_BIAS
        renderer.mlp.mlp[-1].bias[1:3] += DENSITY_RAISE
    return renderer


class ImageEncoder(nn.Module):
    """What ShapEImg2ImgPipeline._encode_image runs on a pixel tensor."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, pixel_values):
        return self.model(pixel_values)["last_hidden_state"][:, 1:, :].contiguous()


class Prior(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, hidden_states, timestep, proj_embedding):
        return self.model(hidden_states, timestep=timestep, proj_embedding=proj_embedding).predicted_image_embedding


class Renderer(nn.Module):
    """ShapERenderer's decode paths as methods over the same tensors; the MLP's projected layers
    take their weights as arguments (see the module doc)."""

    def __init__(self, renderer):
        super().__init__()
        self.model = renderer
        for i in range(LAYERS):
            del self.model.mlp.mlp[i].weight

    def _weights(self, ws):
        for layer, w in zip(self.model.mlp.mlp[:LAYERS], ws):
            layer.weight = w

    def _drop_weights(self):
        for layer in self.model.mlp.mlp[:LAYERS]:
            if "weight" in layer.__dict__:
                del layer.weight

    def forward(self, latent):
        projected = self.model.params_proj(latent)
        return tuple(projected[f"nerstf.mlp.{i}.weight"].squeeze(0) for i in range(LAYERS))

    def render_rays(self, rays, w0, w1, w2, w3):
        from diffusers.pipelines.shap_e.renderer import StratifiedRaySampler

        self._weights((w0, w1, w2, w3))
        try:
            _, fine_sampler, coarse = self.model.render_rays(rays, StratifiedRaySampler(), N_COARSE)
            channels, _, _ = self.model.render_rays(rays, fine_sampler, N_FINE, prev_model_out=coarse)
            return channels
        finally:
            self._drop_weights()

    def _stf(self, positions, ws):
        self._weights(ws)
        try:
            return self.model.mlp(position=positions, direction=None, ts=None, nerf_level="fine", rendering_mode="stf")
        finally:
            self._drop_weights()

    def sdf(self, positions, w0, w1, w2, w3):
        return self._stf(positions, (w0, w1, w2, w3)).signed_distance

    def texture(self, positions, w0, w1, w2, w3):
        from diffusers.pipelines.shap_e.renderer import _convert_srgb_to_linear

        return _convert_srgb_to_linear(self._stf(positions, (w0, w1, w2, w3)).channels)

    def marching_cubes(self, field):
        volume = self.model.volume
        out = self.model.mesh_decoder(field, volume.bbox_min, volume.bbox_max - volume.bbox_min)
        return out.verts, out.faces


class TracedLen:
    """MeshDecoder sizes two tensors with len(), which a trace bakes into a constant (the vertex
    count of the traced field); while tracing, renderer.py's `len` reads tensor sizes the tracer
    records instead (the eager code, which the checks run, is untouched)."""

    def __enter__(self):
        import diffusers.pipelines.shap_e.renderer as r

        self.module = r
        r.len = lambda x: x.shape[0] if isinstance(x, torch.Tensor) else builtins.len(x)

    def __exit__(self, *exc):
        del self.module.len


def max_diff(what, a, b):
    if isinstance(a, (tuple, list)):
        return max(max_diff(what, x, y) for x, y in zip(a, b, strict=True))
    if a.shape != b.shape or a.dtype != b.dtype:
        raise SystemExit(f"shap_e_export: {what}: traced {a.dtype}{tuple(a.shape)} != eager {b.dtype}{tuple(b.shape)}")
    if a.numel() == 0:
        return 0.0
    return (a.double() - b.double()).abs().max().item()


def checked(name, traced, reloaded, method, cases, eager_fn, before=None):
    """Runs method on every case through the traced module (in memory and reloaded) and eager_fn,
    requiring bit equality; returns the check records."""
    checks = []
    for i, case in enumerate(cases):
        outs = []
        for fn in (lambda *a: getattr(traced, method)(*a), lambda *a: getattr(reloaded, method)(*a), eager_fn):
            if before:
                before()
            outs.append(fn(*case))
        d_mem, d_file = max_diff(f"{name}.{method}", outs[0], outs[2]), max_diff(f"{name}.{method}", outs[1], outs[2])
        log(f"{name}.{method}: case {i}: traced vs eager max |diff| {d_mem} (reloaded {d_file})")
        if d_mem != 0.0 or d_file != 0.0:
            raise SystemExit(f"shap_e_export: {name}.{method} differs from eager on case {i}: {d_mem} / {d_file}")
        checks.append({"method": method, "case": i, "max_abs_diff": d_mem, "max_abs_diff_reloaded": d_file})
    return checks


def write_weights(name, module, wrapper, tmp):
    from safetensors.torch import save_file

    tensors = {n: p.detach().cpu().contiguous() for n, p in module.named_parameters()}
    buffers = []
    for n, b in module.named_buffers():
        tensors[n] = b.detach().cpu().contiguous()
        buffers.append({"name": n, "dtype": str(b.dtype).replace("torch.", ""), "shape": list(b.shape)})
    eager = {n for n, _ in wrapper.named_parameters()} | {n for n, _ in wrapper.named_buffers()}
    if set(tensors) != eager:
        raise SystemExit(f"shap_e_export: {name}: traced names differ from the wrapper's: {sorted(set(tensors) ^ eager)[:10]}")
    path = os.path.join(tmp, f"{name}.safetensors")
    save_file(tensors, path)
    os.chmod(path, 0o644)
    params = sum(p.numel() for _, p in module.named_parameters())
    return {"file": f"{name}.pt", "weights": f"{name}.safetensors", "parameters": params, "buffers": buffers}


def pan_rays(size):
    from diffusers.pipelines.shap_e.camera import create_pan_cameras

    return create_pan_cameras(size).camera_rays


def export_component(component, spec, tmp):
    """Builds, traces, checks and writes one component into tmp; returns its config entry."""
    clip_cfg, prior_cfg, renderer_cfg, _ = spec
    t0 = time.time()
    model = build(component, spec)
    log(f"{component}: built in {time.time() - t0:.1f} s")
    g = torch.Generator().manual_seed(1234)
    path = os.path.join(tmp, f"{component}.pt")
    with torch.no_grad():
        if component == "image_encoder":
            wrapper = ImageEncoder(model)
            cases = [(torch.randn(1, 3, 224, 224, generator=g),) for _ in range(2)]
            traced = torch.jit.trace(wrapper, cases[0], check_trace=False)
            traced.save(path)
            reloaded = torch.jit.load(path)
            checks = checked(component, traced, reloaded, "forward", cases,
                             lambda x: model(x)["last_hidden_state"][:, 1:, :].contiguous())
            entry = {"config": clip_cfg, "cls": "transformers.CLIPVisionModel", "attn_implementation": "sdpa"}
        elif component == "prior":
            wrapper = Prior(model)
            e, d, h = prior_cfg["num_embeddings"], prior_cfg["embedding_dim"], prior_cfg["embedding_proj_dim"]
            cases = [(torch.randn(2, e, d, generator=g), torch.tensor(t, dtype=torch.float32),
                      torch.randn(2, 256, h, generator=g)) for t in (1023.0, 17.3, 0.0)]
            cases[1] = (cases[0][0], cases[1][1], cases[0][2])  # only the timestep differs: it must matter
            traced = torch.jit.trace(wrapper, cases[0], check_trace=False)
            traced.save(path)
            reloaded = torch.jit.load(path)
            checks = checked(component, traced, reloaded, "forward", cases,
                             lambda x, t, p: model(x, timestep=t, proj_embedding=p).predicted_image_embedding)
            if torch.equal(traced(*cases[0]), traced(*cases[1])):
                raise SystemExit("shap_e_export: prior: the timestep has no effect on the traced module")
            entry = {"config": prior_cfg, "cls": "diffusers.PriorTransformer"}
        else:
            entry, wrapper, traced, reloaded, checks = export_renderer(model, spec, g, path)
    entry.update(write_weights(component, traced, wrapper, tmp))
    entry["checks"] = checks
    entry["export_seconds"] = round(time.time() - t0, 1)
    log(f"{component}: {entry['parameters']} parameters, exported in {entry['export_seconds']} s")
    return entry


def export_renderer(model, spec, g, path):
    _, prior_cfg, renderer_cfg, adjust = spec
    e, d = prior_cfg["num_embeddings"], prior_cfg["embedding_dim"]
    wrapper = Renderer(model)
    latents = [torch.randn(1, e, d, generator=g) for _ in range(2)]
    ws = [wrapper(latent) for latent in latents]
    rays = pan_rays(32)[:, :RAY_BATCH]
    rays2 = pan_rays(32)[:, RAY_BATCH:2 * RAY_BATCH]
    points = torch.rand(1, QUERY_BATCH, 3, generator=g) * 2 - 1
    short = torch.rand(1, 1000, 3, generator=g) * 2 - 1
    field = sphere_field(GRID + 2, 0.6)
    seed0 = lambda: torch.manual_seed(0)  # noqa: E731  (what StratifiedRaySampler.sample does first)
    with TracedLen():
        seed0()
        traced = torch.jit.trace_module(wrapper, {
            "forward": (latents[0],),
            "render_rays": (rays, *ws[0]),
            "sdf": (points, *ws[0]),
            "texture": (points, *ws[0]),
            "marching_cubes": (field,),
        }, check_trace=False)
    traced.save(path)
    reloaded = torch.jit.load(path)
    w_of = lambda i: ws[i]  # noqa: E731
    checks = checked("renderer", traced, reloaded, "forward", [(x,) for x in latents], wrapper.forward)
    # One batch here on other rays and weights than the trace's; check_recipes renders whole views.
    checks += checked("renderer", traced, reloaded, "render_rays", [(rays2, *w_of(1))], wrapper.render_rays,
                      before=seed0)
    checks += checked("renderer", traced, reloaded, "sdf", [(points, *w_of(0)), (short, *w_of(1))], wrapper.sdf)
    checks += checked("renderer", traced, reloaded, "texture", [(points, *w_of(0)), (short, *w_of(1))], wrapper.texture)
    # Eager MeshDecoder (len() untouched) against the trace on fields with other vertex counts:
    # the trace field, a smaller sphere, an empty field (check_recipes adds the model's own field).
    checks += checked("renderer", traced, reloaded, "marching_cubes",
                      [(field,), (sphere_field(GRID + 2, 0.3),), (torch.full_like(field, -1.0),)],
                      wrapper.marching_cubes)
    check_sphere(wrapper, 0.6)
    entry = {"config": renderer_cfg, "cls": "diffusers.pipelines.shap_e.renderer.ShapERenderer",
             "methods": ["forward", "render_rays", "sdf", "texture", "marching_cubes"],
             "weights_note": f"params_proj scaled by {adjust['proj_scale']}, "
                             f"mlp.mlp.6.weight[0] {'= 0' if adjust['flat_sdf'] else 'as initialised'}, "
                             f"mlp.mlp.6.bias[0] = {SDF_BIAS}, "
                             f"mlp.mlp.6.bias[1:3] raised by {DENSITY_RAISE}; "
                             "mesh_decoder.cases/masks from shap_e_export.mc_tables"}
    entry["recipe_checks"] = check_recipes(traced, model, latents[0])
    return entry, wrapper, traced, reloaded, checks


def sphere_field(n, radius):
    """A signed distance field on an n^3 grid over [-1, 1]^3, positive inside a sphere."""
    axis = torch.linspace(-1, 1, n)
    x, y, z = torch.meshgrid(axis, axis, axis, indexing="ij")
    return radius - torch.sqrt(x * x + y * y + z * z)


def check_sphere(wrapper, radius):
    """The tables make a closed surface on the sphere: every vertex near it, every edge in two faces,
    faces oriented outward (mean of normal . position > 0)."""
    mesh = wrapper.model.mesh_decoder(sphere_field(GRID + 2, radius), torch.tensor([-1.0] * 3), torch.tensor([2.0] * 3))
    v, f = mesh.verts, mesh.faces
    r = v.norm(dim=1)
    step = 2.0 / (GRID + 1)
    if f.shape[0] == 0 or (r - radius).abs().max() > step:
        raise SystemExit(f"shap_e_export: mc_tables: the sphere's mesh is wrong ({f.shape[0]} faces, "
                         f"radius error {(r - radius).abs().max().item() if f.shape[0] else 'n/a'})")
    edges = torch.cat([f[:, [0, 1]], f[:, [1, 2]], f[:, [2, 0]]]).sort(dim=1).values
    _, counts = torch.unique(edges, dim=0, return_counts=True)
    n = torch.cross(v[f[:, 1]] - v[f[:, 0]], v[f[:, 2]] - v[f[:, 0]], dim=1)
    outward = (n * v[f].mean(dim=1)).sum(dim=1)
    if not (counts == 2).all() or not (outward > 0).all():
        raise SystemExit(f"shap_e_export: mc_tables: the sphere's mesh is not closed and outward "
                         f"(edge uses {counts.unique().tolist()}, {(outward <= 0).sum().item()} inward faces)")
    log(f"mc_tables: sphere r={radius}: {v.shape[0]} vertices, {f.shape[0]} faces, closed, outward")


def render_recipe(traced, latent, size):
    """decode_to_image from the traced methods: what the Rust side runs."""
    ws = traced(latent)
    rays = pan_rays(size)
    out = []
    for i in range(rays.shape[1] // RAY_BATCH):
        torch.manual_seed(0)
        out.append(traced.render_rays(rays[:, i * RAY_BATCH:(i + 1) * RAY_BATCH], *ws))
    return torch.cat(out, dim=1).view(1, 20, size, size, -1).squeeze(0)


def mesh_recipe(traced, latent):
    """decode_to_mesh from the traced methods: what the Rust side runs."""
    from diffusers.pipelines.shap_e.renderer import volume_query_points

    ws = traced(latent)

    class Volume:
        bbox_min = torch.tensor([-1.0, -1.0, -1.0])
        bbox_max = torch.tensor([1.0, 1.0, 1.0])

    q = volume_query_points(Volume, GRID)[None]
    sdf = torch.cat([traced.sdf(q[:, i:i + QUERY_BATCH], *ws) for i in range(0, q.shape[1], QUERY_BATCH)], dim=1)
    full = torch.zeros(1, GRID + 2, GRID + 2, GRID + 2)
    full.fill_(-1.0)
    full[:, 1:-1, 1:-1, 1:-1] = sdf.reshape(1, GRID, GRID, GRID)
    verts, faces = traced.marching_cubes(full[0])
    if verts.shape[0] == 0:
        return verts, faces, torch.zeros(0, 3)
    pos = verts[torch.arange(0, verts.shape[0]) % verts.shape[0]][None]
    tex = torch.cat([traced.texture(pos[:, i:i + QUERY_BATCH], *ws) for i in range(0, pos.shape[1], QUERY_BATCH)], dim=1)
    return verts, faces, tex[0]


def check_recipes(traced, renderer, latent):
    """The recipes against diffusers' decode_to_image and decode_to_mesh (on a fresh renderer
    with the same weights: decode copies into mlp.0-3.weight, which the wrapper removed)."""
    spec_renderer = renderer_copy(renderer)
    want = spec_renderer.decode_to_image(latent, "cpu", size=32)
    got = render_recipe(traced, latent, 32)
    d_img = max_diff("render recipe", got, want)
    mesh = spec_renderer.decode_to_mesh(latent, "cpu")
    verts, faces, tex = mesh_recipe(traced, latent)
    want_tex = torch.stack([mesh.vertex_channels[c] for c in "RGB"], dim=-1)
    d_mesh = max(max_diff("mesh verts", verts, mesh.verts), max_diff("mesh faces", faces, mesh.faces),
                 max_diff("mesh colours", tex, want_tex))
    log(f"recipes: decode_to_image (size 32) max |diff| {d_img}; decode_to_mesh {d_mesh} "
        f"({verts.shape[0]} vertices, {faces.shape[0]} faces)")
    if d_img != 0.0 or d_mesh != 0.0:
        raise SystemExit("shap_e_export: the traced recipes differ from diffusers' decode_to_image/decode_to_mesh")
    return {"decode_to_image_size32": d_img, "decode_to_mesh": d_mesh, "vertices": verts.shape[0],
            "faces": faces.shape[0]}


def renderer_copy(renderer):
    """A renderer with the wrapper's weights and the mlp.0-3 weights back (their values are
    overwritten by decode anyway)."""
    from diffusers.pipelines.shap_e.renderer import ShapERenderer

    fresh = ShapERenderer(**renderer.config).eval()
    state = {k: v for k, v in renderer.state_dict().items()}
    missing = fresh.load_state_dict(state, strict=False).missing_keys
    if sorted(missing) != sorted(f"mlp.mlp.{i}.weight" for i in range(LAYERS)):
        raise SystemExit(f"shap_e_export: renderer copy: unexpected missing keys {missing}")
    return fresh


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
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import shap_e_scheduler
        from transformers import CLIPImageProcessor

        shap_e_scheduler.write_config(os.path.join(tmp, "scheduler.json"))
        CLIPImageProcessor(**PREPROCESSOR).to_json_file(os.path.join(tmp, "preprocessor_config.json"))
        _, prior_cfg, _, _ = spec
        config = {
            "format": FORMAT,
            "size": args.size,
            "versions": versions(),
            "script": script_hash(),
            "torch_build": torch.__version__,
            "seed": "torch.manual_seed(0) before building each component",
            "wrapper_prefix": PREFIX,
            "num_embeddings": prior_cfg["num_embeddings"],
            "embedding_dim": prior_cfg["embedding_dim"],
            "image_tokens": 256,
            "image_size": 224,
            "ray_batch": RAY_BATCH,
            "query_batch": QUERY_BATCH,
            "grid_size": GRID,
            "views": 20,
            "bbox_min": [-1.0, -1.0, -1.0],
            "bbox_max": [1.0, 1.0, 1.0],
            "scheduler": "scheduler.json",
            "preprocessor": "preprocessor_config.json",
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
    log(f"wrote {args.out} in {time.time() - t_start:.1f} s")
    print(f"shap_e_export: wrote {args.out}")


if __name__ == "__main__":
    main(ARGS)
