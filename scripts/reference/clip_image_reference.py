"""Reference pixel values of transformers' CLIPImageProcessor as ShapEImg2ImgPipeline calls it
(CPU), for tests/clip_image.rs.

    python clip_image_reference.py OUT.safetensors CONFIG_DIR IMAGE...

Builds the processor class `from transformers import CLIPImageProcessor` gives (the class the
pipeline gets: without torchvision, transformers 5.24 falls back to CLIPImageProcessorPil) from
two configurations, writes each as transformers' own JSON into CONFIG_DIR (`shap_e.json`: the
published openai/shap-e-img2img image processor; `padded.json`: shortest edge 200 with a 256x240
crop, which pads the height and crops the width of a landscape image) and reads it back with
`from_json_file`, as scripts/reference/shap_e_reference.py does. For each IMAGE (index i) it opens
the file with PIL (`Image.open`, the image the pipeline gets) and writes
`self.image_processor(image, return_tensors="pt").pixel_values[0].unsqueeze(0)` under
`{i}.shap_e` and `{i}.padded` (float32 [1, 3, h, w]). CONFIG_DIR/class.txt gets the processor's
class name and module."""
import os
import sys

try:
    import PIL.Image
    import torch
    import transformers
    from safetensors.torch import save_file
except ImportError as error:
    sys.exit(
        f"clip_image_reference: {error} in {sys.prefix}; "
        'run eval "$(scripts/setup-reference.sh)", which installs transformers, '
        f"or install it by hand: {sys.executable} -m pip install transformers==5.24.0 pillow safetensors"
    )

# The published image processor (openai/shap-e-img2img, image_processor/preprocessor_config.json),
# as scripts/reference/shap_e_export.py writes it.
PUBLISHED = dict(
    crop_size=224, do_center_crop=True, do_normalize=True, do_resize=True,
    image_mean=[0.48145466, 0.4578275, 0.40821073], image_std=[0.26862954, 0.26130258, 0.27577711],
    resample=3, size=224,
)
PADDED = dict(PUBLISHED, size={"shortest_edge": 200}, crop_size={"height": 256, "width": 240})

if len(sys.argv) < 4:
    sys.exit(f"usage: {sys.argv[0]} OUT.safetensors CONFIG_DIR IMAGE...")
out, config_dir, images = sys.argv[1], sys.argv[2], sys.argv[3:]

# The name ShapEImg2ImgPipeline's module imports (`from transformers import CLIPImageProcessor`).
processor_class = transformers.CLIPImageProcessor
processors = {}
for name, kwargs in [("shap_e", PUBLISHED), ("padded", PADDED)]:
    path = os.path.join(config_dir, f"{name}.json")
    processor_class(**kwargs).to_json_file(path)
    processors[name] = processor_class.from_json_file(path)
cls = type(processors["shap_e"])
with open(os.path.join(config_dir, "class.txt"), "w") as file:
    file.write(f"{cls.__module__}.{cls.__name__}\n")

result = {}
for i, path in enumerate(images):
    with PIL.Image.open(path) as image:
        image.load()
        for name, processor in processors.items():
            pixels = processor(image, return_tensors="pt").pixel_values[0].unsqueeze(0)
            result[f"{i}.{name}"] = pixels.contiguous()
save_file(result, out)
print(
    f"clip_image_reference: {cls.__name__} (transformers {transformers.__version__}, "
    f"Pillow {PIL.__version__}, torch {torch.__version__}) on {len(images)} images"
)
