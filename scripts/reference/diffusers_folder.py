"""Writes an export (sd_export.py's, shap_e_export.py's or wan_export.py's folder) as a diffusers
folder, the way a user has one: the pipeline's `save_pretrained` of the same seeded weights (each
reference script's rebuild), with a tokenizer of whole words whose ids are the export's (`w12` is
id 12; DIR/diffusers/prompt.txt is the export's prompt in those words) where the pipeline has one.
The Python package's diffusers tests and its side-by-side benchmark load it with
`from_pretrained`, as a user would.

    python diffusers_folder.py --pipeline {sd,shap-e,wan} --components DIR   # writes DIR/diffusers

Up to date (nothing done) when DIR/config.json and this script are as when it was written.
"""

import argparse
import hashlib
import json
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def log(*a):
    print("diffusers_folder:", *a, file=sys.stderr, flush=True)


def words_tokenizer(size, specials, template, pad, max_length):
    """A fast tokenizer of whole words `w0` .. `w{size-1}`, `specials` ({token: id}) kept for
    themselves, `template` the post-processor's (e.g. "<s> $A </s>"), padded with `pad`."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(size) if i not in specials.values()}
    vocab.update(specials)
    words = Tokenizer(models.WordLevel(vocab, unk_token=pad))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    used = [(t, i) for t, i in specials.items() if t in template]
    words.post_processor = processors.TemplateProcessing(single=template, special_tokens=used)
    return PreTrainedTokenizerFast(tokenizer_object=words, pad_token=pad, unk_token=pad, model_max_length=max_length)


def words(ids, end):
    """The words of the ids before the first `end`."""
    return " ".join(f"w{i}" for i in ids[: ids.index(end)])


def stable_diffusion(dir_, cfg):
    from diffusers import DDIMScheduler, StableDiffusionPipeline
    from sd_reference import rebuild

    text, unet, vae, _ = rebuild(dir_, cfg)
    t = cfg["components"]["text_encoder"]["config"]
    bos, eos = t["bos_token_id"], t["eos_token_id"]
    tokenizer = words_tokenizer(t["vocab_size"], {"<|startoftext|>": bos, "<|endoftext|>": eos},
                                "<|startoftext|> $A <|endoftext|>", "<|endoftext|>", cfg["seq_len"])
    pipe = StableDiffusionPipeline(vae=vae, text_encoder=text, tokenizer=tokenizer, unet=unet,
                                   scheduler=DDIMScheduler(**cfg["scheduler"]["config"]), safety_checker=None,
                                   feature_extractor=None, requires_safety_checker=False)
    prompt = words(cfg["token_ids"]["prompt"][1:], eos)
    ids = tokenizer(prompt, padding="max_length", max_length=cfg["seq_len"]).input_ids
    return pipe, prompt, ids == cfg["token_ids"]["prompt"]


def shap_e(dir_, cfg):
    from shap_e_reference import build_pipeline

    return build_pipeline(dir_, cfg), None, True


def wan(dir_, cfg):
    import torch
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from safetensors.torch import load_file
    from wan_reference import bf16_umt5, load_into, strip

    comps, prefix = cfg["components"], cfg["wrapper_prefix"]
    # as wan_export.py builds them (bf16 umT5), the VAE whole: its encoder, which the export
    # leaves out and the pipeline never calls, keeps the seeded values it is built with
    torch.manual_seed(0)
    text_encoder = bf16_umt5(comps["text_encoder"]["config"])
    transformer = WanTransformer3DModel(**comps["transformer"]["config"])
    vae = AutoencoderKLWan(**comps["vae_decoder"]["config"])
    state = torch.jit.load(os.path.join(dir_, comps["text_encoder"]["file"])).state_dict()
    load_into(text_encoder, strip(dict(state), prefix), "text_encoder")
    load_into(transformer, strip(load_file(os.path.join(dir_, comps["transformer"]["weights"])), prefix), "transformer")
    load_into(vae, strip(load_file(os.path.join(dir_, comps["vae_decoder"]["weights"])), prefix), "vae_decoder",
              allowed_missing=("encoder.", "quant_conv."))
    t = comps["text_encoder"]["config"]
    tokenizer = words_tokenizer(t["vocab_size"], {"<pad>": t["pad_token_id"], "</s>": t["eos_token_id"]},
                                "$A </s>", "<pad>", cfg["max_sequence_length"])
    pipe = WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder.eval(), transformer=transformer.eval(),
                       vae=vae.eval(), scheduler=UniPCMultistepScheduler(**cfg["scheduler"]["config"]))
    ids = cfg["token_ids"]
    prompt = words(ids["prompt"], t["eos_token_id"])
    got = tokenizer([prompt, ""], padding="max_length", max_length=cfg["max_sequence_length"],
                    return_attention_mask=True)
    same = got.input_ids == [ids["prompt"], ids["negative"]] and got.attention_mask == [
        ids["prompt_mask"], ids["negative_mask"]]
    return pipe, prompt, same


PIPELINES = {"sd": stable_diffusion, "shap-e": shap_e, "wan": wan}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pipeline", choices=sorted(PIPELINES), required=True)
    ap.add_argument("--components", required=True)
    args = ap.parse_args()
    out = os.path.join(args.components, "diffusers")
    with open(os.path.join(args.components, "config.json"), "rb") as f:
        raw = f.read()
    with open(__file__, "rb") as f:
        stamp = hashlib.sha256(raw + f.read()).hexdigest()[:16]
    stamp_file = os.path.join(out, "stamp")
    if os.path.isfile(stamp_file) and open(stamp_file).read() == stamp:
        log(f"{out} is up to date")
        return
    import torch

    pipe, prompt, tokens_match = PIPELINES[args.pipeline](args.components, json.loads(raw))
    if not tokens_match:
        raise SystemExit(f"diffusers_folder: the tokenizer does not give the export's token ids for {prompt!r}")
    tmp = f"{out}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    with torch.no_grad():
        pipe.save_pretrained(tmp, safe_serialization=True)
    if prompt is not None:
        with open(os.path.join(tmp, "prompt.txt"), "w") as f:
            f.write(prompt)
    with open(os.path.join(tmp, "stamp"), "w") as f:
        f.write(stamp)
    shutil.rmtree(out, ignore_errors=True)
    os.rename(tmp, out)
    log(f"wrote {out}")


if __name__ == "__main__":
    main()
