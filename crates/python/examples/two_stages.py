"""Two models, two stages, only one model in memory at a time: stageload_rs in a minute.

    scripts/setup-python.sh            # once: builds stageload_rs into the cached torch env
    ~/.cache/stageload/torch-2.13.0/bin/python crates/python/examples/two_stages.py

It writes the two checkpoints it reads into a temporary folder, runs the pipeline twice (the
second run refills the first model in place from its checkpoint), and says what each release gave
back and that both runs gave the same output.
"""

import tempfile
from pathlib import Path

import stageload_rs as stageload  # the original's API: moving from it is this line
import torch
from safetensors.torch import save_file
from torch import nn


def encoder() -> nn.Module:
    return nn.Sequential(nn.Linear(2048, 2048), nn.GELU(), nn.Linear(2048, 512))


def decoder() -> nn.Module:
    return nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 2048))


def main() -> None:
    folder = Path(tempfile.mkdtemp())
    torch.manual_seed(0)
    for name, build in (("encoder", encoder), ("decoder", decoder)):
        save_file(build().state_dict(), str(folder / f"{name}.safetensors"))

    events = stageload.ListSink()
    models = stageload.StagedModels(
        {"encoder": encoder, "decoder": decoder},
        stages={"encode": ["encoder"], "decode": ["decoder"]},
        checkpoints={name: [folder / f"{name}.safetensors"] for name in ("encoder", "decoder")},
        events=events,
    )
    x = torch.randn(4, 2048)
    outputs = []
    for _ in range(2):
        models.enter("encode")
        latent = models["encoder"](x)
        models.enter("decode")  # the encoder's storages are freed in place
        outputs.append(models["decoder"](latent))
    models.close()

    for event in events.events:
        if event.kind in ("load", "reload", "release"):
            how = event.fields.get("from", "")
            print(f"{event.kind:8} {event.name:8} {event.nbytes / 2**20:6.1f} MiB {how}")
    print("same output both runs:", torch.equal(outputs[0], outputs[1]))


if __name__ == "__main__":
    main()
