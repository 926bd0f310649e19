"""What the Python package's tests share: small models, their checkpoints, and readings of this
process's memory from /proc."""

from __future__ import annotations

import os

# MKL's CPU matrix products round by the operands' addresses unless told not to; a reload in place
# puts weights at other addresses than a first load, so the comparisons bit for bit need it (set
# before torch's first product: torch is imported below)
os.environ.setdefault("MKL_CBWR", "COMPATIBLE")

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn


def rss_bytes() -> int:
    """This process's resident memory, exact (``Rss`` of /proc/self/smaps_rollup, in kB)."""
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("Rss:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("/proc/self/smaps_rollup has no Rss line")


def storage_bytes(module: nn.Module) -> int:
    """Bytes of the distinct storages of a module's parameters and buffers."""
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for t in module.state_dict().values()
    }
    return sum(storages.values())


def mapped_from(tensor: torch.Tensor, path: Path) -> bool:
    """Whether ``tensor``'s memory lies in a mapping of ``path`` (``/proc/self/maps``)."""
    address, path = tensor.data_ptr(), str(Path(path).resolve())
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 6 and fields[5] == path:
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= address < end:
                return True
    return False


class Counted:
    """A loader that counts its calls."""

    def __init__(self, build: Callable[[], nn.Module]) -> None:
        self.build = build
        self.calls = 0

    def __call__(self) -> nn.Module:
        self.calls += 1
        return self.build()


def mlp(width: int = 16) -> nn.Module:
    return nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 4))


@pytest.fixture
def saved(tmp_path: Path) -> Callable[[str, nn.Module], Path]:
    """Writes a module's state dict as a safetensors file named after the model."""

    def save(name: str, module: nn.Module) -> Path:
        path = tmp_path / f"{name}.safetensors"
        save_file({k: v.contiguous() for k, v in module.state_dict().items()}, str(path))
        return path

    return save


@pytest.fixture(autouse=True)
def seeded() -> None:
    torch.manual_seed(0)


@pytest.fixture
def collections(monkeypatch) -> list[int]:
    """Each run of the registry's collection after a release (``_collect_file_maps``) appends
    one entry; the collection itself still runs."""
    from stageload_rs import registry

    runs: list[int] = []
    collect = registry._collect_file_maps
    monkeypatch.setattr(registry, "_collect_file_maps", lambda: (runs.append(1), collect())[1])
    return runs
